"""Streaming SFT data (data.streaming): rows read, tokenized and packed while the model trains.

For corpora too large to prepare. Each training entry is read with datasets' IterableDataset
(`sources.load_stream`), tokenized on the fly by the prepared path's own batch function
(`tokenize.tokenize_stream`: a streamed example is token-identical to a prepared one), mixed with
`interleave_datasets` (probabilities proportional to the entries' `weight`, each row once per pass),
split between processes with `split_dataset_by_node`, then packed by a bounded best-fit buffer
(`packing.BufferedPacker`) into micro-batches. When the stream ends it starts over (the next pass):
train.max_steps sets the run's length.

Exact resume: every micro-batch leaves with a snapshot of where the stream was right after it (the
IterableDataset's state_dict, the packer's pending examples, the rows packed but not yet batched, the
row counts). `StreamLoader.state_dict` returns the snapshot of the last micro-batch the loop took,
so a checkpoint holds exactly the position the next step starts from; in a multi-process run it
holds every process's. Bad rows follow data.on_bad_row and are counted (the stream has no manifest:
the counts go to progress.jsonl).

The stream is read in one background thread (data.dataloader_num_workers > 0) rather than in
DataLoader worker processes: the snapshot of each micro-batch is then taken where the batch is made,
with no per-worker state to reassemble (what torchdata's StatefulDataLoader would do), and the Rust
tokenizer releases the GIL while it works, so reading overlaps the training step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import datasets
from datasets.distributed import split_dataset_by_node

from finetune.data.batching.collate import collate_rows
from finetune.data.batching.packing import BufferedPacker, examples_from_state, examples_state, packed_row
from finetune.data.formats.rows import TEMPLATE_WITHOUT_TOOLS
from finetune.data.formats.tokenize import TOO_LONG, bad_row_error, tokenize_stream, too_long_error
from finetune.data.sources.location import SHARD_BLOCK_BYTES, shard_identities
from finetune.data.sources.readers import load_stream
from finetune.errors import DataError, FinetuneError
from finetune.notices import warn

_DAMAGED = (
    "A damaged file? `finetune prepare-dataset` with that file as the entry names the line and byte "
    "(streaming has no on_bad_row placeholder for an unreadable line); or check the connection"
)
ENTRY_COLUMN = "_entry"  # which data.datasets entry a tokenized row came from (its label in errors)
STOPPING_STRATEGY = "all_exhausted_without_replacement"  # a pass reads every row of every entry once


def open_stream(
    data: Any, tokenizer: Any, *, chat_template: str | None, seed: int, rank: int, world_size: int
):
    """The tokenized rows of data.datasets as one IterableDataset: this process's part of the mix."""
    parts = []
    for i, entry in enumerate(data.datasets):
        label = f"data.datasets[{i}]"
        try:  # reads the first rows (their columns): a damaged file can fail here
            tokenized = tokenize_stream(
                load_stream(entry, entry_label=label),
                entry,
                tokenizer,
                sequence_len=data.sequence_len,
                excess_length_strategy=data.excess_length_strategy,
                chat_template=chat_template,
                entry_label=label,
            )
        except FinetuneError:
            raise
        except Exception as exc:
            raise DataError(
                f"{label}: reading {entry.path!r} failed: {type(exc).__name__}: {exc}. {_DAMAGED}"
            ) from exc
        features = datasets.Features({**tokenized.features, ENTRY_COLUMN: datasets.Value("int32")})
        parts.append(tokenized.map(partial(_tag, index=i), batched=True, features=features))
    stream = parts[0]
    if len(parts) > 1:
        # A stream's size is unknown up front: a weight is a share of the draws, not a count of them
        # as in a prepared mixture (docs/data.md, Streaming).
        weights = [float(e.weight) for e in data.datasets]
        stream = datasets.interleave_datasets(
            parts,
            probabilities=[w / sum(weights) for w in weights],
            seed=seed,
            stopping_strategy=STOPPING_STRATEGY,
        )
    if world_size > 1:
        stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
    return stream


def _tag(batch: dict, *, index: int) -> dict:
    return {ENTRY_COLUMN: [index] * len(batch["input_ids"])}


@dataclass
class StreamCounts:
    """Rows read from the stream and what became of them (this process's part)."""

    rows_in: int = 0
    rows_kept: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows

    def copy(self) -> StreamCounts:
        return StreamCounts(self.rows_in, self.rows_kept, self.truncated, dict(self.dropped))


