"""Helpers for integration tests: run the real CLI / training script in subprocesses (run, cli: the slow
tier), or in this process (cli_here, train_here, train_into: tests/inprocess.py, no launcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo" / "tiny_sft_cpu.yaml"


def env() -> dict:
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "2")
    out["PYTHONUNBUFFERED"] = "1"
    out["ACCELERATE_USE_CPU"] = "true"
    return out


def accelerate_cmd(recipe: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--dynamo_backend",
        "no",
        "--mixed_precision",
        "no",
        str(REPO / "finetune" / "train.py"),
        str(recipe),
        *overrides,
    ]


# Third-party notices finetune keeps out of what a run prints (finetune/quiet.py, issue 13's "quiet,
# useful output"): every run through run() or cli() is checked for them.
THIRD_PARTY_NOISE = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes' optional Hub kernel
    "requires torchvision (not installed)",  # transformers' image-processor fallback
    "`is_gradient_checkpointing` is deprecated",  # transformers 5, read by PEFT
    "Setting accelerator to CPU",  # DeepSpeed's device detection
    "values were not passed",  # accelerate launch's defaults notice
)


def assert_quiet(output: str) -> None:
    """No third-party notice from THIRD_PARTY_NOISE in `output`."""
    found = [line for line in output.splitlines() if any(noise in line for noise in THIRD_PARTY_NOISE)]
    assert not found, "third-party noise in the output:\n" + "\n".join(found[:5])


def run(
    cmd: list[str],
    timeout: int = 600,
    *,
    unset: tuple[str, ...] = (),
    quiet: bool = True,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run in the repository root with env(), minus the variables named in `unset`, plus `extra_env`;
    the output of a finetune command must be free of the third-party notices it silences
    (assert_quiet; `quiet=False` for a test's own script, which is not a finetune entry point)."""
    variables = {k: v for k, v in env().items() if k not in unset} | (extra_env or {})
    result = subprocess.run(cmd, cwd=REPO, env=variables, capture_output=True, text=True, timeout=timeout)
    if quiet:
        assert_quiet(result.stdout + result.stderr)
    return result


def progress(output_dir: Path) -> list[dict]:
    path = output_dir / "progress.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_losses(records: list[dict]) -> dict[int, float]:
    """Loss per optimizer step (the last record wins: a resumed run appends)."""
    return {r["step"]: r["loss"] for r in records if r.get("event") is None and r.get("loss") is not None}


def step_grad_norms(records: list[dict]) -> dict[int, float]:
    """Gradient norm (before clipping) per optimizer step (the last record wins: a resumed run appends)."""
    return {
        r["step"]: r["grad_norm"] for r in records if r.get("event") is None and r.get("loss") is not None
    }


def short_run(*extra: str) -> list[str]:
    """Overrides for short test runs of the demo: a log line every step, evaluation only at the end,
    checkpoints only at save_steps and all kept, no LoRA dropout; `extra` overrides come last."""
    return [
        "--train.log_format", "structured", "--train.log_steps", "1", "--train.eval_steps", "null",
        "--train.save_epochs", "0", "--train.save_total_limit", "null", "--lora.lora_dropout", "0.0", *extra,
    ]  # fmt: skip


def demo_overrides(tmp: Path, *extra: str) -> list[str]:
    """The demo recipe writing into a temporary folder."""
    return [
        "--train.output_dir",
        str(tmp / "out"),
        "--data.dataset_prepared_path",
        str(tmp / "prepared"),
        *extra,
    ]


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`finetune ARGS` (python -m finetune.cli) in a subprocess, from the repository root."""
    return run([sys.executable, "-m", "finetune.cli", *args], timeout=timeout)


def cli_here(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """`finetune ARGS` through finetune.cli.main in this process (tests/inprocess.py; `finetune train` trains
    here, in one process); its output must be free of the notices finetune silences, as cli()'s."""
    from tests.inprocess import finetune

    result = finetune(*args, input=input)
    assert_quiet(result.stdout + result.stderr)
    return result


def train_here(recipe: Path, *overrides: str) -> subprocess.CompletedProcess:
    """finetune/train.py RECIPE OVERRIDES (what `accelerate launch` runs on one process) in this process
    (tests/inprocess.py); its output must be free of the notices finetune silences, as run()'s."""
    from tests.inprocess import train

    result = train(recipe, *overrides)
    assert_quiet(result.stdout + result.stderr)
    return result


def train_into(recipe: Path, root: Path, *overrides: str, out: str = "out") -> subprocess.CompletedProcess:
    """finetune/train.py RECIPE in this process (train_here) writing into root / out, with its prepared data
    in root / "prepared" (shared by a test module's runs); it must succeed."""
    prepared = ("--data.dataset_prepared_path", str(root / "prepared"))
    result = train_here(recipe, "--train.output_dir", str(root / out), *prepared, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def assert_resumes_exactly(
    recipe: Path, root: Path, *overrides: str, steps: int, resume_at: int
) -> subprocess.CompletedProcess:
    """Resume the run in root / "out" (steps 1..steps logged) from its checkpoint at step `resume_at` into
    root / "resumed": it logs steps resume_at + 1..steps, each with the first run's loss (to 1e-6)."""
    first = step_losses(progress(root / "out"))
    assert sorted(first) == list(range(1, steps + 1))
    checkpoint = root / "out" / "checkpoints" / f"step-{resume_at}"
    resumed = train_into(
        recipe, root, "--train.load_checkpoint_path", str(checkpoint), *overrides, out="resumed"
    )
    again = step_losses(progress(root / "resumed"))
    assert sorted(again) == list(range(resume_at + 1, steps + 1))
    for step in again:
        assert again[step] == pytest.approx(first[step], abs=1e-6), step
    return resumed


def ddp_and_single(recipe: Path, root: Path, micro_batch_size: int, *overrides: str) -> None:
    """`finetune train RECIPE` on the prepared data in root / "prepared": on 2 gloo DDP processes
    (--accelerate-config multi_cpu: torchrun) at `micro_batch_size` into root / "ddp", and on one process
    at twice that (the same global batches; in this process, cli_here) into root / "single"; both must
    succeed."""
    prepared = ("--data.dataset_prepared_path", str(root / "prepared"))
    for name, launch, size in (("ddp", ("--accelerate-config", "multi_cpu"), micro_batch_size),
                               ("single", (), 2 * micro_batch_size)):  # fmt: skip
        args = ("train", str(recipe), *prepared, *overrides, *launch, "--train.micro_batch_size", str(size),
                "--train.output_dir", str(root / name))  # fmt: skip
        result = cli(*args, timeout=600) if launch else cli_here(*args)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def kill_once_saved(cmd: list[str], output_dir: Path, step: int, *, timeout: float = 300) -> None:
    """Run `cmd` (a training into `output_dir`) in its own session and SIGKILL its whole process group
    once checkpoint step-`step` is the latest (or the run ended, or `timeout` seconds passed), as a crash
    would end it."""
    import signal
    import time

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    latest = output_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if latest.is_file() and latest.read_text().strip() == f"step-{step}":
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
