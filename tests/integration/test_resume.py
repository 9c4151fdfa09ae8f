"""Exact resume after SIGKILL, and a clean checkpoint-and-exit on SIGTERM (DESIGN.md invariants)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration._run import DEMO, REPO, accelerate_cmd, demo_overrides, env, progress, run, step_losses

pytestmark = pytest.mark.slow

STEPS = 16
COMMON = (
    "--train.max_steps",
    str(STEPS),
    "--train.log_steps",
    "1",
    "--train.save_steps",
    "4",
    "--train.save_epochs",
    "0",
    "--train.log_format",
    "structured",
    "--train.eval_steps",
    "null",
    "--train.save_hf_weights",
    "false",
    "--lora.lora_dropout",
    "0.1",
    "--train.micro_batch_size",
    "2",
    "--train.gradient_accumulation_steps",
    "2",
)


def _wait_for(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def test_sigkill_then_resume_gives_the_same_losses(tmp_path):
    # Uninterrupted reference run.
    ref = run(accelerate_cmd(DEMO, *demo_overrides(tmp_path / "ref", *COMMON)))
    assert ref.returncode == 0, ref.stderr[-4000:]
    ref_losses = step_losses(progress(tmp_path / "ref" / "out"))
    assert sorted(ref_losses) == list(range(1, STEPS + 1))

    # Same run, killed with SIGKILL once a checkpoint exists, then resumed with `auto`.
    out = tmp_path / "kill" / "out"
    cmd = accelerate_cmd(DEMO, *demo_overrides(tmp_path / "kill", *COMMON))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    latest = out / "checkpoints" / "latest"
    reached = _wait_for(lambda: latest.is_file() and latest.read_text().strip() == "step-8", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert reached, "the run ended before it could be killed"
    killed_at = max(step_losses(progress(out)))
    k = int(latest.read_text().strip()[5:])
    assert 8 <= k <= killed_at < STEPS

    resumed = run([*cmd, "--train.load_checkpoint_path", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{k}'}" in resumed.stdout + resumed.stderr
    after = step_losses(progress(out))  # the resumed run appends; later records win
    for step in range(1, STEPS + 1):
        assert after[step] == pytest.approx(ref_losses[step], abs=1e-6), step


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "finetune" / "train.py"),
        str(DEMO),
        *demo_overrides(
            tmp_path,
            "--train.log_steps",
            "1",
            "--train.max_steps",
            "100000",
            "--train.save_steps",
            "0",
            "--train.save_epochs",
            "0",
            "--train.log_format",
            "structured",
        ),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert _wait_for(lambda: len(step_losses(progress(out))) >= 3, proc), "training did not start"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "stopping: received SIGTERM" in output
    latest = (out / "checkpoints" / "latest").read_text().strip()
    step = int(latest[5:])
    assert step == max(step_losses(progress(out)))
    assert (out / "checkpoints" / latest / "train_state.json").is_file()
