"""Which rows each process trains on: the same number of batches on every rank, every row once.

Accelerate's own sharding (`BatchSamplerShard` with `even_batches`) makes the ranks even by repeating
rows from the start of the epoch, so some rows are trained on twice; without `even_batches` the ranks
run different numbers of steps and the collectives hang at the end of the epoch. This sampler does
neither, so the training dataloader is not passed through `accelerator.prepare`.
"""

from __future__ import annotations

import torch


class RankBatchSampler(torch.utils.data.Sampler):
    """Micro-batches of row indices for one rank of a data-parallel run.

    The epoch's order (a permutation seeded by seed and epoch, or 0..N-1 without shuffle) is cut into
    global batches of `micro_batch_size x num_replicas` consecutive rows; rank r takes the r-th
    `micro_batch_size` rows of each. A run on R processes therefore trains on the same global batches
    as one process with micro batch R x b (the token-normalised loss makes those updates equal).

    The L rows left after the last full global batch (0 < L < R x b):
    - `drop_last`: not trained on this epoch (a different set each epoch; `dropped_per_epoch` says how
      many, and the trainer reports it);
    - L >= R: one more, smaller batch on every rank (sizes differ by at most one row);
    - L < R: one extra row on the last batch of ranks 0..L-1.
    Every rank gets the same number of batches and no row is repeated within an epoch.
    """

    def __init__(
        self,
        num_rows: int,
        *,
        micro_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        self.num_rows, self.micro_batch_size = num_rows, micro_batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        global_batch = micro_batch_size * num_replicas
        self.full_batches, self.leftover = divmod(num_rows, global_batch)
        if not drop_last and self.full_batches == 0 and 0 < self.leftover < num_replicas:
            raise ValueError(
                f"{num_rows} rows cannot be split over {num_replicas} processes (each needs at least one row)"
            )

    @property
    def dropped_per_epoch(self) -> int:
        return self.leftover if self.drop_last else 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def __iter__(self):
        order = self._order()
        b, world, r = self.micro_batch_size, self.num_replicas, self.rank
        global_batch = b * world
        batches = [
            order[start + r * b : start + (r + 1) * b]
            for start in range(0, self.full_batches * global_batch, global_batch)
        ]
        tail = order[self.full_batches * global_batch :]
        if tail and not self.drop_last:
            if len(tail) >= world:
                # Split as evenly as possible, keeping the tail's order across ranks.
                base, extra = divmod(len(tail), world)
                start = r * base + min(r, extra)
                batches.append(tail[start : start + base + (1 if r < extra else 0)])
            elif r < len(tail):
                batches[-1] = [*batches[-1], tail[r]]
        return iter(batches)

    def __len__(self) -> int:
        extra = 1 if (not self.drop_last and self.leftover >= self.num_replicas) else 0
        return self.full_batches + extra


class RepeatBatchSampler(torch.utils.data.Sampler):
    """Each batch of `sampler` `times` times in a row (online RL reuses a rollout for several steps:
    the loader gives its prompts once per step). `set_epoch` and `dropped_per_epoch` pass through.

    >>> list(RepeatBatchSampler(RankBatchSampler(4, micro_batch_size=2, shuffle=False), 2))
    [[0, 1], [0, 1], [2, 3], [2, 3]]
    """

    def __init__(self, sampler: RankBatchSampler, times: int):
        self.sampler, self.times = sampler, times

    @property
    def dropped_per_epoch(self) -> int:
        return self.sampler.dropped_per_epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        for batch in self.sampler:
            for _ in range(self.times):
                yield batch

    def __len__(self) -> int:
        return len(self.sampler) * self.times
