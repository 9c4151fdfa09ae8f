"""A reward that hangs never hangs the run (grpo.reward_timeout_s; issue 32, item 7), through the real
CLI on the tiny GRPO demo:

- with a short timeout, the hung reward is stopped each step: a warning names it, the step's
  completions are counted (reward_timeouts) and train no advantage, and the run finishes;
- with a long one, ONE SIGTERM while the reward hangs ends the run cleanly: the pending call stops at
  once, the step ends, a checkpoint of it is written and the run exits 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration._run import REPO, env, progress, run, short_run

pytestmark = pytest.mark.slow

GRPO_DEMO = REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml"
REWARDS_PY = '''
import os, time
from pathlib import Path

def hangs_later(completions, rows):
    """Scores the first step, then hangs (after saying so in a marker file)."""
    calls = Path(os.environ["REWARD_CALLS"])
    with calls.open("a") as f:
        f.write("call\\n")
    if len(calls.read_text().splitlines()) >= 2:
        Path(str(calls) + ".hanging").touch()
        while True:
            time.sleep(0.05)
    return [float(len(c) % 3) for c in completions]
'''


def command(root: Path, out: Path, timeout_s: str, *args: str) -> list[str]:
    rewards = f"[{{function: {root / 'rewards.py'}:hangs_later}}]"
    return [
        sys.executable, "-m", "finetune.cli", "train", str(GRPO_DEMO),
        *short_run("--grpo.rewards", rewards, "--grpo.reward_timeout_s", timeout_s, *args),
        "--train.output_dir", str(out), "--data.dataset_prepared_path", str(root / "prepared"),
    ]  # fmt: skip


@pytest.fixture
def root(tmp_path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    return tmp_path


def test_a_hung_reward_is_stopped_counted_and_named_and_the_run_finishes(root):
    out = root / "out"
    calls = root / "calls"
    result = run(command(root, out, "2", "--train.max_steps", "3"), extra_env={"REWARD_CALLS": str(calls)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    steps = {r["step"]: r for r in progress(out) if r.get("event") is None and "loss" in r}
    assert sorted(steps) == [1, 2, 3]
    assert "reward_timeouts" not in steps[1]
    assert steps[2]["reward_timeouts"] == steps[3]["reward_timeouts"] == 16  # every completion of the step
    said = result.stdout + result.stderr
    assert "warning: reward hangs_later: did not answer within 2 s (grpo.reward_timeout_s" in said
    assert "Traceback" not in said and (out / "adapter_model.safetensors").is_file()


def test_one_sigterm_ends_a_run_whose_reward_hangs_with_a_checkpoint(root):
    out = root / "out"
    calls = root / "calls"
    args = ["--train.max_steps", "1000", "--train.save_steps", "1000"]
    proc = subprocess.Popen(
        command(root, out, "600", *args), cwd=REPO, env={**env(), "REWARD_CALLS": str(calls)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    hanging = Path(str(calls) + ".hanging")
    deadline = time.monotonic() + 300
    while not hanging.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hanging.exists(), "the reward never hung"
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # once
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-4000:]
    assert time.monotonic() - sent < 60  # not the 600 s timeout
    assert "stopping: received SIGTERM" in output and "Traceback" not in output
    assert "warning: reward hangs_later: stopped by the run's stop signal" in output
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-2" and (out / "checkpoints" / latest).is_dir()
    steps = {r["step"]: r for r in progress(out) if r.get("event") is None and "loss" in r}
    assert sorted(steps) == [1, 2] and steps[2]["reward_timeouts"] == 16
