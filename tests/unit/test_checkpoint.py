"""finetune.checkpoint: atomic checkpoints through a real Accelerator, `latest`, rotation, resolving
load_checkpoint_path."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import load_file

from finetune.checkpoint import (
    CHECKSUMS_FILE,
    STATE_FILE,
    checksums,
    describe_checkpoints,
    find_checkpoint,
    list_checkpoints,
    load_train_state,
    read_latest,
    rotate,
    save_checkpoint,
    verify,
)
from finetune.engine.extra_state import save_extra
from finetune.errors import FinetuneError, WriteError


@pytest.fixture
def trained(fresh_accelerator_state):
    """A prepared model + optimizer with optimizer state, on a fresh CPU accelerator."""
    acc = Accelerator(cpu=True, mixed_precision="no")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return acc, model, optimizer


def _save(acc, out, step, limit=None):
    return save_checkpoint(
        acc, out, step, {"state": {"step": step}}, f"train:\n  step: {step}\n", total_limit=limit
    )


def test_save_writes_state_recipe_and_latest(tmp_path, trained):
    acc, model, _ = trained
    path = _save(acc, tmp_path, 3)
    assert path == tmp_path / "checkpoints" / "step-3"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-3\n"
    assert load_train_state(path) == {"state": {"step": 3}}
    assert (path / "recipe.resolved.yaml").read_text() == "train:\n  step: 3\n"
    weights = load_file(path / "model.safetensors")
    torch.testing.assert_close(weights["weight"], model.weight.detach())
    assert (path / "optimizer.bin").is_file()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


def test_saved_state_loads_back(tmp_path, trained):
    acc, model, optimizer = trained
    path = _save(acc, tmp_path, 1)
    saved_weight = model.weight.detach().clone()
    saved_moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    acc.load_state(str(path))
    torch.testing.assert_close(model.weight.detach(), saved_weight)
    torch.testing.assert_close(optimizer.state_dict()["state"][0]["exp_avg"], saved_moment)


def test_total_limit_keeps_the_newest(tmp_path, trained):
    acc, _, _ = trained
    for step in (2, 4, 6, 8, 10):
        _save(acc, tmp_path, step, limit=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-10", "step-8"]
    assert (root / "latest").read_text().strip() == "step-10"


def test_a_crashed_save_leaves_nothing_resume_would_pick(tmp_path, trained):
    acc, _, _ = trained
    _save(acc, tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-2").mkdir()  # killed while saving step 2
    (root / ".tmp-step-2" / "model.safetensors").write_text("partial")
    assert find_checkpoint("auto", tmp_path) == root / "step-1"
    path = _save(acc, tmp_path, 2)  # the next save of that step replaces the leftover
    assert not (root / ".tmp-step-2").exists() and (path / STATE_FILE).is_file()


def _fake(root, step, complete=True):
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    if complete:
        (folder / STATE_FILE).write_text(json.dumps({"state": {"step": step}}))
        (folder / CHECKSUMS_FILE).write_text(json.dumps(checksums(folder)))
    return folder


def test_list_checkpoints_sorts_numerically_and_skips_incomplete(tmp_path):
    for step in (9, 10, 2):
        _fake(tmp_path, step)
    _fake(tmp_path, 11, complete=False)
    (tmp_path / ".tmp-step-12").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2", "step-9", "step-10"]


def test_rotate_never_deletes_the_one_latest_names(tmp_path):
    for step in (2, 4, 6):
        _fake(tmp_path, step)
    (tmp_path / "latest").write_text("step-2\n")  # e.g. resumed from an older checkpoint
    rotate(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2", "step-6"]


def test_find_checkpoint(tmp_path):
    assert find_checkpoint(None, tmp_path) is None
    assert find_checkpoint("auto", tmp_path) is None  # nothing yet: start fresh
    root = tmp_path / "checkpoints"
    _fake(root, 4)
    newest = _fake(root, 8)
    assert find_checkpoint("auto", tmp_path) == newest  # no `latest` file: newest complete one
    (root / "latest").write_text("step-4\n")
    assert find_checkpoint("auto", tmp_path) == root / "step-4"
    (root / "latest").write_text("step-99\n")  # names something gone: fall back
    assert find_checkpoint("auto", tmp_path) == newest
    assert find_checkpoint(str(root / "step-4"), tmp_path) == root / "step-4"
    _fake(root, 12, complete=False)
    with pytest.raises(FinetuneError, match=r"step-12 cannot be resumed: .*train_state\.json is missing"):
        find_checkpoint(str(root / "step-12"), tmp_path)


def test_saved_checkpoints_record_every_file_and_verify(tmp_path, trained):
    """checksums.json records exactly the files in the folder (accelerate's, ours, the extra state)."""
    acc, _, _ = trained
    extra = {"ema": torch.nn.Linear(2, 2)}
    path = save_checkpoint(
        acc,
        tmp_path,
        5,
        {"state": {}},
        "train: {}\n",
        total_limit=None,
        write_extra=lambda f: save_extra(extra, f),
    )
    record = json.loads((path / CHECKSUMS_FILE).read_text())
    on_disk = {
        (Path(folder) / name).relative_to(path).as_posix()
        for folder, _, names in os.walk(path)
        for name in names
    }
    assert set(record) == on_disk - {CHECKSUMS_FILE}
    assert {
        "model.safetensors",
        "optimizer.bin",
        STATE_FILE,
        "recipe.resolved.yaml",
        "extra_state.json",
    } <= on_disk
    assert all(entry["size"] == (path / name).stat().st_size for name, entry in record.items())
    assert find_checkpoint(str(path), tmp_path) == path


# The exceptions the writers raise on a full disk (taken from a 1 MiB tmpfs): torch.save's carries no
# errno, safetensors' is not an OSError.
TORCH_DISK_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
SAFETENSORS_DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _torch_save_fails(monkeypatch):
    def full(*args, **kwargs):
        raise RuntimeError(TORCH_DISK_FULL)

    monkeypatch.setattr(torch, "save", full)


def _safetensors_save_fails(monkeypatch):
    import safetensors.torch

    def full(*args, **kwargs):
        raise SafetensorError(SAFETENSORS_DISK_FULL)

    monkeypatch.setattr(safetensors.torch, "save_file", full)


def _open_fails(monkeypatch):
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == STATE_FILE:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)


