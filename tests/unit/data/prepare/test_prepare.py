"""prepare(): fingerprint, cache reuse, manifest accounting, atomic writes, lock, skip, Hub round trip."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

from finetune.data.prepare import build as prepare_mod
from finetune.data.prepare.build import (
    fingerprint_inputs,
    load_prepared,
    prepare,
    prepare_on_main_process,
)
from finetune.data.prepare.cache import MANIFEST_NAME, PAUSE_ENV, compute_fingerprint
from finetune.data.prepare.fingerprint import FORMAT_VERSION
from finetune.data.sources.location import file_hash
from finetune.errors import DataError, RecipeError, WriteError
from finetune.recipe import Recipe, validate_recipe

PAD_ID = 3  # <pad> in the demo tokenizer
WORDS = [
    "apple",
    "pear",
    "plum",
    "cat",
    "dog",
    "bird",
    "fish",
    "red",
    "blue",
    "green",
    "sun",
    "moon",
    "star",
    "tree",
    "rock",
    "book",
]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def demo_tokenizer(repo_root: Path) -> Path:
    path = repo_root / "recipes" / "demo" / "tokenizer"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"demo tokenizer not generated yet at {path} (python recipes/demo/make_demo_data.py)")
    return path


@pytest.fixture
def workdir(tmp_path: Path, demo_tokenizer: Path) -> Path:
    """A tokenizer copy (its files may be edited) and two small jsonl datasets."""
    shutil.copytree(demo_tokenizer, tmp_path / "tokenizer")
    rows = []
    for i in range(60):
        a, b = i * 7 % 50, i * 3 % 40
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(i % 9))
        rows.append({"instruction": f"Add {a} and {b}.", "input": words, "output": f"{a} + {b} = {a + b}."})
    rows.append({"instruction": "Repeat the list.", "input": "", "output": " ".join(WORDS * 12)})  # too long
    rows.append({"instruction": "Say nothing.", "input": "", "output": None})  # bad row: missing output
    _write_jsonl(tmp_path / "alpaca.jsonl", rows)
    texts = [{"text": " ".join(WORDS[k % len(WORDS)] for k in range(i, i + 3 + i % 11))} for i in range(25)]
    _write_jsonl(tmp_path / "text.jsonl", texts)
    _write_jsonl(tmp_path / "test.jsonl", [{"text": f"{w} {w} {w}"} for w in WORDS[:6]])
    return tmp_path


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _recipe_dict(workdir: Path, **data) -> dict:
    return {
        "model": {
            "config_path": {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1},
            "tokenizer_path": str(workdir / "tokenizer"),
        },
        "data": {
            "datasets": [
                {"path": str(workdir / "alpaca.jsonl"), "type": "alpaca"},
                {"path": str(workdir / "text.jsonl"), "type": "completion"},
            ],
            "sequence_len": 128,
            "pad_to_multiple_of": 8,
            "on_bad_row": "skip",
            "dataset_num_proc": 1,
            "dataset_prepared_path": str(workdir / "prepared"),
            **data,
        },
        "train": {"output_dir": str(workdir / "out")},
    }


def _recipe(workdir: Path, **data) -> Recipe:
    return validate_recipe(_recipe_dict(workdir, **data))


def _with(d: dict, dotted: str, value) -> Recipe:
    d = copy.deepcopy(d)
    *parents, last = dotted.split(".")
    node = d
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return validate_recipe(d)


def _fp(recipe: Recipe) -> str:
    return compute_fingerprint(fingerprint_inputs(recipe))


def _rows(ds) -> list[dict]:
    return [dict(r) for r in ds]


def _quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------------------- build + cache


def test_prepare_builds_balanced_manifest_and_rows(workdir: Path):
    logs: list[str] = []
    recipe = _recipe(
        workdir, val_set_size=5, test_datasets=[{"path": str(workdir / "test.jsonl"), "type": "completion"}]
    )
    prepared = prepare(recipe, log=logs.append)
    m = prepared.manifest
    fp = _fp(recipe)
    assert prepared.source == "built"
    assert m["fingerprint"] == fp and prepared.path == workdir / "prepared" / fp
    assert (prepared.path / MANIFEST_NAME).is_file() and (prepared.path / "train").is_dir()

    # Every input row accounted for, per source and in total.
    for s in m["sources"]:
        assert s["rows_in"] == s["rows_kept"] + sum(s["dropped"].values())
    assert m["rows_in"] == 62 + 25 + 6
    assert m["rows_in"] == m["rows_kept"] + m["rows_dropped"]
    assert m["dropped"] == {"bad_row:missing_field": 1, "too_long": 1}
    assert m["bad_row_samples"][0]["row"] == 61 and m["bad_row_samples"][0]["field"] == "output"
    assert m["splits"]["train"]["examples"] + m["splits"]["eval"]["examples"] == m["rows_kept"]
    assert m["splits"]["eval"]["examples"] == 5 + 6  # val_set_size rows + the test dataset

    # Token counts and efficiency match the rows.
    train = prepared.train
    assert train.column_names == ["input_ids", "labels", "position_ids", "seq_lens"]
    for ids, seq_lens in zip(train["input_ids"], train["seq_lens"], strict=True):
        num_pad = ids.count(PAD_ID)  # the demo text never produces <pad>
        assert sum(seq_lens) == len(ids)
        assert num_pad == 0 or (seq_lens[-1] == num_pad and ids[-num_pad:] == [PAD_ID] * num_pad)
    real = sum(len(ids) - ids.count(PAD_ID) for ids in train["input_ids"])
    assert real == m["num_tokens"] == m["splits"]["train"]["num_tokens"]
    assert m["splits"]["train"]["num_padding_tokens"] == sum(map(len, train["input_ids"])) - real
    trainable = sum(sum(x != -100 for x in labels) for labels in train["labels"])
    assert trainable == m["num_trainable_tokens"]
    assert m["packing_efficiency"] == pytest.approx(m["num_tokens"] / (len(train) * 128), abs=1e-6)
    assert all(len(r) % 8 == 0 and len(r) <= 128 for r in train["input_ids"])
    assert set(m["timings"]) >= {"load", "tokenize", "pack", "save", "total"}
    assert m["versions"]["datasets"] and m["fingerprint_inputs"]["format_version"] == FORMAT_VERSION
    assert any("packing efficiency" in line and str(prepared.path) in line for line in logs)


def test_same_inputs_reuse_cache_without_tokenizing(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    recipe = _recipe(workdir)
    first = prepare(recipe, log=_quiet)

    def boom(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(prepare_mod, "tokenize_dataset", boom)
    monkeypatch.setattr(prepare_mod, "load_source", boom)
    again = prepare(_recipe(workdir), log=_quiet)
    assert again.source == "cache" and again.path == first.path
    assert _rows(again.train) == _rows(first.train)
    assert load_prepared(recipe).path == first.path


def test_val_set_size_zero_makes_no_eval_split(workdir: Path):
    recipe = _recipe(workdir, val_set_size=0)
    assert _fp(recipe) == _fp(_recipe(workdir))  # the same data as null
    m = prepare(recipe, log=_quiet).manifest
    assert "eval" not in m["splits"] and m["splits"]["train"]["examples"] == m["rows_kept"]


def test_same_recipe_elsewhere_gives_same_fingerprint_and_rows(workdir: Path):
    a = prepare(_recipe(workdir, dataset_prepared_path=str(workdir / "a")), log=_quiet)
    b = prepare(_recipe(workdir, dataset_prepared_path=str(workdir / "b")), log=_quiet)
    assert a.path.name == b.path.name
    assert _rows(a.train) == _rows(b.train)


# ------------------------------------------------------------------------------------------ fingerprint


CHANGES = [
    ("data.datasets.0.field_output", "answer"),
    ("data.datasets.0.train_on_inputs", True),
    ("data.datasets.0.type", "input_output"),
    ("data.datasets.0.max_seq_len", 64),
    ("data.datasets.0.apply_chat_template", True),
    ("data.datasets.1.split", "other"),
    ("data.datasets.1.weight", 0.5),
    ("data.datasets.0.weight", 2.0),
    ("data.sequence_len", 96),
    ("data.excess_length_strategy", "truncate"),
    ("data.on_bad_row", "raise"),
    ("data.sample_packing", False),
    ("data.sample_packing_method", "sequential"),
    ("data.sample_packing_sequence_len", 256),
    ("data.sample_packing_group_size", 10),
    ("data.pad_to_multiple_of", 16),
    ("data.val_set_size", 0.1),
    ("data.val_set_size", 3),
    ("data.shuffle_merged_datasets", False),
    ("data.shuffle_before_merging_datasets", False),
    ("data.test_datasets", [{"path": "TEST", "type": "completion"}]),
    ("model.chat_template", "chatml"),
    ("model.special_tokens", {"additional_special_tokens": ["<x>"]}),
    ("train.seed", 7),
]


@pytest.mark.parametrize(("field", "value"), CHANGES, ids=[f"{f}={v}" for f, v in CHANGES])
def test_fingerprint_changes_with_every_output_input(workdir: Path, field: str, value):
    base = _recipe_dict(workdir)
    if value == [{"path": "TEST", "type": "completion"}]:
        value = [{"path": str(workdir / "test.jsonl"), "type": "completion"}]
    assert _fp(_with(base, field, value)) != _fp(validate_recipe(base))


UNCHANGED = [
    ("data.dataset_num_proc", 2),
    ("data.num_dataset_shards_to_save", 3),
    ("data.push_dataset_to_hub", "me/data"),
    ("data.dataloader_num_workers", 0),
    ("data.dataloader_prefetch_factor", None),
    ("data.dataloader_pin_memory", False),
    ("data.dataloader_drop_last", False),
    ("data.dataset_prepared_path", "elsewhere"),
    ("data.datasets.0.trust_remote_code", True),
    ("data.datasets.0.weight", 1.0),  # the default, written: caches made before weights stay valid
    ("data.eval_sample_packing", False),  # no eval data: nothing to pack
    ("model.trust_remote_code", True),
    ("model.attn_implementation", "eager"),
    ("train.lr", 1e-3),
    ("train.output_dir", "other"),
]


@pytest.mark.parametrize(("field", "value"), UNCHANGED, ids=[f"{f}={v}" for f, v in UNCHANGED])
def test_fingerprint_ignores_what_does_not_change_the_output(workdir: Path, field: str, value):
    base = _recipe_dict(workdir)
    if field == "data.dataloader_num_workers":
        base["data"]["dataloader_prefetch_factor"] = None
    assert _fp(_with(base, field, value)) == _fp(validate_recipe(base))


# Fingerprints (without the file hashes) made when one entry class held every type's fields.
FORMAT_1_FINGERPRINTS = {
    "completion": ("92b9c795a6b10d8e", {"field_text": "body", "max_seq_len": 64, "train_on_eos": "none"}),
    "alpaca": (
        "c0a1b18a5908e409",
        {"field_input": "ctx", "apply_chat_template": True, "train_on_inputs": True},
    ),
    "input_output": (
        "bd98f3708af19fd4",
        {"field_prompt": "q", "field_completion": "a", "shards": 2, "shards_idx": 1},
    ),
    "chat_template": (
        "1534e9f56a397987",  # since field_tools (format version 2): a new field of the type is hashed
        {"role_map": {"human": "user"}, "roles_to_train": ["assistant", "user"], "train_on_eos": "last"},
    ),
    "tokenized": ("539e088225150738", {"split": "test", "data_files": ["a.jsonl"]}),
    "preference": ("9f7070c511f9ec1b", {"field_chosen": "c", "apply_chat_template": True}),
    "kto": ("ebc36ad79c5172a6", {"field_label": "ok", "train_on_eos": "none"}),
}


@pytest.mark.parametrize("kind", FORMAT_1_FINGERPRINTS)
def test_fingerprints_survive_the_schema_per_type(kind: str):
    # Each type's entry now has only its fields; the hashed settings still list them all (the others
    # at their defaults), so a recipe keeps the fingerprint of its prepared data.
    expected, fields = FORMAT_1_FINGERPRINTS[kind]
    data = {"model": {"model_path": "org/base"}, "train": {"output_dir": "o"}}
    data["train"]["objective"] = {"preference": "dpo", "kto": "kto"}.get(kind, "sft")
    data["data"] = {
        "datasets": [{"path": "x.jsonl", "type": kind, **fields}],
        "test_datasets": [{"path": "y.jsonl", "type": kind}],
    }
    inputs = fingerprint_inputs(validate_recipe(data), with_files=False)
    # Pinned at format version 1: a version bump changes every fingerprint by design (old caches are
    # ignored), while what this checks, the settings hashed per type, stays.
    assert compute_fingerprint({**inputs, "format_version": 1}) == expected


def test_fingerprint_follows_file_contents(workdir: Path):
    recipe = _recipe(workdir)
    before = _fp(recipe)
    assert _fp(recipe) == before  # stable
    with open(workdir / "text.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more row"}) + "\n")
    after_data = _fp(recipe)
    assert after_data != before
    config = workdir / "tokenizer" / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n", encoding="utf-8")  # same meaning, other bytes
    assert _fp(recipe) != after_data  # tokenizer files are hashed by content


def test_tokenizer_weights_are_not_hashed(workdir: Path):
    recipe = _recipe(workdir)
    before = _fp(recipe)
    (workdir / "tokenizer" / "model.safetensors").write_bytes(b"weights")
    assert _fp(recipe) == before


# --------------------------------------------------------------------------------------- split/pack modes


def test_split_and_packing_modes(workdir: Path):
    p = prepare(
        _recipe(workdir, val_set_size=0.2, eval_sample_packing=False, sample_packing=False), log=_quiet
    )
    kept = p.manifest["rows_kept"]
    assert len(p.eval) == round(0.2 * kept) and len(p.train) == kept - len(p.eval)
    assert all(len(s) == 1 for s in p.train["seq_lens"])  # one example per row, unpadded
    assert all(len(s) == 1 for s in p.eval["seq_lens"])
    assert p.manifest["splits"]["train"]["packed"] is False

    seq = prepare(_recipe(workdir, sample_packing_method="sequential", shuffle_merged_datasets=False,
                          shuffle_before_merging_datasets=False), log=_quiet)  # fmt: skip
    multi = prepare(
        _recipe(workdir, shuffle_merged_datasets=False, shuffle_before_merging_datasets=False), log=_quiet
    )
    assert seq.path != multi.path
    assert len(multi.train) <= len(seq.train)
    assert multi.manifest["packing_efficiency"] >= seq.manifest["packing_efficiency"]
    # Sequential packing keeps the data order: the token stream is the unpacked one.
    unpacked = prepare(_recipe(workdir, sample_packing=False, shuffle_merged_datasets=False,
                               shuffle_before_merging_datasets=False), log=_quiet)  # fmt: skip
    stream = [t for ids in unpacked.train["input_ids"] for t in ids]
    assert [t for ids in seq.train["input_ids"] for t in ids if t != PAD_ID] == stream
    assert unpacked.train["seq_lens"][0] == [len(unpacked.train["input_ids"][0])]


def test_val_set_size_must_leave_rows(workdir: Path):
    with pytest.raises(DataError, match="val_set_size"):
        prepare(_recipe(workdir, val_set_size=10_000), log=_quiet)


def test_max_seq_len_longer_than_a_row_is_an_error(workdir: Path):
    d = _recipe_dict(workdir)
    d["data"]["datasets"][0]["max_seq_len"] = 512
    with pytest.raises(DataError, match="max_seq_len"):
        prepare(validate_recipe(d), log=_quiet)


# ------------------------------------------------------------------------------------ damaged files


def _damage_text_jsonl(workdir: Path) -> bytes:
    """Make line 5 of text.jsonl invalid JSON and line 10 hold a byte that is not UTF-8; the old bytes."""
    path = workdir / "text.jsonl"
    original = path.read_bytes()
    lines = original.splitlines(keepends=True)
    lines[4] = b'{"text": "cut short\n'
    lines[9] = b'{"text": "caf\xe9 au lait"}\n'
    path.write_bytes(b"".join(lines))
    return original


def test_damaged_lines_are_counted_with_samples_and_cached(workdir: Path):
    original = _damage_text_jsonl(workdir)
    recipe = _recipe(workdir)  # on_bad_row: skip
    prepared = prepare(recipe, log=_quiet)
    m = prepared.manifest
    text = m["sources"][1]
    assert text["rows_in"] == 25 == text["rows_kept"] + text["rows_dropped"]  # every line of the file
    assert text["dropped"] == {"bad_row:invalid_json": 1, "bad_row:invalid_utf8": 1}
    assert m["rows_in"] == m["rows_kept"] + m["rows_dropped"]
    samples = {s["reason"]: s for s in m["bad_row_samples"] if s["dataset"] == "data.datasets[1]"}
    assert samples["invalid_json"]["row"] == 4 and samples["invalid_utf8"]["row"] == 9
    assert "text.jsonl line 5 (byte " in samples["invalid_json"]["detail"]
    assert "text.jsonl line 10 (byte " in samples["invalid_utf8"]["detail"]
    # The fingerprint hashes the file as it is (damage included), nothing else: the same run is a
    # cache hit, and fixing the file is a new preparation without the drops.
    [source_file] = m["fingerprint_inputs"]["datasets"][1]["source"]["files"]
    assert source_file["blake2b"] == file_hash(workdir / "text.jsonl")
    again = prepare(_recipe(workdir), log=_quiet)
    assert again.source == "cache" and again.path == prepared.path
    (workdir / "text.jsonl").write_bytes(original)
    fixed = prepare(_recipe(workdir), log=_quiet)
    assert fixed.path != prepared.path and fixed.manifest["sources"][1]["dropped"] == {}


def test_damaged_line_raise_names_it_and_writes_nothing(workdir: Path):
    _damage_text_jsonl(workdir)
    base = _recipe_dict(workdir, on_bad_row="raise")
    recipe = _with(base, "data.datasets", base["data"]["datasets"][1:])
    with pytest.raises(DataError) as err:
        prepare(recipe, log=_quiet)
    msg = str(err.value)
    assert msg.startswith(f"data.datasets[0]: {workdir / 'text.jsonl'} line 5 (byte ")
    assert "invalid JSON" in msg and "on_bad_row: skip" in msg
    assert not any(p.is_dir() for p in (workdir / "prepared").iterdir())


# ------------------------------------------------------------------------------------ skip / load


def test_skip_prepare_dataset(workdir: Path):
    recipe = _recipe(workdir, skip_prepare_dataset=True)
    with pytest.raises(DataError) as err:
        prepare(recipe, log=_quiet)
    assert str(workdir / "prepared" / _fp(recipe)) in str(err.value)
    assert "finetune prepare-dataset" in str(err.value)

    built = prepare(_recipe(workdir), log=_quiet)
    loaded = prepare(recipe, log=_quiet)
    assert loaded.path == built.path and loaded.source == "cache"

    # A machine with the cache but not the raw data: the matching preparation is found.
    (workdir / "alpaca.jsonl").unlink()
    assert load_prepared(recipe).path == built.path


def test_folder_without_manifest_is_never_loaded(workdir: Path):
    recipe = _recipe(workdir)
    built = prepare(recipe, log=_quiet)
    (built.path / MANIFEST_NAME).unlink()
    with pytest.raises(DataError, match="does not exist or is incomplete"):
        load_prepared(recipe)
    again = prepare(recipe, log=_quiet)
    assert again.source == "built" and (again.path / MANIFEST_NAME).is_file()


def test_stale_temporary_folders_are_removed_unless_being_written(workdir: Path):
    root = workdir / "prepared"
    stale = root / ".tmp-0123456789abcdef-999999"  # a crashed run: nobody holds its lock
    live = root / ".tmp-fedcba9876543210-1"  # another process writing right now
    for tmp in (stale, live):
        (tmp / "train").mkdir(parents=True)
    with FileLock(root / "fedcba9876543210.lock"):
        prepare(_recipe(workdir), log=_quiet)
        assert not stale.exists()
        assert live.exists()


def test_a_full_disk_while_saving_is_a_clear_error_and_removes_the_partial_folder(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
):
    """datasets' save_to_disk fails midway (Arrow reports ENOSPC as an OSError): the error says where,
    how much is free and what to do, and the .tmp-* folder does not stay to fill the disk."""
    import datasets

    real = datasets.Dataset.save_to_disk

    def full(self, path, **kwargs):
        real(self, path, **kwargs)  # some bytes are on disk when the disk fills
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    root = workdir / "prepared"
    with pytest.raises(WriteError) as caught:
        prepare(_recipe(workdir), log=_quiet)
    message = str(caught.value)
    assert (
        f"writing the prepared dataset {_fp(_recipe(workdir))} in {root}: no space left on the device"
        in message
    )
    assert "MiB free on that disk" in message and "another data.dataset_prepared_path" in message
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_push_needs_a_repo(workdir: Path):
    with pytest.raises(RecipeError, match="push_dataset_to_hub"):
        prepare(_recipe(workdir), push=True, log=_quiet)


# ------------------------------------------------------------------------------------ processes

_SCRIPT = """
import hashlib, json, sys
from finetune.recipe import load_recipe
from finetune.data.prepare.build import prepare
p = prepare(load_recipe(sys.argv[1]), log=lambda s: print(s, file=sys.stderr, flush=True))
digest = hashlib.sha256(json.dumps(p.train[:], sort_keys=True).encode()).hexdigest()
print(json.dumps({"source": p.source, "fingerprint": p.manifest["fingerprint"], "train": digest}))
"""


def _spawn(recipe_path: Path, repo_root: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(recipe_path)],
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _write_recipe(workdir: Path, **data) -> Path:
    path = workdir / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe_dict(workdir, **data)), encoding="utf-8")
    return path


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 90) -> None:
    """Read proc's stderr until a line contains text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before printing {text!r}")
    raise AssertionError(f"no {text!r} within {timeout} s")


