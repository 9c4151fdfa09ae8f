"""data.streaming through the real CLI: a run on local jsonl shards (with bad rows, skipped and
counted in progress.jsonl) killed with SIGKILL after a checkpoint and resumed gives the same losses
and reads the same rows as the run never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration._run import REPO, assert_quiet, env, progress, run, short_run, step_losses

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "demo" / "tiny_sft_stream_cpu.yaml"
STEPS = 12


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """150 demo rows in three jsonl shards, two of them bad (an output that is not text)."""
    folder = tmp_path_factory.mktemp("stream_shards")
    rows = [
        json.loads(line) for line in (REPO / "recipes/demo/data/arithmetic.jsonl").read_text().splitlines()
    ]
    rows = rows[:150]
    rows[7]["output"], rows[120]["output"] = 5, ["not", "text"]
    for k in range(3):
        with open(folder / f"part-{k}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k * 50 : (k + 1) * 50])
    return folder


def command(out: Path, shards: Path, *, cli: bool = True) -> list[str]:
    """The run through `finetune train` (cli) or the training script itself (no launcher: faster)."""
    entry = (
        [sys.executable, "-m", "finetune.cli", "train"]
        if cli
        else [sys.executable, str(REPO / "finetune" / "train.py")]
    )
    return [
        *entry, str(RECIPE),
        *short_run("--lora.lora_dropout", "0.1"),  # dropout: the RNG state must resume too
        "--data.datasets", f"[{{path: {shards}, type: alpaca}}]", "--data.on_bad_row", "skip",
        "--data.stream_buffer_size", "32", "--train.max_steps", str(STEPS), "--train.save_steps", "4",
        "--train.micro_batch_size", "2", "--train.gradient_accumulation_steps", "2",
        "--train.save_hf_weights", "false", "--train.output_dir", str(out),
    ]  # fmt: skip


def last_record(out: Path) -> dict:
    return [r for r in progress(out) if r.get("step") == STEPS and r.get("event") is None][-1]


def test_streaming_run_killed_and_resumed_reads_and_trains_the_same(tmp_path, shards):
    # The reference (through the CLI) and the run to kill (the training script) run side by side.
    out = tmp_path / "kill"
    proc = subprocess.Popen(
        command(out, shards, cli=False), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    ref = subprocess.Popen(
        command(tmp_path / "ref", shards), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if latest.is_file() and latest.read_text().strip() == "step-8":
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ref_output, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, ref_output[-6000:]
    assert_quiet(ref_output)
    killed_at = max(step_losses(progress(out)))
    assert 8 <= killed_at < STEPS, "the run ended before it could be killed"

    ref_losses = step_losses(progress(tmp_path / "ref"))
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    final = last_record(tmp_path / "ref")
    # 12 steps x 4 rows of 512 tokens is several passes over the 148 good rows: the stream started over,
    # and the 2 bad rows were skipped and counted in every pass.
    assert final["stream_pass"] >= 1
    assert final["stream_dropped"] == {"bad_row:wrong_type": final["stream_rows_dropped"]}
    assert final["stream_rows_dropped"] >= 2 * final["stream_pass"]
    assert final["stream_rows_in"] == final["stream_rows_kept"] + final["stream_rows_dropped"]
    assert 0.9 < final["stream_packing_efficiency"] <= 1.0

    resumed = run([*command(out, shards, cli=False), "--train.load_checkpoint_path", "auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step-8'}" in resumed.stdout + resumed.stderr
    after = step_losses(progress(out))
    for step in range(1, STEPS + 1):
        assert after[step] == pytest.approx(ref_losses[step], abs=1e-6), step
    counts = (
        "stream_rows_in",
        "stream_rows_kept",
        "stream_dropped",
        "stream_pass",
        "stream_packing_efficiency",
    )
    assert {k: last_record(out)[k] for k in counts} == {k: final[k] for k in counts}
