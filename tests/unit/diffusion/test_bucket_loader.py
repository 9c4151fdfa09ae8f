"""BucketBatchSampler: one bucket per batch, reproducible per (seed, epoch), prior balancing, flips."""

from __future__ import annotations

from collections import Counter

import numpy as np

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