@pytest.mark.slow  # processes, paused and killed
def test_two_processes_prepare_once(workdir: Path, repo_root: Path):
    recipe_path = _write_recipe(workdir)
    root = workdir / "prepared"
    first = _spawn(recipe_path, repo_root, **{PAUSE_ENV: "60"})
    second = None
    try:
        _wait_for(first, "paused")  # the first holds the lock, mid-write
        second = _spawn(recipe_path, repo_root)
        _wait_for(second, "waiting for the lock")  # found no complete folder: it blocks on the lock
        (next(root.glob(".tmp-*")) / "resume").touch()
        results = []
        for proc in (first, second):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert [r["source"] for r in results] == ["built", "cache"]  # only the first tokenized
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    assert results[0]["train"] == results[1]["train"]


@pytest.mark.slow  # processes, paused and killed
def test_killed_prepare_leaves_nothing_loadable(workdir: Path, repo_root: Path):
    recipe_path = _write_recipe(workdir)
    root = workdir / "prepared"
    proc = _spawn(recipe_path, repo_root, **{PAUSE_ENV: "60"})
    try:
        _wait_for(proc, "paused")
        tmp_dirs = list(root.glob(".tmp-*"))
        assert len(tmp_dirs) == 1 and (tmp_dirs[0] / "train").is_dir()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    recipe = _recipe(workdir)
    fp = _fp(recipe)
    assert not (root / fp).exists()
    with pytest.raises(DataError):
        load_prepared(recipe)
    again = prepare(recipe, log=_quiet)
    assert again.source == "built" and again.path == root / fp
    assert not list(root.glob(".tmp-*"))  # the stale temporary folder was cleaned up


