"""Batches of cached latents: one bucket per batch, order reproducible from (seed, epoch).

`BucketBatchSampler` yields lists of `(row, flip)` pairs; `CachedLatents[(row, flip)]` reads that
row of the prepared dataset. Everything a sample needs (latents, caption embeddings, size
conditioning) comes from the same row, so any shuffle keeps latents and captions paired.
Like finetune.data.batching.loader.EpochSampler, an epoch's order depends only on (seed, epoch): resuming in the
middle of an epoch replays the same batches without saved sampler state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


class BucketBatchSampler(torch.utils.data.Sampler):
    """Shuffled same-bucket batches; with prior preservation, as many instance as class samples.

    Per epoch: the rows (instance rows cycled up to the class-row count, and the other way round,
    as diffusers' DreamBooth dataset pairs them) are shuffled, split by bucket into global batches of
    `batch_size x num_replicas` rows, and the global batches are shuffled. With `flip`, each sample
    also draws which cached variant (plain or flipped) it uses. Every rank computes the same global
    batches and takes its own slice of each: rank r the r-th `batch_size` rows. So every rank gets
    the same number of batches and no row is repeated within an epoch (Accelerate's
    BatchSamplerShard, given these variable-size batches, would skip every round that ends in a
    short batch and repeat batches to even out the ranks), and R processes train on the batches
    one process would with batch size R x b.

    A bucket's last, short global batch of L rows (0 < L < batch_size x num_replicas):
    - `drop_last`: not trained on this epoch (a different set each epoch);
    - L >= num_replicas: split over the ranks as evenly as possible (sizes differ by at most one);
    - L < num_replicas: added to the bucket's previous global batch, so ranks 0..L-1 get one row
      more; a bucket with fewer rows than processes cannot be split and is skipped
      (`dropped_rows` counts them, the trainer warns).
    With one process this is exactly a shuffled list of same-bucket batches of `batch_size`.
    """

    def __init__(
        self,
        buckets: np.ndarray,
        batch_size: int,
        *,
        seed: int,
        is_prior: np.ndarray | None = None,
        flip: bool = False,
        drop_last: bool = True,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.buckets = np.asarray(buckets, dtype=np.int64)
        self.is_prior = np.zeros(len(self.buckets), bool) if is_prior is None else np.asarray(is_prior, bool)
        self.batch_size, self.seed, self.flip = batch_size, seed, flip
        self.drop_last, self.shuffle, self.epoch = drop_last, shuffle, 0
        self.num_replicas, self.rank = num_replicas, rank
        self._cached: tuple[int, list] | None = None  # (epoch, batches): len() is asked at every log step

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _epoch_rows(self, rng: np.random.Generator) -> np.ndarray:
        instance, prior = np.flatnonzero(~self.is_prior), np.flatnonzero(self.is_prior)
        if len(prior) == 0:
            return rng.permutation(instance) if self.shuffle else instance
        count = max(len(instance), len(prior))
        parts = [rng.permutation(rows) if self.shuffle else rows for rows in (instance, prior)]
        return np.concatenate([np.resize(part, count) for part in parts])

    def _global_chunks(self, rows: np.ndarray) -> tuple[list[np.ndarray], int]:
        """(global batches of row ids, one bucket each; number of rows left out)."""
        size, world = self.batch_size * self.num_replicas, self.num_replicas
        out, dropped = [], 0
        for bucket in np.unique(self.buckets[rows]):
            members = rows[self.buckets[rows] == bucket]
            full = len(members) // size
            chunks = [members[i * size : (i + 1) * size] for i in range(full)]
            tail = members[full * size :]
            if len(tail) and self.drop_last:
                dropped += len(tail)
            elif len(tail) >= world:
                chunks.append(tail)
            elif len(tail) and chunks:
                chunks[-1] = np.concatenate([chunks[-1], tail])
            else:
                dropped += len(tail)  # fewer rows in this bucket than processes
            out.extend(chunks)
        return out, dropped

    def global_batches(self, epoch: int) -> list[list[tuple[int, bool]]]:
        """The epoch's global batches of `(row, flip)`, the same on every rank."""
        rng = np.random.default_rng([self.seed, epoch])
        out, _ = self._global_chunks(self._epoch_rows(rng))
        if self.shuffle:
            out = [out[i] for i in rng.permutation(len(out))]
        flips = rng.random(sum(len(b) for b in out)) < 0.5 if self.flip else None
        result, k = [], 0
        for chunk in out:
            result.append(
                [
                    (int(row), bool(flips[k + j]) if flips is not None else False)
                    for j, row in enumerate(chunk)
                ]
            )
            k += len(chunk)
        return result

    def batches(self, epoch: int) -> list[list[tuple[int, bool]]]:
        """This rank's batches of the epoch: its slice of every global batch."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        world, r = self.num_replicas, self.rank
        mine = []
        for batch in self.global_batches(epoch):
            base, extra = divmod(len(batch), world)
            start = r * base + min(r, extra)
            mine.append(batch[start : start + base + (1 if r < extra else 0)])
        self._cached = (epoch, mine)
        return mine

    def dropped_rows(self, epoch: int) -> int:
        """How many of the epoch's rows no batch holds (drop_last tails, buckets smaller than processes)."""
        rng = np.random.default_rng([self.seed, epoch])
        return self._global_chunks(self._epoch_rows(rng))[1]

    def __iter__(self):
        return iter(self.batches(self.epoch))

    def __len__(self) -> int:
        return len(self.batches(self.epoch))


class CachedLatents(torch.utils.data.Dataset):
    """The prepared rows as tensors; an item is `(row, flip)`."""

    def __init__(self, rows: Any):
        self.rows = rows.with_format("numpy")
        self.has_flip = "latent_mean_flipped" in rows.column_names
        self.sdxl = "pooled_prompt_embeds" in rows.column_names

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: tuple[int, bool]) -> dict[str, Any]:
        index, flip = item
        row = self.rows[int(index)]
        if flip and not self.has_flip:
            raise ValueError("a flipped sample was asked for but the cache holds no flipped latents")
        suffix = "_flipped" if flip else ""
        shape = tuple(int(x) for x in row["latent_shape"])
        out = {
            "index": int(row["index"]),
            "latent_mean": torch.from_numpy(row[f"latent_mean{suffix}"].reshape(shape)),
            "latent_std": torch.from_numpy(row[f"latent_std{suffix}"].reshape(shape)),
            "prompt_embeds": torch.from_numpy(
                row["prompt_embeds"].reshape(tuple(int(x) for x in row["prompt_shape"]))
            ),
            "is_prior": bool(row["is_prior"]),
        }
        if self.sdxl:
            out["pooled_prompt_embeds"] = torch.from_numpy(row["pooled_prompt_embeds"])
            # SDXL micro-conditioning: original size, crop top-left, target size (pipeline order).
            left = row["crop_left_flipped"] if flip else row["crop_left"]
            out["time_ids"] = torch.tensor(
                [
                    row["original_height"],
                    row["original_width"],
                    row["crop_top"],
                    left,
                    row["height"],
                    row["width"],
                ],
                dtype=torch.float32,
            )
        return out


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack same-bucket samples (same latent shapes by construction).

    Captions stored unpadded (Qwen-Image) may differ in length: they are zero-padded to the longest
    and `prompt_embeds_mask` marks the real positions, as train_dreambooth_lora_qwen_image.py pads them.
    """
    out = {
        key: torch.stack([s[key] for s in samples])
        for key in samples[0]
        if key not in ("index", "is_prior", "prompt_embeds")
    }
    texts = [s["prompt_embeds"] for s in samples]
    longest = max(t.shape[0] for t in texts)
    if any(t.shape[0] != longest for t in texts):
        out["prompt_embeds"] = torch.stack([F.pad(t, (0, 0, 0, longest - t.shape[0])) for t in texts])
        out["prompt_embeds_mask"] = torch.stack([(torch.arange(longest) < t.shape[0]).long() for t in texts])
    else:
        out["prompt_embeds"] = torch.stack(texts)
    out["index"] = torch.tensor([s["index"] for s in samples], dtype=torch.long)
    out["is_prior"] = torch.tensor([s["is_prior"] for s in samples], dtype=torch.bool)
    return out


def make_loader(
    rows: Any,
    *,
    batch_size: int,
    seed: int,
    drop_last: bool,
    num_workers: int = 0,
    shuffle: bool = True,
    num_replicas: int = 1,
    rank: int = 0,
):
    """DataLoader over the prepared rows with a BucketBatchSampler giving this rank its share.

    Not meant for `accelerator.prepare`: the sampler already shards, and the batches stay on the CPU
    until the training step moves them.
    """
    sampler = BucketBatchSampler(
        np.asarray(rows["bucket"]),
        batch_size,
        seed=seed,
        is_prior=np.asarray(rows["is_prior"]),
        flip="latent_mean_flipped" in rows.column_names,
        drop_last=drop_last,
        shuffle=shuffle,
        num_replicas=num_replicas,
        rank=rank,
    )
    return torch.utils.data.DataLoader(
        CachedLatents(rows),
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        # Its own generator: creating an iterator then draws nothing from the global RNG, so a resumed
        # run draws the same noise as an uninterrupted one (see finetune.data.batching.loader.make_dataloader).
        generator=torch.Generator().manual_seed(seed),
    )
