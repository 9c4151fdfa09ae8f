"""Pack tokenized examples into rows of a fixed token capacity.

Two kinds of functions:

* Bin assignment, pure functions of the example lengths: `pack_sequential` (order-preserving
  next-fit) and `pack_multipack` (bin packing: best-fit or first-fit decreasing, then a repair pass
  that fills the gaps). They return bins of example indices; no example is ever split, and every
  index is in exactly one bin.
* Row building: `build_packed_rows` turns a tokenized dataset and bins into rows with
  `input_ids`, `labels`, `position_ids` (restarting at 0 for every sequence) and `seq_lens`,
  vectorized over flat numpy arrays (no Python loop per token or per example).

>>> pack_sequential([3, 3, 2, 4], capacity=6)
[[0, 1], [2, 3]]
>>> pack_multipack([5, 3, 3, 1], capacity=6)
[[0, 3], [1, 2]]
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from itertools import chain

import datasets
import numpy as np
import pyarrow as pa

from finetune.constants import IGNORE_INDEX

STRATEGIES = ("bfd", "ffd")


def _as_lengths(lengths: Sequence[int] | np.ndarray, capacity: int) -> np.ndarray:
    """Lengths as an int64 array, checked against the capacity."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if arr.size and arr.min() < 1:
        i = int(np.argmin(arr))
        raise ValueError(f"example {i} has length {int(arr[i])}; every example needs at least one token")
    if arr.size and arr.max() > capacity:
        i = int(np.argmax(arr))
        raise ValueError(
            f"example {i} has {int(arr[i])} tokens, more than the row capacity of {capacity}; "
            "examples are never split, so the capacity must be at least the longest example"
        )
    return arr