# ----------------------------------------------------------------------------------------- accelerate


class _Accelerator:
    """What prepare_on_main_process uses of an Accelerator, for one rank of a real gloo group."""

    def __init__(self, rank: int, world: int):
        self.num_processes, self.is_main_process = world, rank == 0
        self.is_local_main_process = rank == 0
        self.messages: list[str] = []

    def print(self, *args):
        self.messages.append(" ".join(map(str, args)))


def _prepare_rank(rank: int, world: int, init_file: str, recipe: Recipe, out: str, delay: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # The default group's timeout (3 s) is shorter than the main process's prepare (delay): a barrier
    # on it would fail; the patient group's does not.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=3)
    )
    if rank == 0:
        real = prepare_mod.prepare

        def slow(*args, **kwargs):
            time.sleep(delay)
            return real(*args, **kwargs)

        prepare_mod.prepare = slow
    accelerator = _Accelerator(rank, world)
    started = time.monotonic()
    prepared = prepare_on_main_process(recipe, accelerator)
    waited = time.monotonic() - started
    result = {"source": prepared.source, "path": str(prepared.path), "waited": waited}
    result["printed"] = bool(accelerator.messages)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow  # two processes (a gloo group)
def test_prepare_on_main_process_waits_without_timeout(workdir: Path, tmp_path: Path):
    """Two real processes: rank 0 builds (slower than the default group's timeout), rank 1 waits, then
    loads the same folder from the cache."""
    import torch.multiprocessing as mp

    recipe = _recipe(workdir)
    mp.spawn(_prepare_rank, args=(2, str(tmp_path / "init"), recipe, str(tmp_path), 6.0), nprocs=2, join=True)
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert main["source"] == "built" and other["source"] == "cache"
    assert main["path"] == other["path"]
    assert other["waited"] > 6.0  # it waited past the 3 s default timeout
    assert main["printed"] and not other["printed"]  # the waiting rank stays quiet


