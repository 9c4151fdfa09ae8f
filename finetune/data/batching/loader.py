"""DataLoaders over prepared token rows (training: this rank's share; evaluation: Accelerate shards)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.collate import collate_rows
from finetune.data.batching.sampler import RankBatchSampler

MODEL_COLUMNS = ("input_ids", "labels", "position_ids")


class EpochSampler(torch.utils.data.Sampler):
    """Shuffles with a generator seeded by (seed, epoch): the order of any epoch is reproducible
    without saving sampler state, which makes mid-epoch resume exact."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        self.num_rows, self.seed, self.shuffle, self.epoch = num_rows, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.num_rows, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_rows


def make_dataloader(
    dataset,
    *,
    micro_batch_size: int,
    seed: int,
    pad_id: int,
    packed: bool,
    shuffle: bool,
    drop_last: bool,
    pad_to_multiple_of: int = 1,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
    num_replicas: int | None = None,
    rank: int = 0,
    columns: tuple[str, ...] = MODEL_COLUMNS,
    collate=None,
):
    """A DataLoader over prepared rows.

    With `num_replicas` (training), batches come from a RankBatchSampler: this rank's share, the
    same number of batches on every rank, no row repeated; such a loader is not passed through
    `accelerator.prepare`. Without it (evaluation), a plain sampler that Accelerate shards, so
    `gather_for_metrics` can drop the rows it repeats to even out the ranks. `collate` replaces the
    token-row collation (preference pairs bring their own).
    """
    dataset = dataset.select_columns([c for c in columns if c in dataset.column_names])
    if num_replicas is not None:
        batching: dict[str, Any] = {
            "batch_sampler": RankBatchSampler(
                len(dataset),
                micro_batch_size=micro_batch_size,
                num_replicas=num_replicas,
                rank=rank,
                seed=seed,
                shuffle=shuffle,
                drop_last=drop_last,
            )
        }
    else:
        batching = {
            "batch_size": micro_batch_size,
            "sampler": EpochSampler(len(dataset), seed, shuffle=shuffle),
            "drop_last": drop_last,
        }
    collate = collate or partial(
        collate_rows, pad_token_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, packed=packed
    )
    return torch.utils.data.DataLoader(
        dataset,
        **batching,
        collate_fn=collate,
        num_workers=num_workers,
        prefetch_factor=(prefetch_factor or 2) if num_workers > 0 else None,
        pin_memory=pin_memory and torch.cuda.is_available(),
        # Its own generator: creating an iterator draws the workers' base seed from it, not from the
        # global RNG, so a resumed run (which creates its iterator right after restoring the RNG
        # state) draws the same dropout masks as an uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
    )


def count_trainable(batch: dict) -> torch.Tensor:
    """Tokens that contribute to the loss: labels shifted by one (the model predicts t+1 from t)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def count_tokens(batch: dict) -> int:
    """Tokens the model reads in a batch (padding excluded when there is an attention mask)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def seq_stats(batch: dict) -> tuple[float, int]:
    """(sum of squared sequence lengths, number of tokens) of a batch, from position_ids resets (a batch
    without them, of unpacked vision-language rows: one sequence per row, its attention mask's length)."""
    if "position_ids" not in batch:
        lengths = batch["attention_mask"].sum(dim=1)
        return float((lengths.double() ** 2).sum()), int(lengths.sum())
    pos = batch["position_ids"]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    lengths = torch.diff(torch.nonzero(torch.cat([starts.flatten(), starts.new_ones(1)])).flatten())
    return float((lengths.double() ** 2).sum()), int(lengths.sum())
