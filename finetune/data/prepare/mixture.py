"""Weighted dataset mixtures: how many rows each training dataset contributes, and which.

An entry's `weight` w = k + f (k its integer part, f its fractional part) draws every kept training
row of the dataset k times, plus round(f * n) distinct rows once more, n being the dataset's kept
training rows (after the length policy and bad rows dropped them, and after the validation rows
were held out). The rounding is exact and rounds half up: f is the weight as written in decimal
(0.1 is one tenth, not the nearest binary float), so weight 0.25 on 10 rows draws 3 rows (2.5 -> 3)
and 1.15 on 10 rows draws 12.

The extra rows are the first round(f * n) of a permutation of the dataset's rows seeded by
`train.seed` and the entry's index in `data.datasets` (each entry its own numpy stream): the draw is
the same on every machine and for any `dataset_num_proc`, changing one entry's weight never changes
which rows another entry draws, and raising a weight keeps the rows a lower one drew.

Everything here works on index arrays (numpy); prepare applies them with `Dataset.select`, so no
row is copied until the prepared dataset is saved.

>>> draw_count(0.25, 10), draw_count(3.0, 10), draw_count(1.15, 10), draw_count(0.5, 3)
(3, 30, 12, 2)
>>> rows, passes = draw(4, 1.5, seed=42, index=0)
>>> rows.tolist()[:4], passes.tolist()  # every row, then 2 of the 4 once more
([0, 1, 2, 3], [0, 0, 0, 0, 1, 1])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

# numpy SeedSequence words that keep the mixture's random streams apart from each other (and from
# datasets' shuffle(seed), which seeds with the recipe seed alone).
_DRAW_STREAM = 0x6D697864  # "mixd": an entry's fractional draw, with its index
_ORDER_STREAM = 0x6D69786F  # "mixo": the order of the drawn rows
# Above this relative gap between the weight asked and the weight drawn (rows drawn / rows), prepare
# warns: the dataset is too small for the weight's fraction.
EFFECTIVE_WEIGHT_WARN = 0.1


def _words(seed: int, *words: int) -> list[int]:
    """SeedSequence entropy for a recipe seed (any int: a negative one is taken modulo 2**64)."""
    return [seed % 2**64, *words]


def draw_count(weight: float, num_rows: int) -> int:
    """Rows a dataset of `num_rows` rows draws at `weight`: k * n + floor(f * n + 1/2), computed on
    the weight as written in decimal (see the module docstring).

    >>> draw_count(0.5, 5), draw_count(2.0, 7), draw_count(0.001, 100)
    (3, 14, 0)
    """
    exact = Fraction(repr(float(weight)))
    whole = math.floor(exact)
    return whole * num_rows + math.floor((exact - whole) * num_rows + Fraction(1, 2))


def smallest_weight(num_rows: int) -> float:
    """The smallest weight of 3 significant digits that draws a row from `num_rows` rows (half a
    row rounds up), for the error about a weight that draws none.

    >>> smallest_weight(7), draw_count(smallest_weight(7), 7), smallest_weight(100)
    (0.0715, 1, 0.005)
    """
    exact = 1 / (2 * num_rows)
    scale = 10 ** (2 - math.floor(math.log10(exact)))
    return math.ceil(exact * scale) / scale


def draw(num_rows: int, weight: float, *, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, passes): the rows (0..num_rows-1) that `weight` draws from a dataset and the pass each
    copy belongs to (0..k-1 for the whole passes, k for the fractional draw, rows ascending within a
    pass). `index` is the entry's position in data.datasets, which with `seed` seeds the draw.

    >>> rows, passes = draw(10, 0.3, seed=0, index=1)
    >>> len(rows), set(passes.tolist()), len(set(rows.tolist()))
    (3, {0}, 3)
    """
    whole = math.floor(Fraction(repr(float(weight))))
    extra = draw_count(weight, num_rows) - whole * num_rows
    permutation = np.random.default_rng(_words(seed, _DRAW_STREAM, index)).permutation(num_rows)
    every = np.arange(num_rows, dtype=np.int64)
    rows = np.concatenate([np.tile(every, whole), np.sort(permutation[:extra])]).astype(np.int64)
    passes = np.concatenate([np.repeat(np.arange(whole, dtype=np.int64), num_rows), np.full(extra, whole)])
    return rows, passes.astype(np.int64)


def mix(
    keys: np.ndarray, sources: np.ndarray, weights: Sequence[float], *, seed: int, shuffle: bool
) -> np.ndarray:
    """Positions into a training split (with repeats) that make its weighted mixture.

    `sources[j]` is the entry index of the split's row j and `keys[j]` its identity within that entry
    (its row number among the entry's kept rows): an entry's rows are drawn in key order, so the
    draw does not depend on where the split put them.

    When every weight is 1 the mixture is the split itself, in its order (a recipe without weights
    prepares what it prepared before weights existed). Otherwise, with `shuffle` the drawn rows are
    put in a seeded random order; without it they keep the split's order pass after pass (every
    row's first copy, then the second copies, ...), so copies of a row are never next to each other.

    >>> mix(np.array([0, 1, 0]), np.array([0, 0, 1]), [1.0, 2.0], seed=0, shuffle=False).tolist()
    [0, 1, 2, 2]
    >>> mix(np.array([0, 1, 0]), np.array([0, 0, 1]), [1.0, 1.0], seed=0, shuffle=True).tolist()
    [0, 1, 2]
    """
    if all(weight == 1 for weight in weights):
        return np.arange(len(sources), dtype=np.int64)
    positions, passes = [], []
    for index, weight in enumerate(weights):
        mine = np.flatnonzero(sources == index)
        mine = mine[np.argsort(keys[mine], kind="stable")]
        rows, row_passes = draw(len(mine), weight, seed=seed, index=index)
        positions.append(mine[rows])
        passes.append(row_passes)
    positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    passes = np.concatenate(passes) if passes else np.zeros(0, dtype=np.int64)
    if shuffle:
        return positions[np.random.default_rng(_words(seed, _ORDER_STREAM)).permutation(len(positions))]
    return positions[np.lexsort((positions, passes))]


def per_example_tokens(input_lengths: np.ndarray, label_mask: np.ndarray) -> np.ndarray:
    """Trained tokens per example from the examples' lengths and the flat mask of their labels (True
    where a label is trained).

    >>> per_example_tokens(np.array([2, 3]), np.array([False, True, False, True, True])).tolist()
    [1, 2]
    """
    ends = np.cumsum(input_lengths)
    totals = np.concatenate([[0], np.cumsum(label_mask, dtype=np.int64)])
    return totals[ends] - totals[ends - input_lengths]


def shares(counts: np.ndarray) -> list[float | None]:
    """Each count's share of their sum (rounded to 6 places); None for all when the sum is 0.

    >>> shares(np.array([1, 3])), shares(np.array([0, 0]))
    ([0.25, 0.75], [None, None])
    """
    total = int(counts.sum())
    return [round(int(c) / total, 6) if total else None for c in counts]