def test_prepare_on_main_process_runs_the_given_prepare_function() -> None:
    """`build` replaces `prepare` (diffusion passes prepare_images): called once, with push and log."""
    calls = []

    def build(recipe, *, push=False, log=print):
        calls.append((recipe, push))
        log("built")
        return "prepared"

    accelerator = _Accelerator(0, 1)
    assert prepare_on_main_process("recipe", accelerator, push=True, build=build) == "prepared"
    assert calls == [("recipe", True)] and accelerator.messages == ["built"]


# ------------------------------------------------------------------------------------------------ hub


def test_hub_round_trip(workdir: Path, hub_repo_id: str, monkeypatch: pytest.MonkeyPatch):
    pushed = prepare(_recipe(workdir, push_dataset_to_hub=hub_repo_id), log=_quiet)
    assert pushed.source == "built"

    def boom(*args, **kwargs):
        raise AssertionError("the Hub copy should have been used")

    monkeypatch.setattr(prepare_mod, "tokenize_dataset", boom)
    other = _recipe(
        workdir, push_dataset_to_hub=hub_repo_id, dataset_prepared_path=str(workdir / "elsewhere")
    )
    pulled = prepare(other, log=_quiet)
    assert pulled.source == "hub"
    assert pulled.path == workdir / "elsewhere" / pushed.path.name
    assert (pulled.path / MANIFEST_NAME).is_file()
    assert _rows(pulled.train) == _rows(pushed.train)
    assert pulled.manifest["fingerprint"] == pushed.manifest["fingerprint"]
    assert pulled.manifest["sources"] == pushed.manifest["sources"]
    assert pulled.manifest["pulled_from"] == hub_repo_id
    assert prepare(other, log=_quiet).source == "cache"  # saved locally