@dataclass
class Snapshot:
    """Where the stream is after a micro-batch; `StreamLoader.state_dict` turns it into tensors and JSON."""

    epoch: int = 0
    dataset: dict | None = None  # the IterableDataset's state_dict (None: from the start of the pass)
    pending: list = field(default_factory=list)  # the packer's examples
    ready: list = field(default_factory=list)  # rows (lists of examples) packed, not yet batched
    packer_counts: tuple[int, int] = (0, 0)  # rows released, tokens in them
    counts: StreamCounts = field(default_factory=StreamCounts)


class StreamReader:
    """Reads the stream from a snapshot and yields (micro-batch, snapshot after it), forever."""

    def __init__(
        self,
        make_stream: Callable[[], datasets.IterableDataset],
        *,
        entries: list,
        on_bad_row: str,
        excess_length_strategy: str,
        sequence_len: int,
        make_packer: Callable[[], BufferedPacker],
        micro_batch_size: int,
        pad_token_id: int,
        pad_to_multiple_of: int,
    ):
        self.make_stream, self.entries, self.make_packer = make_stream, entries, make_packer
        self.on_bad_row, self.strategy, self.sequence_len = on_bad_row, excess_length_strategy, sequence_len
        self.micro_batch_size, self.pad_token_id, self.pad_to_multiple_of = (
            micro_batch_size,
            pad_token_id,
            pad_to_multiple_of,
        )
        self.packed, self.capacity = make_packer().packed, make_packer().capacity
        self.packer: BufferedPacker | None = None  # the packer of the running pass (its efficiency is logged)

    def batches(self, start: Snapshot) -> Iterator[tuple[dict, Snapshot]]:
        packer = self.packer = self.make_packer()
        packer.pending, (packer.num_rows, packer.num_tokens) = list(start.pending), start.packer_counts
        epoch, ready, counts, position = start.epoch, list(start.ready), start.counts.copy(), start.dataset
        while True:
            stream = self.make_stream()
            if position is not None:
                stream.load_state_dict(position)
            kept_before, rows_read = counts.rows_kept, _read(stream)
            state, moved = position, False  # the stream's position (before its next row), read since?
            while True:
                # Rows ready for a micro-batch leave before the next row is read: one row can release
                # several packed rows, and a snapshot taken between their micro-batches resumes to the
                # next one with nothing read (reading first counted one row more after a resume).
                while len(ready) >= self.micro_batch_size:
                    rows, ready = ready[: self.micro_batch_size], ready[self.micro_batch_size :]
                    if moved:  # a copy of the stream's state: taken once per micro-batch, not per row
                        state, moved = stream.state_dict(), False
                    snapshot = Snapshot(
                        epoch, state, list(packer.pending), list(ready),
                        (packer.num_rows, packer.num_tokens), counts.copy(),
                    )  # fmt: skip
                    yield self._collate(rows), snapshot
                row = next(rows_read, None)
                if row is None:
                    break
                example = self._account(row, counts)
                if example is not None:
                    ready.extend(packer.add(example))
                moved = True
            if counts.rows_kept == kept_before and position is None:
                raise DataError(
                    f"the stream of data.datasets has no training rows (read {counts.rows_in}, dropped "
                    f"{counts.dropped}); fix the data or data.on_bad_row / data.excess_length_strategy"
                )
            epoch, position = epoch + 1, None

    def _account(self, row: dict, counts: StreamCounts) -> tuple[list[int], list[int]] | None:
        """The example of a tokenized row, or None (counted under its reason) or an error, as
        data.on_bad_row and data.excess_length_strategy say."""
        counts.rows_in += 1
        drop = row["_drop"]
        if not drop:
            counts.rows_kept += 1
            counts.truncated += int(row["_truncated"])
            return row["input_ids"], row["labels"]
        index = row[ENTRY_COLUMN]
        label, entry = f"data.datasets[{index}]", self.entries[index]
        is_bad = drop.startswith("bad_row:")
        if is_bad and (self.on_bad_row == "raise" or drop == f"bad_row:{TEMPLATE_WITHOUT_TOOLS}"):
            raise bad_row_error(label, entry, row["source_row"], drop, row["_field"], row["_detail"])
        if drop == TOO_LONG and self.strategy == "raise":
            limit = entry.max_seq_len or self.sequence_len
            raise too_long_error(label, entry, row["source_row"], row["_num_tokens"], limit)
        counts.dropped[drop] = counts.dropped.get(drop, 0) + 1
        return None

    def _collate(self, rows: list[list]) -> dict:
        packed = self.packed
        multiple = self.pad_to_multiple_of if packed else None
        built = [packed_row(r, pad_to_multiple_of=multiple, pad_token_id=self.pad_token_id) for r in rows]
        return collate_rows(
            built, pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of, packed=packed
        )


