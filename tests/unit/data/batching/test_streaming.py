"""data.streaming: the buffered packer, the stream's exact state round trip, token identity with the
prepared path, bad rows, and the recipe rules."""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from finetune.data.batching.packing import BufferedPacker, pack_multipack, packing_efficiency
from finetune.data.batching.streaming import make_stream_loader, open_stream
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.data.sources.readers import load_source
from finetune.engine.extra_state import load_extra, save_extra
from finetune.errors import DataError, RecipeError
from finetune.recipe import DataSection, dataset_entry, load_recipe

REPO = Path(__file__).resolve().parents[4]
DEMO_DATA = REPO / "recipes" / "demo" / "data" / "arithmetic.jsonl"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """300 demo rows in three jsonl shards, with two bad rows (an output that is not text)."""
    folder = tmp_path_factory.mktemp("shards")
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:300]]
    rows[17]["output"] = 5
    rows[230]["output"] = ["a", "list"]
    for k in range(3):
        with open(folder / f"part-{k}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k * 100 : (k + 1) * 100])
    return folder


def settings(path: Path, **data) -> tuple[DataSection, SimpleNamespace]:
    section = DataSection(
        datasets=[dataset_entry(path=str(path), type="alpaca")],
        streaming=True,
        sequence_len=128,
        sample_packing_sequence_len=256,
        pad_to_multiple_of=8,
        on_bad_row="skip",
        **({"stream_buffer_size": 32} | data),
    )
    return section, SimpleNamespace(seed=0, micro_batch_size=2, max_steps=1000, gradient_accumulation_steps=1)


def batches(loader, n: int) -> list[dict]:
    out = []
    for batch in loader:
        out.append({k: v.clone() for k, v in batch.items()})
        if len(out) == n:
            break
    return out


def sequences(batch: dict) -> list[tuple]:
    """The (ids, labels) of every sequence of a packed batch (padding segments left out)."""
    out = []
    for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"], strict=True):
        starts = [i for i in range(len(pos)) if pos[i] == 0] + [len(pos)]
        for a, b in pairwise(starts):
            if (labels[a:b] != -100).any():  # padding has no label
                out.append((tuple(ids[a:b].tolist()), tuple(labels[a:b].tolist())))
    return out


# ------------------------------------------------------------------------------------ packer


def _examples(lengths):
    return [([i] * n, [i] * n) for i, n in enumerate(lengths)]


def _run_packer(packer, examples):
    rows = [row for e in examples for row in packer.add(e)]
    return rows + packer.flush()


@pytest.mark.parametrize("method", ["multipack", "sequential"])
def test_packer_splits_nothing_and_is_deterministic(method):
    lengths = np.random.default_rng(0).integers(1, 200, size=2000).tolist()
    rows = _run_packer(BufferedPacker(256, buffer_size=100, method=method), _examples(lengths))
    again = _run_packer(BufferedPacker(256, buffer_size=100, method=method), _examples(lengths))
    assert rows == again
    assert all(sum(len(ids) for ids, _ in row) <= 256 for row in rows)
    seen = sorted(ids[0] for row in rows for ids, _ in row)
    assert seen == list(range(len(lengths)))  # every example once, whole (lengths kept below)
    assert all(len(ids) == lengths[ids[0]] for row in rows for ids, _ in row)
    if method == "sequential":  # next-fit keeps the stream's order
        assert [ids[0] for row in rows for ids, _ in row] == list(range(len(lengths)))


def test_packer_buffer_is_bounded_and_packs_close_to_multipack():
    lengths = np.random.default_rng(1).integers(1, 200, size=5000).tolist()
    packer = BufferedPacker(256, buffer_size=200)
    rows = []
    for e in _examples(lengths):
        rows += packer.add(e)
        assert len(packer.pending) <= 200
    rows += packer.flush()
    whole = packing_efficiency(lengths, len(pack_multipack(lengths, 256)), 256)
    buffered = packing_efficiency(lengths, len(rows), 256)
    assert buffered > 0.97 and buffered > whole - 0.02, (buffered, whole)
    assert packer.efficiency() == pytest.approx(buffered)


def test_packer_state_round_trip():
    lengths = np.random.default_rng(2).integers(1, 120, size=600).tolist()
    examples = _examples(lengths)
    whole = _run_packer(BufferedPacker(128, buffer_size=50), examples)
    first = BufferedPacker(128, buffer_size=50)
    rows = [row for e in examples[:333] for row in first.add(e)]
    second = BufferedPacker(128, buffer_size=50)
    second.load_state_dict(first.state_dict())
    assert rows + _run_packer(second, examples[333:]) == whole


# ------------------------------------------------------------------------------------ stream


def test_stream_resumes_exactly_from_its_state(shards, tok, tmp_path):
    data, train = settings(shards, dataloader_num_workers=1)  # the background thread
    reference = make_stream_loader(data, train, tok, chat_template=None)
    want = batches(reference, 40)  # more than one pass over the 300 rows

    loader = make_stream_loader(data, train, tok, chat_template=None)
    head = batches(loader, 13)
    save_extra({"data_stream": loader}, tmp_path)  # what a checkpoint writes (tensors + JSON)
    resumed = make_stream_loader(data, train, tok, chat_template=None)
    load_extra({"data_stream": resumed}, tmp_path)
    tail = batches(resumed, 27)
    for got, expected in zip(head + tail, want, strict=True):
        for key in expected:
            assert got[key].equal(expected[key]), key
    assert resumed.position.epoch >= 1  # the stream started over at least once
    assert vars(resumed.counts()) == vars(reference.counts())
    counts = resumed.counts()
    assert counts.rows_in == counts.rows_kept + sum(counts.dropped.values())
    assert set(counts.dropped) == {"bad_row:wrong_type"}


def test_stream_is_token_identical_to_prepared_rows(shards, tok):
    data, train = settings(shards, dataloader_num_workers=0)
    loader = make_stream_loader(data, train, tok, chat_template=None)
    streamed: Counter = Counter()
    for batch in loader:
        streamed.update(sequences(batch))
        if loader.position.epoch >= 1:  # one pass read, and the first rows of the next
            break
    position = loader.position
    pending = position.pending + [e for row in position.ready for e in row]
    streamed.update((tuple(ids), tuple(labels)) for ids, labels in pending)

    entry = dataset_entry(path=str(shards), type="alpaca")
    raw = load_source(entry, on_bad_row="skip")
    prepared = tokenize_dataset(
        raw, entry, tok, sequence_len=128, excess_length_strategy="drop", on_bad_row="skip"
    )
    assert len(prepared.dataset) == 298
    # Every prepared example once, plus the rows of the second pass read so far (the first ones).
    next_pass = position.counts.rows_in - 300
    rows = list(prepared.dataset) + [r for r in prepared.dataset if r["source_row"] < next_pass]
    expected = Counter((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)
    assert streamed == expected


def test_stream_bad_row_raises_naming_the_row(shards, tok):
    data, train = settings(shards, dataloader_num_workers=1)
    data = data.model_copy(update={"on_bad_row": "raise"})
    with pytest.raises(DataError, match=r"data.datasets\[0\] .*row 17: field 'output'"):
        batches(make_stream_loader(data, train, tok, chat_template=None), 200)


def test_missing_file_fails_when_the_loader_is_made(tmp_path, tok):
    data, train = settings(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        make_stream_loader(data, train, tok, chat_template=None)


# ------------------------------------------------------------------------------------ recipe


STREAM_RECIPE = REPO / "recipes" / "demo" / "tiny_sft_stream_cpu.yaml"


def test_recipe_rules():
    load_recipe(STREAM_RECIPE)
    cases = {
        "train.max_steps": (["--train.max_steps", "null"], "needs it"),
        "train.objective": (["--train.objective", "dpo"], "sft objective only"),
        "data.val_set_size": (["--data.val_set_size", "0.1"], "not used with data.streaming"),
        "data.shuffle_merged_datasets": (["--data.shuffle_merged_datasets", "true"], "shards' order"),
        "train.num_train_epochs": (["--train.num_train_epochs", "3"], "max_steps sets the run's length"),
    }
    for path, (overrides, message) in cases.items():
        with pytest.raises(RecipeError) as info:
            load_recipe(STREAM_RECIPE, overrides)
        assert path in str(info.value) and message in str(info.value), str(info.value)


def test_each_process_reads_its_own_part(tmp_path, tok):
    """split_dataset_by_node: two processes read disjoint parts whose union is the stream."""
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:120]]
    for k in range(4):  # 4 shards: each process reads 2 whole files
        with open(tmp_path / f"part-{k}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k * 30 : (k + 1) * 30])
    data, _ = settings(tmp_path)
    parts = [
        [
            (r["input_ids"], r["labels"])
            for r in open_stream(data, tok, chat_template=None, seed=0, rank=rank, world_size=2)
        ]
        for rank in (0, 1)
    ]
    whole = [
        (r["input_ids"], r["labels"])
        for r in open_stream(data, tok, chat_template=None, seed=0, rank=0, world_size=1)
    ]
    assert len(parts[0]) == len(parts[1]) == 60
    assert sorted(parts[0] + parts[1]) == sorted(whole)


def test_damaged_file_is_a_data_error(tmp_path, tok):
    lines = DEMO_DATA.read_text().splitlines()[:30]
    (tmp_path / "bad.jsonl").write_text(
        "\n".join([*lines[:20], '{"instruction": "x", broken', *lines[20:]]) + "\n"
    )
    data, train = settings(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"data.datasets\[0\]: reading .*bad.jsonl.* failed: .*JSON"):
        batches(make_stream_loader(data, train, tok, chat_template=None), 10)


def test_two_entries_interleave_and_resume_exactly(shards, tok, tmp_path):
    """Two entries (a folder of jsonl shards, a save_to_disk folder): every row of both once per pass,
    and the interleaving's state (its random generator) resumes exactly through a checkpoint."""
    import datasets

    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[300:400]]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    data, train = settings(shards, dataloader_num_workers=0)
    data = data.model_copy(
        update={"datasets": [*data.datasets, dataset_entry(path=str(tmp_path / "saved"), type="alpaca")]}
    )
    want = batches(make_stream_loader(data, train, tok, chat_template=None), 60)  # > 1 pass
    loader = make_stream_loader(data, train, tok, chat_template=None)
    head = batches(loader, 9)
    save_extra({"data_stream": loader}, tmp_path)
    resumed = make_stream_loader(data, train, tok, chat_template=None)
    load_extra({"data_stream": resumed}, tmp_path)
    for got, expected in zip(head + batches(resumed, 51), want, strict=True):
        assert all(got[key].equal(expected[key]) for key in expected)
    assert resumed.position.epoch >= 1

    # One pass holds every row of both entries once: compare with the prepared path's examples.
    reader = make_stream_loader(data, train, tok, chat_template=None)
    streamed: Counter = Counter()
    for batch in reader:
        streamed.update(sequences(batch))
        if reader.position.epoch >= 1:
            break
    position = reader.position
    pending = position.pending + [e for row in position.ready for e in row]
    streamed.update((tuple(ids), tuple(labels)) for ids, labels in pending)
    expected: Counter = Counter()
    for entry in data.datasets:
        prepared = tokenize_dataset(
            load_source(entry, on_bad_row="skip"), entry, tok, sequence_len=128,
            excess_length_strategy="drop", on_bad_row="skip",
        ).dataset  # fmt: skip
        expected.update((tuple(r["input_ids"]), tuple(r["labels"])) for r in prepared)
    assert sum(expected.values()) == 398 and not expected - streamed
    next_pass = streamed - expected  # the rows of the second pass read so far
    assert sum(next_pass.values()) == position.counts.rows_kept - 398 and not next_pass - expected


def test_prepare_dataset_refuses_a_streaming_recipe(capsys):
    from finetune.cli import main

    assert main(["prepare-dataset", str(STREAM_RECIPE)]) == 2
    assert "nothing to prepare" in capsys.readouterr().err


def _two_process_worker(rank: int, folder: str, port: int) -> None:
    """One of two gloo processes: each reads its part, saves every process's position (a collective),
    and a fresh loader resumes its own part exactly from it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tok = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
        data, train = settings(Path(folder) / "shards")
        make = lambda: make_stream_loader(data, train, tok, chat_template=None, rank=rank, world_size=2)  # noqa: E731
        want = batches(make(), 10)
        loader = make()
        head = batches(loader, 4)
        state = loader.state_dict()  # every process calls it: it gathers both positions
        assert state["num_processes"] == 2 and len(state["ranks"]) == 2
        resumed = make()
        resumed.load_state_dict(state)
        got = head + batches(resumed, 6)
        same = all(g[k].equal(w[k]) for g, w in zip(got, want, strict=True) for k in w)
        Path(folder, f"rank{rank}.json").write_text(
            json.dumps({"same": same, "first": want[0]["input_ids"][0, :16].tolist()})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes (a gloo group)
def test_two_processes_checkpoint_every_position(tmp_path):
    import socket

    import torch.multiprocessing as mp

    (tmp_path / "shards").mkdir()
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:200]]
    for k in range(4):
        with open(tmp_path / "shards" / f"part-{k}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k * 50 : (k + 1) * 50])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_process_worker, args=(str(tmp_path), port), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["same"] for r in results)
    assert results[0]["first"] != results[1]["first"]  # each reads its own part


def test_weights_set_the_shares_of_the_mix(shards, tok, tmp_path):
    """interleave_datasets with probabilities proportional to the weights (3 : 1), seeded."""
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[1000:1400]]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, _ = settings(shards)
    entries = [
        dataset_entry(path=str(shards), type="alpaca", weight=3.0),
        dataset_entry(path=str(tmp_path / "b.jsonl"), type="alpaca"),
    ]
    data = data.model_copy(update={"datasets": entries})
    stream = open_stream(data, tok, chat_template=None, seed=0, rank=0, world_size=1)
    first = [r["_entry"] for _, r in zip(range(200), stream, strict=False)]
    assert 0.65 < first.count(0) / 200 < 0.85


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_parquet_and_arrow_shards_stream_as_jsonl_does(tmp_path, tok, kind):
    """The same rows in parquet or arrow (IPC stream) shards give the same batches as jsonl shards."""
    import datasets
    import pyarrow as pa

    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:120]]
    (tmp_path / "jsonl").mkdir()
    (tmp_path / kind).mkdir()
    for k in range(2):
        part = rows[k * 60 : (k + 1) * 60]
        (tmp_path / "jsonl" / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        table = datasets.Dataset.from_list(part).data.table
        if kind == "parquet":
            datasets.Dataset(table).to_parquet(str(tmp_path / kind / f"part-{k}.parquet"))
        else:
            path = str(tmp_path / kind / f"part-{k}.arrow")
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)

    def first(folder: Path) -> list:
        data, train = settings(folder, dataloader_num_workers=0)
        return [sequences(b) for b in batches(make_stream_loader(data, train, tok, chat_template=None), 6)]

    expected = first(tmp_path / "jsonl")
    assert expected and first(tmp_path / kind) == expected


def test_a_url_streams_as_the_local_file_does(tmp_path, tok):
    """An http(s) URL (fsspec) is read as a stream: the same batches as the local file it serves."""
    import functools
    import http.server
    import threading

    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()[:80]]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:

        def first(path) -> list:
            data, train = settings(path, dataloader_num_workers=0)
            return [
                sequences(b) for b in batches(make_stream_loader(data, train, tok, chat_template=None), 4)
            ]

        url = f"http://127.0.0.1:{server.server_address[1]}/rows.jsonl"
        assert first(url) == first(tmp_path / "rows.jsonl")
    finally:
        server.shutdown()


def test_the_stream_resumes_from_every_state_of_its_buffers(shards, tok, tmp_path):
    """data.stream_buffer_size 16: checkpoints taken at every position of the first 12 batches, whatever
    the packer and ready-row buffers hold then (empty, partial, full), resume to the uninterrupted stream
    (an empty buffer's state once failed to load: zip() argument 2 is shorter than argument 1)."""
    data, train = settings(shards, stream_buffer_size=16)
    want = batches(make_stream_loader(data, train, tok, chat_template=None), 16)
    held = set()
    for cut in range(1, 13):
        loader = make_stream_loader(data, train, tok, chat_template=None)
        head = batches(loader, cut)
        folder = tmp_path / f"cut-{cut}"
        folder.mkdir()
        save_extra({"data_stream": loader}, folder)
        local = loader.state_dict()["ranks"][0]
        held.add((len(local["pending"]["lengths"]) > 0, len(local["ready_row_sizes"]) > 0))
        resumed = make_stream_loader(data, train, tok, chat_template=None)
        load_extra({"data_stream": resumed}, folder)
        for got, expected in zip(head + batches(resumed, 16 - cut), want, strict=True):
            for key in expected:
                assert got[key].equal(expected[key]), (cut, key)
    assert len(held) >= 2, held  # the cuts met the buffers in more than one state


def test_row_counts_after_a_resume_are_the_uninterrupted_streams(shards, tok, tmp_path):
    """At every micro-batch after a resume, the row counts are the uninterrupted stream's: a checkpoint
    taken between two micro-batches that one row released once resumed by reading a row first (the
    counters read 257 where the uninterrupted run logged 256)."""
    data, train = settings(shards)
    reference = make_stream_loader(data, train, tok, chat_template=None)
    want, cuts = [], []
    for _ in reference:
        want.append(vars(reference.counts()))
        if len(reference.position.ready) >= train.micro_batch_size:  # the next micro-batch is ready
            cuts.append(len(want))
        if len(want) == 30:
            break
    assert cuts, "no checkpoint between two micro-batches of one row: the test cannot fail"
    for cut in cuts[:3]:
        loader = make_stream_loader(data, train, tok, chat_template=None)
        batches(loader, cut)
        folder = tmp_path / f"cut-{cut}"
        folder.mkdir()
        save_extra({"data_stream": loader}, folder)
        resumed = make_stream_loader(data, train, tok, chat_template=None)
        load_extra({"data_stream": resumed}, folder)
        got = []
        for _ in resumed:
            got.append(vars(resumed.counts()))
            if len(got) == len(want) - cut:
                break
        assert got == want[cut:], cut


def _checkpoint_then(shards_src: Path, tmp_path: Path, tok, change) -> tuple[Path, Path, object]:
    """A copy of the shards, a stream checkpoint taken on it, then `change(folder)` applied."""
    import shutil

    folder = tmp_path / "shards"
    shutil.copytree(shards_src, folder)
    data, train = settings(folder)
    loader = make_stream_loader(data, train, tok, chat_template=None)
    batches(loader, 3)
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    save_extra({"data_stream": loader}, saved)
    change(folder)
    return folder, saved, make_stream_loader(data, train, tok, chat_template=None)


def _reorder(path: Path) -> None:
    """The same rows in another order: same size, other bytes (a kill, then the shard rewritten)."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[1:] + lines[:1]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: _reorder(f / "part-1.jsonl"), r"shard part-1.jsonl changed .*first 64 KiB differ"),
        (
            lambda f: (f / "part-2.jsonl").write_text((f / "part-2.jsonl").read_text() + "{}\n"),
            r"shard part-2.jsonl changed .*size went from \d+ to \d+ bytes",
        ),
        (lambda f: (f / "part-0.jsonl").unlink(), r"its shards changed .*gone: part-0.jsonl"),
        (
            lambda f: (f / "part-3.jsonl").write_text((f / "part-0.jsonl").read_text()),
            r"its shards changed .*new: part-3.jsonl",
        ),
    ],
    ids=["reordered", "grown", "removed", "added"],
)
def test_resume_refuses_changed_shards(shards, tok, tmp_path, change, message):
    folder, saved, resumed = _checkpoint_then(shards, tmp_path, tok, change)
    with pytest.raises(DataError, match=message) as info:
        load_extra({"data_stream": resumed}, saved)
    text = str(info.value)
    assert r"data.datasets[0]" in text and str(folder) in text
    assert "Put the shards back" in text and "--train.load_checkpoint_path null" in text


def test_resume_warns_when_only_a_shards_mtime_changed(shards, tok, tmp_path, capsys):
    import os

    def touch(f: Path) -> None:
        info = (f / "part-1.jsonl").stat()
        os.utime(f / "part-1.jsonl", ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))

    _, saved, resumed = _checkpoint_then(shards, tmp_path, tok, touch)
    load_extra({"data_stream": resumed}, saved)
    err = capsys.readouterr().err
    assert (
        "warning: data.datasets[0]" in err and "shard part-1.jsonl was modified since the checkpoint" in err
    )
    assert batches(resumed, 1)  # resumed from the checkpoint's position


def test_unchanged_shards_resume_without_a_word(shards, tok, tmp_path, capsys):
    _, saved, resumed = _checkpoint_then(shards, tmp_path, tok, lambda f: None)
    capsys.readouterr()
    load_extra({"data_stream": resumed}, saved)
    assert "warning" not in capsys.readouterr().err
    state = resumed.state_dict()["shards"]["data.datasets[0]"]
    assert [s["name"] for s in state] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