@pytest.mark.parametrize(
    "fail, reason",
    [
        (_torch_save_fails, "the write failed ([enforce fail at inline_container.cc"),
        (_safetensors_save_fails, "no space left on the device"),
        (_open_fails, "no space left on the device"),
    ],
    ids=["torch.save", "safetensors", "OSError"],
)
def test_a_full_disk_is_a_clear_error_that_keeps_the_last_checkpoint(
    tmp_path, trained, monkeypatch, fail, reason
):
    acc, _, _ = trained
    extra = {"ema": torch.nn.Linear(2, 2)}
    _save(acc, tmp_path, 1)
    root = tmp_path / "checkpoints"
    fail(monkeypatch)
    with pytest.raises(WriteError) as caught:
        save_checkpoint(
            acc,
            tmp_path,
            2,
            {"state": {}},
            "x: 1\n",
            total_limit=None,
            write_extra=lambda f: save_extra(extra, f),
        )
    message = str(caught.value)
    assert f"writing checkpoint {root / 'step-2'}: {reason}" in message
    assert "MiB free on that disk" in message and "choose another train.output_dir" in message
    assert f"checkpoints already in {root} are intact" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]  # no .tmp-step-2 left
    assert read_latest(root) == "step-1" and verify(root / "step-1") is None


def test_another_failure_while_saving_is_raised_as_it_is_and_leaves_no_partial_folder(tmp_path, trained):
    acc, _, _ = trained

    def broken(folder):
        raise RuntimeError("a bug in the extra state")

    with pytest.raises(RuntimeError, match="a bug in the extra state"):
        save_checkpoint(acc, tmp_path, 3, {"state": {}}, "x: 1\n", total_limit=None, write_extra=broken)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "bytes, 16,384 were written (truncated"),
        (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]), "checksum"),
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["truncated", "bit-flip", "missing"],
)
def test_auto_skips_a_damaged_newest_checkpoint_and_says_why(tmp_path, damage, reason):
    root = tmp_path / "checkpoints"
    older = _fake(root, 4)
    newest = _fake(root, 8)
    (root / "latest").write_text("step-8\n")
    damage(newest / "model.safetensors")
    said = []
    assert find_checkpoint("auto", tmp_path, say=said.append) == older
    assert len(said) == 1 and said[0].startswith(f"warning: resume: skipping {newest}") and reason in said[0]
    with pytest.raises(FinetuneError, match=f"{newest}.*model.safetensors"):
        find_checkpoint(str(newest), tmp_path)