def _read(stream: datasets.IterableDataset) -> Iterator[dict]:
    """The stream's rows; a failure while reading (a damaged line, a lost connection) as a DataError."""
    iterator = iter(stream)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except FinetuneError:
            raise
        except Exception as exc:
            raise DataError(
                f"reading the data.datasets stream failed: {type(exc).__name__}: {exc}. {_DAMAGED}"
            ) from exc
        yield row


class StreamLoader:
    """The training loader of a streaming run: micro-batches from a `StreamReader`, its position
    checkpointed (`state_dict` / `load_state_dict`, registered as extra state by the objective).

    `resumes_itself` tells the engine not to skip batches on resume (the prepared loader's way):
    the stream restarts from the position in its state. `len()` is the run's micro-batches
    (train.max_steps x the accumulation steps): the stream never ends an epoch of the loop.
    """

    resumes_itself = True

    def __init__(
        self, reader: StreamReader, *, num_batches: int, prefetch: int, rank: int = 0, world_size: int = 1
    ):
        self.reader, self.num_batches, self.prefetch = reader, num_batches, prefetch
        self.rank, self.world_size = rank, world_size
        self.position = Snapshot()  # after the last micro-batch the loop took

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """Nothing: a stream's passes are counted in its own state."""

    def __iter__(self) -> Iterator[dict]:
        source = self.reader.batches(self.position)
        if self.prefetch:
            source = _in_background(source, self.prefetch)
        for batch, snapshot in source:
            self.position = snapshot
            yield batch

    def counts(self) -> StreamCounts:
        return self.position.counts

    def packing_efficiency(self) -> float:
        """Example tokens / (rows x capacity) over the rows packed so far (this process)."""
        rows, tokens = self.position.packer_counts
        return tokens / (rows * self.reader.capacity) if rows else 0.0

    def state_dict(self) -> dict:
        """This process's position (tensors and JSON values); every process's in a multi-process run
        (a collective: every process calls it, finetune.engine.checkpoints)."""
        p = self.position
        ready_sizes = [len(row) for row in p.ready]
        local = {
            "epoch": p.epoch,
            "dataset": p.dataset,
            "pending": examples_state(p.pending),
            "ready": examples_state([e for row in p.ready for e in row]),
            "ready_row_sizes": ready_sizes,
            "packer_counts": list(p.packer_counts),
            "counts": vars(p.counts) | {"dropped": dict(p.counts.dropped)},
        }
        ranks = [local]
        if self.world_size > 1:
            import torch.distributed as dist

            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, local)
        shards = {f"data.datasets[{i}]": shard_identities(e) for i, e in enumerate(self.reader.entries)}
        return {"num_processes": self.world_size, "ranks": ranks, "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's position (this process's part of it)."""
        if state["num_processes"] != self.world_size:
            raise FinetuneError(
                f"the checkpoint's data stream was read by {state['num_processes']} processes and this run has "
                f"{self.world_size}: each process reads its own part of a stream, so resume with "
                f"{state['num_processes']} processes"
            )
        if "shards" in state:  # (checkpoints of earlier versions hold no shard identities)
            check_shards(state["shards"], self.reader.entries, say=warn if self.rank == 0 else None)
        local = state["ranks"][self.rank]
        examples = examples_from_state(local["ready"])
        ready, start = [], 0
        for size in local["ready_row_sizes"]:
            ready.append(examples[start : start + size])
            start += size
        counts = local["counts"]
        self.position = Snapshot(
            epoch=int(local["epoch"]),
            dataset=local["dataset"],
            pending=examples_from_state(local["pending"]),
            ready=ready,
            packer_counts=tuple(int(n) for n in local["packer_counts"]),
            counts=StreamCounts(
                counts["rows_in"], counts["rows_kept"], counts["truncated"], dict(counts["dropped"])
            ),
        )


def check_shards(recorded: dict, entries: list, *, say: Callable[[str], Any] | None = warn) -> None:
    """Refuse to resume a stream whose local shards changed since the checkpoint (a shard added or
    gone, or its size or first block changed: the checkpoint's position counts rows of the shards as
    they were, so the run would train other rows without a word); warn (through `say`) when only a
    shard's modification time changed."""
    for i, entry in enumerate(entries):
        label = f"data.datasets[{i}]"
        before = {s["name"]: s for s in recorded.get(label, [])}
        now = {s["name"]: s for s in shard_identities(entry)}
        if not before:  # a Hub id or a URL (nothing recorded), or an entry the checkpoint did not have
            continue
        redo = (
            "Put the shards back as they were to resume this run, or start a new one (another "
            "train.output_dir, or --train.load_checkpoint_path null) to train on the data as it is now"
        )
        gone, added = sorted(before.keys() - now.keys()), sorted(now.keys() - before.keys())
        if gone or added:
            what = "; ".join(
                part
                for part in (
                    f"gone: {', '.join(gone)}" if gone else "",
                    f"new: {', '.join(added)}" if added else "",
                )
                if part
            )
            raise DataError(
                f"{label} ({entry.path}): its shards changed since the checkpoint ({what}): the checkpoint's "
                f"stream position counts the rows of the shards it read. {redo}"
            )
        for name, was in before.items():
            is_ = now[name]
            if was["size"] != is_["size"] or was["head_blake2b"] != is_["head_blake2b"]:
                change = (
                    f"its size went from {was['size']} to {is_['size']} bytes"
                    if was["size"] != is_["size"]
                    else f"its first {SHARD_BLOCK_BYTES // 1024} KiB differ"
                )
                raise DataError(
                    f"{label} ({entry.path}): shard {name} changed since the checkpoint ({change}): the "
                    f"checkpoint's stream position counts the rows of the shard as it was, and resuming "
                    f"would train other rows than the interrupted run. {redo}"
                )
            if was["mtime_ns"] != is_["mtime_ns"] and say is not None:
                say(
                    f"{label} ({entry.path}): shard {name} was modified since the checkpoint (same size and "
                    f"first {SHARD_BLOCK_BYTES // 1024} KiB, another modification time); resuming from the "
                    "checkpoint's position. If its rows changed, the resumed run reads other rows than the "
                    "interrupted one: put the shard back as it was, or start a new run"
                )


def make_stream_loader(
    data: Any, train: Any, tokenizer: Any, *, chat_template: str | None, rank: int = 0, world_size: int = 1
) -> StreamLoader:
    """The StreamLoader of a data.streaming run (the data and train sections): this process's part of
    the stream, packed as data.sample_packing says, read in a background thread when
    data.dataloader_num_workers > 0. Opening the stream once here makes a missing file or column, or a
    tokenizer without the template a format needs, fail before the model is built."""
    from finetune.model.build import pad_token_id

    def make_stream() -> datasets.IterableDataset:
        return open_stream(
            data, tokenizer, chat_template=chat_template, seed=train.seed, rank=rank, world_size=world_size
        )

    reader = StreamReader(
        make_stream,
        entries=list(data.datasets),
        on_bad_row=data.on_bad_row,
        excess_length_strategy=data.excess_length_strategy,
        sequence_len=data.sequence_len,
        make_packer=lambda: BufferedPacker(
            data.packing_len if data.sample_packing else data.sequence_len,
            buffer_size=data.stream_buffer_size,
            method=data.sample_packing_method,
            packed=data.sample_packing,
        ),
        micro_batch_size=train.micro_batch_size,
        pad_token_id=pad_token_id(tokenizer),
        pad_to_multiple_of=data.pad_to_multiple_of,
    )
    make_stream()
    prefetch = (data.dataloader_prefetch_factor or 2) * data.dataloader_num_workers
    num_batches = train.max_steps * train.gradient_accumulation_steps
    return StreamLoader(reader, num_batches=num_batches, prefetch=prefetch, rank=rank, world_size=world_size)


_DONE = object()


def _in_background(items: Iterator, maxsize: int) -> Iterator:
    """`items` produced by a daemon thread, at most `maxsize` ahead of the consumer; its errors are
    raised here. The thread stops, and is joined, when the consumer is closed (or collected)."""
    buffer: queue.Queue = queue.Queue(maxsize=maxsize)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            buffer.put(exc)
            return
        buffer.put(_DONE)

    thread = threading.Thread(target=produce, name="finetune-stream", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # Wait for the thread to finish the batch it is making: a daemon thread still inside the
        # tokenizer or pyarrow when the interpreter exits aborts the process ("terminate called").
        stop.set()
        thread.join()
