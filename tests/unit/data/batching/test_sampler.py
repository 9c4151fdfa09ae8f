"""RankBatchSampler: every rank runs the same number of steps, no row is seen twice in an epoch, and
R ranks of micro batch b train on the same global batches as one process of micro batch R x b."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from finetune.data.batching.loader import EpochSampler
from finetune.data.batching.sampler import RankBatchSampler


def _ranks(num_rows: int, b: int, world: int, *, drop_last: bool, epoch: int = 0, shuffle: bool = True):
    samplers = [
        RankBatchSampler(
            num_rows,
            micro_batch_size=b,
            num_replicas=world,
            rank=r,
            seed=7,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    "num_rows,b,world", list(itertools.product([2, 3, 5, 8, 13, 31, 64, 100], [1, 2, 3, 4], [1, 2, 3, 8]))
)
def test_equal_steps_and_each_row_once(num_rows: int, b: int, world: int, drop_last: bool):
    if not drop_last and num_rows < world:
        with pytest.raises(ValueError, match="each needs at least one row"):
            _ranks(num_rows, b, world, drop_last=drop_last)
        return
    samplers, per_rank = _ranks(num_rows, b, world, drop_last=drop_last)
    lengths = {len(batches) for batches in per_rank}
    assert lengths == {len(samplers[0])}  # the same number of batches on every rank, as len() says
    assert all(len(batch) > 0 for batches in per_rank for batch in batches)
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert max(seen.values(), default=1) == 1  # no row twice
    dropped = num_rows - len(seen)
    assert dropped == samplers[0].dropped_per_epoch
    if drop_last:
        assert dropped == num_rows % (b * world)
        assert all(len(batch) == b for batches in per_rank for batch in batches)
    else:
        assert dropped == 0
        # Batches never exceed the micro batch by more than one row.
        assert all(len(batch) <= b + 1 for batches in per_rank for batch in batches)


@pytest.mark.parametrize("world,b", [(2, 1), (2, 3), (4, 2)])
def test_global_batches_equal_one_process_with_a_larger_micro_batch(world: int, b: int):
    num_rows = 10 * world * b + world  # a tail of `world` rows: one more single-row batch per rank
    _, per_rank = _ranks(num_rows, b, world, drop_last=False, epoch=3)
    _, (single,) = _ranks(num_rows, b * world, 1, drop_last=False, epoch=3)
    merged = [[i for r in range(world) for i in per_rank[r][step]] for step in range(len(per_rank[0]))]
    assert merged == single


def test_one_process_keeps_the_epoch_order():
    """With one process, batches follow EpochSampler's order (the order exact resume was built on)."""
    for epoch in (0, 1, 5):
        sampler = EpochSampler(37, seed=7)
        sampler.set_epoch(epoch)
        order = list(sampler)
        _, (batches,) = _ranks(37, 4, 1, drop_last=False, epoch=epoch)
        assert [i for batch in batches for i in batch] == order


def test_epochs_differ_and_repeat():
    _, first = _ranks(50, 2, 2, drop_last=True, epoch=0)
    _, again = _ranks(50, 2, 2, drop_last=True, epoch=0)
    _, second = _ranks(50, 2, 2, drop_last=True, epoch=1)
    assert first == again and first != second


def test_no_shuffle_is_in_order():
    _, per_rank = _ranks(9, 2, 2, drop_last=False, shuffle=False)
    assert per_rank == [[[0, 1], [4, 5, 8]], [[2, 3], [6, 7]]]