def test_pointer_problems_are_said(tmp_path):
    root = tmp_path / "checkpoints"
    newest = _fake(root, 3)
    said = []
    (root / "latest").write_bytes(b"\x00\xff\xfegarbage")
    assert find_checkpoint("auto", tmp_path, say=said.append) == newest
    (root / "latest").write_text("step-7\n")
    assert find_checkpoint("auto", tmp_path, say=said.append) == newest
    assert "does not name a checkpoint" in said[0] and "names step-7, which does not exist" in said[1]


def test_when_nothing_verifies_auto_starts_fresh_and_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 2, complete=False)
    unverifiable = _fake(root, 4)
    (unverifiable / CHECKSUMS_FILE).unlink()  # e.g. written by an older version
    said = []
    assert find_checkpoint("auto", tmp_path, say=said.append) is None
    assert "cannot be verified" in said[0] and "train_state.json is missing" in said[1]
    assert said[-1] == f"warning: resume: no checkpoint in {root} verifies; starting fresh from step 0"


def test_describe_lists_every_checkpoint_and_the_one_auto_picks(tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 2)
    good = _fake(root, 5)
    bad = _fake(root, 9)
    (bad / "model.safetensors").write_bytes(b"cut")
    rows = describe_checkpoints(tmp_path)
    assert [(r["step"], r["auto"], r["problem"] is None) for r in rows] == [
        (2, False, True),
        (5, True, True),
        (9, False, False),
    ]
    assert rows[1]["path"] == str(good) and rows[0]["bytes"] > 16_000


# ----------------------------------------------------------------------------- RNG states, no pickle


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_states_are_saved_without_pickle_and_restored_exactly(tmp_path):
    from finetune.checkpoint import load_rng_state, save_rng_state

    (tmp_path / "random_states_0.pkl").write_bytes(b"accelerate's pickle")
    save_rng_state(tmp_path, 0)
    assert not (tmp_path / "random_states_0.pkl").exists()  # accelerate's pickle is not kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rng_state_0.json", "rng_state_0.safetensors"]
    want = _draws()
    _draws()  # move every generator on
    load_rng_state(tmp_path, 0)
    assert _draws() == want


@pytest.mark.parametrize("damage", ["truncated-json", "wrong-shape", "wrong-dtype", "short-key", "missing"])
def test_a_damaged_rng_state_stops_the_resume_with_the_file_named(tmp_path, damage):
    from safetensors.torch import load_file, save_file

    from finetune.checkpoint import load_rng_state, save_rng_state
    from finetune.errors import FinetuneError

    save_rng_state(tmp_path, 0)
    json_file, tensors_file = tmp_path / "rng_state_0.json", tmp_path / "rng_state_0.safetensors"
    tensors = load_file(str(tensors_file))
    if damage == "truncated-json":
        json_file.write_text(json_file.read_text()[:40])
    elif damage == "wrong-shape":
        save_file({**tensors, "torch": tensors["torch"][:100].contiguous()}, str(tensors_file))
    elif damage == "wrong-dtype":
        save_file({**tensors, "torch": tensors["torch"].float()}, str(tensors_file))
    elif damage == "short-key":
        save_file({**tensors, "numpy_key": tensors["numpy_key"][:10].contiguous()}, str(tensors_file))
    else:
        json_file.unlink()
        tensors_file.unlink()
    from finetune.checkpoint import capture_rng, restore_rng

    now = capture_rng()
    expected = _draws()
    restore_rng(now, "now")
    with pytest.raises(FinetuneError, match=r"rng_state_0|no rng_state_0\.json for process 0"):
        load_rng_state(tmp_path, 0)
    assert _draws() == expected  # nothing was half-restored: every generator is where it was


def test_a_checkpoint_with_only_accelerates_pickle_warns(tmp_path, capsys):
    from finetune.checkpoint import load_rng_state

    (tmp_path / "random_states_0.pkl").write_bytes(b"older finetune")
    load_rng_state(tmp_path, 0)
    assert "may not repeat the interrupted one exactly" in capsys.readouterr().err
