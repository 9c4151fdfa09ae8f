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
OUTCOMES = ("clear error", "counted drop", "clean load", "recovered", "traceback", "unexpected")
TIMEOUT_S = 300


@dataclass
class Trial:
    """One command on one damaged input, and what a good ending looks like."""

    kind: str  # the family of trials ("data")
    name: str
    command: list[str]
    cwd: Path
    expect: str  # one of OUTCOMES[:4]
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
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if proc.returncode == 2 and len(errors) == 1:
        note = errors[0].removeprefix("error: ")
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
TRAIN_STEPS = 12
TRAIN_ARGS = [
    "--train.max_steps", str(TRAIN_STEPS), "--train.save_steps", "2", "--train.save_total_limit", "null",
    "--train.save_epochs", "0", "--train.log_steps", "1", "--train.eval_steps", "null", "--train.log_format",
    "structured", "--train.save_hf_weights", "false", "--lora.lora_dropout", "0.1",
    "--train.micro_batch_size", "2",
]  # fmt: skip


def _train_command(folder: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "finetune" / "train.py"), str(DEMO), *TRAIN_ARGS,
        "--train.output_dir", str(folder / "out"), "--data.dataset_prepared_path", str(folder.parent / "prepared"),
        # The demo recipe's paths are relative to the repository; trials run in folders of their own.
        "--model.tokenizer_path", str(REPO_ROOT / "recipes" / "demo" / "tokenizer"),
        "--data.datasets.0.path", str(REPO_ROOT / "recipes" / "demo" / "data" / "arithmetic.jsonl"),
        *extra,
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


def _reference(root: Path) -> dict[int, float]:
    """One uninterrupted run: the losses every resumed trial must reproduce."""
    folder = root / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    subprocess.run(_train_command(folder), env=env, check=True, capture_output=True, timeout=TIMEOUT_S)
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


def _damage(out: Path, how: str) -> tuple[str, str]:
    """Damage the newest checkpoint (step-12); return (what a clear message must name, checkpoint)."""
    ckpt = out / "checkpoints" / f"step-{TRAIN_STEPS}"
    files = {
        "truncated weights": "trainable_0.safetensors", "bit-flipped optimizer state": "optimizer.bin",
        "missing RNG state": "random_states_0.pkl", "missing scheduler state": "scheduler.bin",
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


def sigkill_trials(root: Path, count: int = 20, seed: int = 0) -> list[Trial]:
    """SIGKILL a training run at a random moment (not only after a checkpoint), then resume with
    `auto`: every step's loss must equal the uninterrupted run's."""
    import random

    reference = _reference(root / "sigkill")
    rng = random.Random(seed)
    trials = []
    for k in range(count):
        folder = root / "sigkill" / f"trial-{k:02d}"
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
        ]
        classify = _classify_resume(reference)
        trials.append(
            Trial(
                "sigkill",
                f"kill after step {max(1, int(kill_after * TRAIN_STEPS))} + {delay:.0%} of a step",
                command,
                folder,
                "recovered",
                classify=classify,
            )
        )
    return trials


def sigkill_child(folder: Path, at: float, delay: float) -> int:
    """Start the run, SIGKILL its process group `delay` (a fraction of the mean step time so far) after
    `at` of the steps are logged (any moment: mid-step, mid-checkpoint), then resume it to the end; the
    parent compares the losses."""
    import signal

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    target = max(1, int(at * TRAIN_STEPS))
    proc = subprocess.Popen(
        _train_command(folder),
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
        _train_command(folder, "--train.load_checkpoint_path", "auto"),
        env=env,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(resumed.stdout)
    sys.stderr.write(resumed.stderr)
    return resumed.returncode


# Trial kinds: name -> function building the trials under a root folder.
KINDS: dict[str, Callable[[Path], list[Trial]]] = {
    "data": data_trials,
    "checkpoint": checkpoint_trials,
    "sigkill": sigkill_trials,
}


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
  equal the uninterrupted run's (1e-6), and the progress log must hold each step once."""


def write_results(text: str, command: str, seconds: float) -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    section = (
        f"{SECTION_START}\n## Fault trials\n\n`{command}` ({machine}; {seconds:.0f} s). Damaged inputs through "
        f"the real CLI; the traceback column must be 0.\n\n{KINDS_TEXT}\n\n{text}\n{SECTION_END}"
    )
    current = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "# Benchmark results\n"
    if SECTION_START in current and SECTION_END in current:
        head, rest = current.split(SECTION_START, 1)
        current = head + section + rest.split(SECTION_END, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(current, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument(
        "--only", nargs="+", default=[], help="run only trials whose name contains one of these"
    )
    parser.add_argument("--jobs", type=int, default=2, help="trials run at once (each is one CLI process)")
    parser.add_argument("--keep", type=Path, help="build the trials in this folder and keep it")
    parser.add_argument("--write-results", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--sigkill-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sigkill_child:
        return sigkill_child(args.sigkill_child, args.at, args.delay)

    root = args.keep or Path(tempfile.mkdtemp(prefix="finetune-fault-trials-"))
    start = time.perf_counter()
    try:
        trials = [t for kind in args.kinds for t in KINDS[kind](root)]
        if args.only:
            trials = [t for t in trials if any(o.lower() in t.name.lower() for o in args.only)]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(run_trial, trials))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - start
    text = report(results)
    print(text)
    if args.write_results:
        command = "python benchmarks/fault_trials.py" + (f" --kinds {' '.join(args.kinds)}" if argv else "")
        write_results(text, command, seconds)
    bad = [r for r in results if r.outcome != r.trial.expect]
    print(f"\n{len(results)} trials in {seconds:.0f} s; {len(bad)} not as expected", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