def lower_bound_bins(lengths: Sequence[int] | np.ndarray, capacity: int) -> int:
    """The fewest rows any packing can use: ceil(total tokens / capacity).

    >>> lower_bound_bins([5, 3, 3, 1], 6)
    2
    """
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return -(-total // capacity)


def packing_efficiency(lengths: Sequence[int] | np.ndarray, num_rows: int, capacity: int) -> float:
    """Real tokens / (rows * capacity): 1.0 means no row has room left.

    >>> packing_efficiency([5, 3, 3, 1], num_rows=2, capacity=6)
    1.0
    """
    if num_rows == 0:
        return 0.0
    return int(np.asarray(lengths, dtype=np.int64).sum()) / (num_rows * capacity)


# ------------------------------------------------------------------------------------- sequential


def pack_sequential(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Next-fit in input order: a row takes examples until the next one does not fit.

    Keeps the data order exactly (rows are contiguous runs of examples), at the cost of the room
    left at the end of each row.

    >>> pack_sequential([4, 2, 3, 3, 6], capacity=6)
    [[0, 1], [2, 3], [4]]
    """
    arr = _as_lengths(lengths, capacity)
    # One searchsorted per row instead of a Python step per example: row k ends at the last
    # example whose running total stays within capacity of the row's start.
    ends = np.cumsum(arr)
    bins, start, base = [], 0, 0
    n = len(arr)
    while start < n:
        stop = int(np.searchsorted(ends, base + capacity, side="right"))
        bins.append(list(range(start, stop)))
        base = int(ends[stop - 1])
        start = stop
    return bins


# -------------------------------------------------------------------------------------- multipack


def pack_multipack(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    group_size: int = 100_000,
    strategy: str = "bfd",
) -> list[list[int]]:
    """Bin-pack examples into as few rows as possible, `group_size` consecutive examples at a time.

    Each group is packed with best-fit decreasing (`"bfd"`) or first-fit decreasing (`"ffd"`),
    then, when that uses more rows than the lower bound ceil(tokens / capacity) but at most 10% more,
    a repair pass (`_fill_gaps`) empties the emptiest rows into the gaps of the others. BFD alone leaves many
    rows with a gap just below the shortest example (on GSM8K at 2048 tokens: 722 rows, 0.993
    efficient); the repair reaches the bound (717 rows, 0.9997) in about 10 ms more.

    Rows come out ordered by their smallest example index, and each row lists its examples in
    index order, so a shuffled input stays shuffled (bin packing itself sorts by length).

    >>> pack_multipack([2, 5, 1, 4, 3, 1], capacity=6)
    [[0, 3], [1, 2], [4, 5]]
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    arr = _as_lengths(lengths, capacity)
    place = _best_fit_decreasing if strategy == "bfd" else _first_fit_decreasing
    bins: list[list[int]] = []
    for start in range(0, len(arr), group_size):
        group = arr[start : start + group_size]
        group_bins = _fill_gaps(group, place(group, capacity), capacity)
        bins.extend([start + i for i in b] for b in group_bins)
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return bins


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Longest first, each into the open bin whose room is the smallest that still fits it.

    Open bins are bucketed by their remaining room: `by_room[r]` is a stack of bins with exactly r
    tokens free, and `rooms` is the sorted list of the r values that have a bin. Finding the best
    fit is one bisect (O(log capacity)); moving a bin between buckets is a stack push/pop plus,
    when a bucket empties or fills, an insert/delete in `rooms`, a memmove of at most `capacity`
    ints. That is a few hundred nanoseconds per example in CPython, against a Python-level tree walk
    per example for a segment tree (TRL's `_SegmentTree`). Full bins (room 0) are not tracked.
    """
    order = np.argsort(-lengths, kind="stable").tolist()
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    rooms: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        length = int(lengths[i])
        k = bisect.bisect_left(rooms, length)
        if k == len(rooms):  # no open bin fits: open a new one
            b, room = len(bins), capacity - length
            bins.append([i])
        else:
            old = rooms[k]
            stack = by_room[old]
            b = stack.pop()
            if not stack:
                del rooms[k]
            bins[b].append(i)
            room = old - length
        if room:
            stack = by_room[room]
            if not stack:
                bisect.insort(rooms, room)
            stack.append(b)
    return bins


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Longest first, each into the lowest-numbered bin with room for it.

    A max-segment-tree over bin slots holds each bin's room; the first fit is found by walking
    down from the root, always left when the left subtree has enough room (O(log bins)). The slot
    count is bounded up front: any-fit packing never leaves two bins at most half full, so it
    uses at most 2 * total / capacity + 1 bins.
    """
    order = np.argsort(-lengths, kind="stable").tolist()
    max_bins = min(len(lengths), 2 * lower_bound_bins(lengths, capacity) + 1)
    size = 1
    while size < max(max_bins, 1):
        size *= 2
    tree = [capacity] * (2 * size)  # leaves size.. are bin slots; unopened slots have full room
    bins: list[list[int]] = []
    for i in order:
        length = int(lengths[i])
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= length else 2 * node + 1
        slot = node - size
        if slot == len(bins):
            bins.append([])
        bins[slot].append(i)
        tree[node] -= length
        node //= 2
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left >= right else right
            node //= 2
    return bins


# The repair pass runs when greedy packing is within 1/_REPAIR_GATE of the lower bound (10%). Measured on
# 100k rows (benchmarks/RESULTS.md, "Multipack repair gate"): lengths N(120,15) at 512 tokens are 4.9%
# above the bound after greedy, N(130,10) 8%, N(450,40) at 2048 7.4%; the repair takes them from 0.954,
# 0.926, 0.931 to 0.978, 0.975, 0.946 efficiency for 2-7 s. Further out (N(200,10) at 512: 28%, where
# no better packing exists: 2 examples per row), it spends its whole budget (~7 s) for nothing.
_REPAIR_GATE = 10


def _fill_gaps(lengths: np.ndarray, bins: list[list[int]], capacity: int) -> list[list[int]]:
    """Try to reach ceil(total / capacity) bins by moving the emptiest bins into the others' gaps.

    Greedy packing leaves, in many bins, a gap shorter than every remaining example. To use those
    gaps, the examples of the k - bound emptiest bins go to a pool, then:

    1. absorb: for each bin with a gap, choose the subset of (its examples + the pool's longest
       examples of distinct lengths) that fills it best (`_best_subset`, exact subset sum); what is
       not chosen goes back to the pool. A bin can thus trade one long example for two shorter
       ones that fill it exactly.
    2. gather: when no bin can take more, move room into the emptiest bin by refilling the other
       part-full bins from it, so that a pool example fits there; then absorb again.

    Every move keeps each bin within capacity and strictly lowers the pool's token count, so it
    ends; a budget of subset-sum evaluations bounds the work. If the pool cannot be emptied, the
    rest is packed into new bins and the result is kept only when it uses fewer bins than the input.
    It is only tried when greedy is within 10% of the bound (far from it, gaps are not the problem).
    """
    lens = lengths.tolist()
    target = lower_bound_bins(lengths, capacity)
    if len(bins) <= target or len(bins) - target > max(8, len(bins) // _REPAIR_GATE):
        return bins
    fill = [sum(lens[i] for i in b) for b in bins]
    emptiest = set(sorted(range(len(bins)), key=fill.__getitem__)[: len(bins) - target])
    pool = _Pool(lens, [i for b in sorted(emptiest) for i in bins[b]])
    keep = [list(b) for k, b in enumerate(bins) if k not in emptiest]
    kfill = [f for k, f in enumerate(fill) if k not in emptiest]
    budget = 8 * len(bins) + 1000  # subset-sum evaluations, ~5-20 us each

    def refill(b: int, extra: list[int]) -> list[int] | None:
        """Best-fill bin b from its examples + extra; return the examples left out (None: no gain)."""
        nonlocal budget
        budget -= 1
        items = keep[b] + extra
        best, used = _best_subset([lens[i] for i in items], capacity)
        if best == kfill[b]:
            return None
        keep[b], kfill[b] = [i for i, u in zip(items, used, strict=True) if u], best
        return [i for i, u in zip(items, used, strict=True) if not u]

    def open_bins() -> list[int]:
        return sorted((b for b in range(len(keep)) if kfill[b] < capacity), key=kfill.__getitem__)

    while pool and budget > 0:
        progress = False
        for b in open_bins():  # absorb
            if not pool or budget <= 0:
                break
            sample = pool.take_longest(48)
            out = refill(b, sample)
            pool.add(sample if out is None else out)
            progress |= out is not None
        if progress or not pool:
            continue
        gather, *others = open_bins() or [None]
        for b in others:
            if capacity - kfill[gather] >= pool.shortest() or budget <= 0:
                break
            out = refill(b, keep[gather])
            if out is not None:
                progress = True
                keep[gather], kfill[gather] = out, sum(lens[i] for i in out)
        if not progress:
            break
    if pool:
        rest = pool.items()
        keep += [[rest[j] for j in b] for b in _best_fit_decreasing(lengths[rest], capacity)]
    keep = [b for b in keep if b]
    return keep if len(keep) < len(bins) else bins


class _Pool:
    """Examples waiting for a bin, bucketed by length so the longest distinct lengths are cheap."""

    def __init__(self, lens: list[int], items: list[int]):
        self.lens = lens
        self.by_length: dict[int, list[int]] = {}
        self.lengths: list[int] = []  # sorted distinct lengths present
        self.add(items)

    def __bool__(self) -> bool:
        return bool(self.lengths)

    def add(self, items: list[int]) -> None:
        for i in items:
            length = self.lens[i]
            bucket = self.by_length.setdefault(length, [])
            if not bucket:
                bisect.insort(self.lengths, length)
            bucket.append(i)

    def take_longest(self, limit: int) -> list[int]:
        """Remove and return one example of each of the `limit` longest distinct lengths."""
        out = [self.by_length[length].pop() for length in self.lengths[-limit:][::-1]]
        self.lengths = [length for length in self.lengths if self.by_length[length]]
        return out

    def shortest(self) -> int:
        return self.lengths[0]

    def items(self) -> list[int]:
        return [i for length in self.lengths for i in self.by_length[length]]


def _best_subset(values: list[int], capacity: int) -> tuple[int, list[bool]]:
    """The subset of `values` with the largest sum <= capacity, as (sum, chosen flags).

    Subset sum with the reachable sums as the bits of one Python int: adding a value is one shift
    and one OR over capacity+1 bits, so 30 values cost microseconds. Earlier values are preferred
    when several subsets reach the best sum (the walk back leaves out the latest value it can).

    >>> _best_subset([4, 3, 3], 6)
    (6, [False, True, True])
    """
    mask = (1 << (capacity + 1)) - 1
    reach = [1]
    bits = 1
    for v in values:
        bits = (bits | (bits << v)) & mask
        reach.append(bits)
    best = bits.bit_length() - 1
    used = [False] * len(values)
    s = best
    for j in range(len(values) - 1, -1, -1):
        if not (reach[j] >> s) & 1:  # s not reachable without value j: it is in the subset
            used[j] = True
            s -= values[j]
    return best, used


# ------------------------------------------------------------------------------------------- rows


def build_packed_rows(
    dataset: datasets.Dataset,
    bins: list[list[int]] | None,
    *,
    pad_to_multiple_of: int | None,
    pad_token_id: int,
    examples_per_chunk: int = 200_000,
) -> datasets.Dataset:
    """Rows of `input_ids`, `labels`, `position_ids` and `seq_lens` from a tokenized dataset.

    `dataset` has `input_ids` and `labels` (aligned, same length per example). Each bin becomes one
    row: its examples concatenated in bin order, `position_ids` restarting at 0 at every example,
    `seq_lens` the example lengths. With `pad_to_multiple_of` > 1 the row is right-padded to a
    multiple of it with `pad_token_id` (labels -100); the padding is one more entry of `seq_lens`
    and its `position_ids` restart at 0, so attention never mixes it with a real sequence.

    `bins=None` keeps one example per row in dataset order (no packing); pass
    `pad_to_multiple_of=None` then, the collator pads per batch.

    Rows are built `examples_per_chunk` examples at a time, which bounds the temporary arrays.
    """
    n = len(dataset)
    if bins is None:
        order = np.arange(n, dtype=np.int64)
        bin_sizes = np.ones(n, dtype=np.int64)
    else:
        order = np.fromiter(chain.from_iterable(bins), dtype=np.int64)
        bin_sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        if (bin_sizes == 0).any():
            raise ValueError("empty bin: every row needs at least one example")
        if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
            raise ValueError("bins must hold every example index exactly once")
    table = dataset.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    ids_col = table.column("input_ids").combine_chunks()
    labels_col = table.column("labels").combine_chunks()
    lengths = _list_lengths(ids_col)
    if not np.array_equal(lengths, _list_lengths(labels_col)):
        raise ValueError("input_ids and labels must have the same length in every example")
    flat = (_flat_values(ids_col), _flat_values(labels_col))  # zero-copy for a memory-mapped column
    starts = _exclusive_cumsum(lengths)
    multiple = pad_to_multiple_of or 1
    row_ends = np.cumsum(bin_sizes)  # examples up to the end of each row
    tables, first_row = [], 0
    while first_row < len(bin_sizes) or not tables:
        start = int(row_ends[first_row - 1]) if first_row else 0
        last_row = int(np.searchsorted(row_ends, start + examples_per_chunk, side="right"))
        last_row = min(max(last_row, first_row + 1), len(bin_sizes))
        stop = int(row_ends[last_row - 1]) if last_row else 0
        chunk = order[start:stop]
        tables.append(
            _rows_table(
                flat, starts[chunk], lengths[chunk], bin_sizes[first_row:last_row], multiple, pad_token_id
            )
        )
        first_row = last_row
    out = pa.concat_tables(tables)
    # An explicit fingerprint: otherwise datasets hashes the whole table (~100 ms per million tokens).
    digest = hashlib.sha256(f"{dataset._fingerprint}:{multiple}:{pad_token_id}".encode())
    digest.update(order.tobytes())
    digest.update(bin_sizes.tobytes())
    return datasets.Dataset(out, fingerprint=digest.hexdigest()[:16])


def _rows_table(
    flat: tuple[np.ndarray, np.ndarray],
    item_starts: np.ndarray,
    item_lens: np.ndarray,
    bin_sizes: np.ndarray,
    multiple: int,
    pad_token_id: int,
) -> pa.Table:
    """Packed rows of the examples at `item_starts` (in packed order) in the flat token arrays;
    row k takes the next bin_sizes[k] of them."""
    num_rows = len(bin_sizes)
    item_row = np.repeat(np.arange(num_rows), bin_sizes)
    row_real = np.bincount(item_row, weights=item_lens, minlength=num_rows).astype(np.int64)
    row_len = -(-row_real // multiple) * multiple
    pad = row_len - row_real
    num_real, num_out = int(row_real.sum()), int(row_len.sum())
    # Index arithmetic in int32 when it fits: these arrays are token-sized and the work is
    # memory-bound, so half the bytes is most of the time saved.
    idx = np.int32 if max(num_out, len(flat[0])) < 2**31 else np.int64
    token = np.arange(num_real, dtype=idx)
    # Real token t of the chunk comes from flat position src[t] (a gather: the examples are
    # scattered in the input) and, with padding, goes to output position dst[t].
    src = np.repeat((item_starts - _exclusive_cumsum(item_lens)).astype(idx), item_lens) + token
    if num_out == num_real:
        out_ids = flat[0][src].astype(np.int32, copy=False)
        out_labels = flat[1][src].astype(np.int32, copy=False)
    else:
        row_shift = _exclusive_cumsum(row_len) - _exclusive_cumsum(row_real)  # padding before the row
        dst = np.repeat(row_shift.astype(idx), row_real) + token
        out_ids = np.full(num_out, pad_token_id, dtype=np.int32)
        out_ids[dst] = flat[0][src]
        out_labels = np.full(num_out, IGNORE_INDEX, dtype=np.int32)
        out_labels[dst] = flat[1][src]

    # Segments: each row's examples, then its padding (when any). Positions restart per segment.
    has_pad = pad > 0
    seg_count = bin_sizes + has_pad
    seg_lens = np.empty(int(seg_count.sum()), dtype=np.int64)
    pad_slot = np.zeros(len(seg_lens), dtype=bool)
    pad_slot[(np.cumsum(seg_count) - 1)[has_pad]] = True
    seg_lens[~pad_slot] = item_lens
    seg_lens[pad_slot] = pad[has_pad]
    position_ids = np.arange(num_out, dtype=idx) - np.repeat(
        _exclusive_cumsum(seg_lens).astype(idx), seg_lens
    )

    row_offsets = np.concatenate([[0], np.cumsum(row_len)])
    seg_offsets = np.concatenate([[0], np.cumsum(seg_count)])
    return pa.table(
        {
            "input_ids": _list_array(row_offsets, out_ids),
            "labels": _list_array(row_offsets, out_labels),
            "position_ids": _list_array(row_offsets, position_ids.astype(np.int32, copy=False)),
            "seq_lens": _list_array(seg_offsets, seg_lens.astype(np.int32)),
        }
    )


def _list_lengths(column: pa.Array) -> np.ndarray:
    """Length of every list in a list column, as int64."""
    import pyarrow.compute as pc

    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _flat_values(column: pa.Array) -> np.ndarray:
    # flatten() honours the array's own offset (a slice), unlike .values.
    return column.flatten().to_numpy(zero_copy_only=False)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values), dtype=np.int64)
    if len(values) > 1:
        np.cumsum(values[:-1], out=out[1:])
    return out


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    # 32-bit offsets unless the column holds more than 2**31 - 1 values.
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), pa.array(values))


# ---------------------------------------------------------------------------------------- streaming


class BufferedPacker:
    """Packing over a stream (data.streaming) with a bounded buffer of pending examples.

    Examples (``(input_ids, labels)``) are added one at a time; once `buffer_size` are pending, the
    buffer is packed (`pack_multipack`: best-fit within the buffer, or `pack_sequential`: next-fit
    in stream order) and every row is released but one: the emptiest row (sequential: the open last
    row), whose examples stay pending to be packed with the next ones. No example is split; at most
    `buffer_size` examples are held. `pending` and the counters are the packer's whole state (what a
    checkpoint keeps, finetune.data.batching.streaming), and the output is a pure function of the input.

    >>> p = BufferedPacker(6, buffer_size=4)
    >>> [p.add(([1] * n, [1] * n)) for n in (5, 3, 2)]
    [[], [], []]
    >>> [[len(ids) for ids, _ in row] for row in p.add(([1], [1]))]
    [[3, 2, 1]]
    >>> [len(ids) for ids, _ in p.pending]
    [5]
    """

    def __init__(self, capacity: int, *, buffer_size: int, method: str = "multipack", packed: bool = True):
        if method not in ("multipack", "sequential"):
            raise ValueError(f"method must be multipack or sequential, not {method!r}")
        self.capacity, self.buffer_size, self.method, self.packed = capacity, buffer_size, method, packed
        self.pending: list[tuple[list[int], list[int]]] = []
        self.num_rows = 0  # rows released
        self.num_tokens = 0  # example tokens in the rows released

    def add(self, example: tuple[list[int], list[int]]) -> list[list[tuple[list[int], list[int]]]]:
        """Add one example; the rows (lists of examples) this releases, often none."""
        self.pending.append(example)
        if not self.packed:
            return self._release([[0]], hold=None)
        if len(self.pending) < self.buffer_size:
            return []
        return self._pack(final=False)

    def flush(self) -> list[list[tuple[list[int], list[int]]]]:
        """Every pending example in rows (the end of a finite stream)."""
        return self._pack(final=True) if self.pending else []

    def efficiency(self) -> float:
        """Example tokens / (rows released x capacity), as `packing_efficiency`."""
        return self.num_tokens / (self.num_rows * self.capacity) if self.num_rows else 0.0

    def _pack(self, *, final: bool) -> list[list[tuple[list[int], list[int]]]]:
        lengths = [len(ids) for ids, _ in self.pending]
        if self.method == "multipack":
            bins = pack_multipack(lengths, self.capacity)
            fills = [sum(lengths[i] for i in b) for b in bins]
            hold = None if final else min(range(len(bins)), key=fills.__getitem__)
            if hold is not None and fills[hold] == self.capacity:  # every row is full: keep none back
                hold = None
        else:
            bins = pack_sequential(lengths, self.capacity)
            hold = None if final else len(bins) - 1
        return self._release(bins, hold=hold)

    def _release(self, bins: list[list[int]], *, hold: int | None) -> list[list[tuple[list[int], list[int]]]]:
        rows = [[self.pending[i] for i in b] for k, b in enumerate(bins) if k != hold]
        self.pending = [self.pending[i] for i in bins[hold]] if hold is not None else []
        self.num_rows += len(rows)
        self.num_tokens += sum(len(ids) for row in rows for ids, _ in row)
        return rows

    def state_dict(self) -> dict:
        """The pending examples (as `examples_state`) and the counters."""
        return {
            "pending": examples_state(self.pending),
            "num_rows": self.num_rows,
            "num_tokens": self.num_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        self.pending = examples_from_state(state["pending"])
        self.num_rows, self.num_tokens = int(state["num_rows"]), int(state["num_tokens"])


def examples_state(examples: list[tuple[list[int], list[int]]]) -> dict:
    """Examples as three tensors (lengths, flat input_ids, flat labels): a checkpoint stores them in
    safetensors, not as JSON lists (finetune.engine.extra_state)."""
    import torch

    return {
        "lengths": torch.tensor([len(ids) for ids, _ in examples], dtype=torch.int64),
        "input_ids": torch.tensor([t for ids, _ in examples for t in ids], dtype=torch.int32),
        "labels": torch.tensor([t for _, labels in examples for t in labels], dtype=torch.int32),
    }


def examples_from_state(state: dict) -> list[tuple[list[int], list[int]]]:
    """The examples `examples_state` stored (none: an empty buffer, as a checkpoint taken when the packer
    had no example waiting holds it).

    >>> examples_from_state(examples_state([([1, 2], [-100, 2]), ([3], [3])]))
    [([1, 2], [-100, 2]), ([3], [3])]
    >>> examples_from_state(examples_state([]))
    []
    """
    ends = np.cumsum(np.asarray(state["lengths"], dtype=np.int64)).tolist()
    if not ends:
        return []
    ids, labels = np.asarray(state["input_ids"]).tolist(), np.asarray(state["labels"]).tolist()
    return [(ids[a:b], labels[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def packed_row(
    examples: list[tuple[list[int], list[int]]], *, pad_to_multiple_of: int | None, pad_token_id: int
) -> dict:
    """One row of `input_ids`, `labels`, `position_ids` (restarting at 0 for every example) and
    `seq_lens` from examples, as `build_packed_rows` makes them (the padding to a multiple of
    `pad_to_multiple_of` is a segment of its own).

    >>> packed_row([([5, 6], [-100, 6]), ([7], [-100])], pad_to_multiple_of=4, pad_token_id=0)["position_ids"]
    [0, 1, 0, 0]
    """
    ids = [t for e in examples for t in e[0]]
    labels = [t for e in examples for t in e[1]]
    seq_lens = [len(e[0]) for e in examples]
    pad = (-len(ids)) % pad_to_multiple_of if pad_to_multiple_of else 0
    if pad:
        ids += [pad_token_id] * pad
        labels += [IGNORE_INDEX] * pad
        seq_lens.append(pad)
    positions = [p for n in seq_lens for p in range(n)]
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "seq_lens": seq_lens}
