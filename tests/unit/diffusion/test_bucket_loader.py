"""BucketBatchSampler: one bucket per batch, reproducible per (seed, epoch), prior balancing, flips."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from finetune.diffusion.loader import BucketBatchSampler

BUCKETS = np.array([0, 1, 0, 2, 1, 0, 0, 1, 2, 0])


def test_batches_hold_one_bucket_and_every_row_once() -> None:
    sampler = BucketBatchSampler(BUCKETS, 2, seed=1, drop_last=False)
    batches = list(sampler)
    assert all(len({BUCKETS[row] for row, _ in b}) == 1 for b in batches)
    assert sorted(row for b in batches for row, _ in b) == list(range(len(BUCKETS)))
    assert len(sampler) == len(batches)


def test_drop_last_drops_each_buckets_short_batch() -> None:
    batches = list(BucketBatchSampler(BUCKETS, 2, seed=1, drop_last=True))
    # Buckets hold 5, 3 and 2 rows: 2 + 1 + 1 full batches.
    assert len(batches) == 4 and all(len(b) == 2 for b in batches)


def test_order_depends_only_on_seed_and_epoch() -> None:
    a, b = BucketBatchSampler(BUCKETS, 2, seed=7), BucketBatchSampler(BUCKETS, 2, seed=7)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b)
    assert list(BucketBatchSampler(BUCKETS, 2, seed=8)) != list(BucketBatchSampler(BUCKETS, 2, seed=7))


def test_prior_preservation_balances_instance_and_class_samples() -> None:
    is_prior = np.array([False] * 2 + [True] * 6)
    sampler = BucketBatchSampler(np.zeros(8, int), 2, seed=0, is_prior=is_prior, drop_last=False)
    rows = [row for b in sampler for row, _ in b]
    counts = Counter(bool(is_prior[r]) for r in rows)
    assert counts == {True: 6, False: 6}  # the 2 instance images cycled to the 6 class images
    assert Counter(r for r in rows if not is_prior[r]) == {0: 3, 1: 3}


def test_flips_are_drawn_per_epoch_and_reproducible() -> None:
    sampler = BucketBatchSampler(np.zeros(64, int), 4, seed=0, flip=True)
    flips = [f for b in sampler for _, f in b]
    assert 10 < sum(flips) < 54
    assert flips == [f for b in sampler for _, f in b]
    assert not any(f for b in BucketBatchSampler(np.zeros(64, int), 4, seed=0) for _, f in b)


# ------------------------------------------------------------------------------------ several ranks


def _rank_batches(sampler_kwargs: dict, world: int, epoch: int = 0) -> list[list[list[tuple[int, bool]]]]:
    out = []
    for rank in range(world):
        sampler = BucketBatchSampler(**sampler_kwargs, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_the_same_number_of_batches_and_no_row_twice(world, batch_size, drop_last) -> None:
    buckets = np.array([0] * 11 + [1] * 7 + [2] * 5 + [3] * 1)  # bucket 3 is smaller than any world
    kwargs = {"buckets": buckets, "batch_size": batch_size, "seed": 3, "flip": True, "drop_last": drop_last}
    for epoch in (0, 1):
        per_rank = _rank_batches(kwargs, world, epoch)
        assert len({len(batches) for batches in per_rank}) == 1 and len(per_rank[0]) > 0
        rows = [row for batches in per_rank for b in batches for row, _ in b]
        assert len(rows) == len(set(rows))  # nothing repeated across or within ranks
        assert all(b and len({buckets[row] for row, _ in b}) == 1 for batches in per_rank for b in batches)
        sampler = BucketBatchSampler(**kwargs, num_replicas=world, rank=0)
        assert len(rows) + sampler.dropped_rows(epoch) == len(buckets)
        # The ranks' batches at one position are, in rank order, one global batch (flips included).
        for position, global_batch in enumerate(sampler.global_batches(epoch)):
            assert [s for batches in per_rank for s in batches[position]] == global_batch
            sizes = [len(batches[position]) for batches in per_rank]
            assert max(sizes) - min(sizes) <= 1
        if not drop_last:
            assert sampler.dropped_rows(epoch) == 1  # only bucket 3's single row (fewer rows than ranks)
            assert 23 not in rows


def test_one_rank_is_the_plain_bucket_sampler() -> None:
    """num_replicas=1 keeps the single-process batches (what existing caches and resumes rely on)."""
    sampler = BucketBatchSampler(BUCKETS, 2, seed=1, drop_last=False, flip=True)
    assert list(sampler) == sampler.global_batches(0)
    assert all(len(b) <= 2 for b in sampler) and sampler.dropped_rows(0) == 0


def test_two_ranks_train_on_one_process_batches_of_twice_the_size() -> None:
    ranks = _rank_batches({"buckets": BUCKETS, "batch_size": 2, "seed": 5, "drop_last": True}, 2)
    single = list(BucketBatchSampler(BUCKETS, 4, seed=5, drop_last=True))
    assert [a + b for a, b in zip(*ranks, strict=True)] == single


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank 2 outside 0\.\.1"):
        BucketBatchSampler(BUCKETS, 2, seed=0, num_replicas=2, rank=2)
