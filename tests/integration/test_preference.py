"""Preference tuning through the real CLI on the tiny demo model (recipes/demo/tiny_dpo_cpu.yaml):

- prepare-dataset, then train DPO with LoRA: rewards and eval_ metrics in progress.jsonl (the
  baseline at step 0 has zero rewards: the reference is the policy before any update), the adapter,
  tokenizer and model card saved;
- KTO trains (KL reference point, desirable / undesirable rewards);
- DDP on 2 gloo processes follows the same loss curve as one process with the same global batch of
  pairs, and its checkpoint resumes exactly; a run killed with SIGKILL resumes to the same losses;
- full fine-tuning: precomputed reference log-probs give the losses of the frozen reference copy,
  and a resumed run loads them from the cache and continues exactly.

One-process runs go through the CLI's main in this process (tests/inprocess.py); DDP and the killed
run are real processes (slow tier).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._run import REPO, cli_here, kill_once_saved, progress, run, short_run, step_losses

slow = pytest.mark.slow  # real processes: DDP, or killed

DPO_DEMO = REPO / "recipes" / "demo" / "tiny_dpo_cpu.yaml"


def finetune(
    command: str, out: Path, prepared: Path, *args: str, process: bool = False
) -> subprocess.CompletedProcess:
    """`finetune COMMAND` on the DPO demo: in a subprocess for a 2-process launch (--accelerate-config) or
    with `process`, else in this process."""
    cmd = [command, str(DPO_DEMO), *short_run(*args)]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    if process or "--accelerate-config" in args:
        result = run([sys.executable, "-m", "finetune.cli", *cmd])
    else:
        result = cli_here(*cmd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def records(out: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) of a run's progress.jsonl."""
    rows = progress(out)
    return [r for r in rows if r.get("event") is None], [r for r in rows if r.get("event") == "eval"]


def close(a: dict[int, float], b: dict[int, float], tol: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol * max(1.0, abs(a[k])) for k in a)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prepared")


def test_dpo_prepares_trains_evaluates_and_saves(tmp_path, prepared):
    out = tmp_path / "dpo"
    made = finetune("prepare-dataset", out, prepared)
    assert "pairs ->" in made.stdout and "(packed, multipack)" in made.stdout
    trained = finetune("train", out, prepared, "--train.max_steps", "4", "--train.eval_steps", "2")
    assert "reusing prepared dataset" in trained.stdout + trained.stderr
    steps, evals = records(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [e["step"] for e in evals] == [0, 2, 4]
    baseline = evals[0]
    assert baseline["eval_rewards/chosen"] == baseline["eval_rewards/margins"] == 0.0
    assert baseline["eval_loss"] == pytest.approx(0.693147, abs=1e-6) and baseline["eval_pairs"] == 30
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
    ):
        assert all(key in r for r in steps) and f"eval_{key}" in evals[-1], key
    assert all(r["pairs"] > 0 and r["pairs_per_sec"] > 0 and r["tokens_per_sec"] > 0 for r in steps)
    assert evals[-1]["eval_rewards/chosen"] != 0.0  # the policy moved away from the reference
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert "| objective | dpo |" in card and "eval_rewards/accuracies" in card

    # finetune eval scores the held-out pairs as training does: the base is step 0, the adapter the end.
    shown = finetune("eval", out, prepared, "--adapter", str(out), "--no-progress")
    results = json.loads((out / "eval.json").read_text())["results"]
    assert_same_metrics(results["base"]["preference"], baseline)
    assert_same_metrics(results["tuned"]["preference"], evals[-1])
    assert 0.0 <= results["tuned"]["preference"]["eval_preferred"] <= 1.0
    table = shown.stdout
    assert "eval_rewards/accuracies" in table and "held-out pairs" in table and "tuned" in table


def assert_same_metrics(scored: dict, logged: dict) -> None:
    """`finetune eval`'s metrics equal the eval_ record training logged (LoRA merged for eval: 1e-5)."""
    keys = [k for k in logged if k.startswith("eval_")]
    assert keys and set(keys) <= set(scored), sorted(set(keys) - set(scored))
    for key in keys:
        assert scored[key] == pytest.approx(logged[key], rel=1e-4, abs=1e-5), key


def test_kto_trains_with_its_kl_reference_point(tmp_path, prepared):
    out = tmp_path / "kto"
    kto = ["--train.objective", "kto", "--data.datasets.0.type", "kto", "--data.datasets.0.path"]
    kto += ["recipes/demo/data/kto.jsonl", "--train.max_steps", "3", "--train.eval_on_start", "false"]
    result = finetune("train", out, prepared, *kto)
    assert "examples ->" in result.stdout
    steps, evals = records(out)
    assert len(steps) == 3 and [e["step"] for e in evals] == [3]
    for key in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "examples_per_sec"):
        assert all(key in r for r in steps), key
    assert {"eval_kl", "eval_rewards/margins", "eval_examples"} <= set(evals[0])
    assert "rewards/accuracies" not in steps[0]  # unpaired: no accuracy
    # finetune eval gives the same KTO metrics (per-batch KL reference point included).
    finetune("eval", out, prepared, *kto, "--adapter", str(out), "--no-progress", "--no-base")
    results = json.loads((out / "eval.json").read_text())["results"]
    assert set(results) == {"base", "tuned"}  # the base is kto's reference: scored even with --no-base
    assert_same_metrics(results["tuned"]["preference"], evals[-1])


@slow
def test_two_process_ddp_matches_one_process_and_resumes_exactly(tmp_path, prepared):
    steps = ["--train.max_steps", "4", "--train.gradient_accumulation_steps", "2", "--train.save_steps", "2"]
    steps += ["--train.eval_steps", "null", "--train.eval_on_start", "false"]
    steps += ["--train.save_hf_weights", "false"]
    # 2 processes x 1 packed row x accumulation 2 == 1 process x 2 rows x accumulation 2: the same pairs.
    ddp = tmp_path / "ddp"
    finetune(
        "train", ddp, prepared, "--accelerate-config", "multi_cpu", *steps, "--train.micro_batch_size", "1"
    )
    single = tmp_path / "single"
    finetune("train", single, prepared, *steps, "--train.micro_batch_size", "2")
    ddp_steps, single_steps = records(ddp)[0], records(single)[0]
    assert [r["pairs"] for r in ddp_steps] == [r["pairs"] for r in single_steps]
    ddp_losses, single_losses = step_losses(progress(ddp)), step_losses(progress(single))
    assert sorted(ddp_losses) == [1, 2, 3, 4]
    assert close(ddp_losses, single_losses, 1e-4), (ddp_losses, single_losses)
    for a, b in zip(ddp_steps, single_steps, strict=True):
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-3, abs=1e-5)

    resumed = tmp_path / "resumed"
    checkpoint = ddp / "checkpoints" / "step-2"
    args = ["--accelerate-config", "multi_cpu", *steps, "--train.micro_batch_size", "1"]
    finetune("train", resumed, prepared, *args, "--train.load_checkpoint_path", str(checkpoint))
    again = step_losses(progress(resumed))
    assert sorted(again) == [3, 4] and close(again, {k: ddp_losses[k] for k in (3, 4)}, 1e-6), (
        again,
        ddp_losses,
    )


def test_full_fine_tuning_with_precomputed_reference_resumes_exactly(tmp_path, prepared):
    full = ["--lora.enable_lora", "false", "--lora.modules_to_save", "[]", "--train.lr", "1e-3"]
    full += ["--train.max_steps", "4", "--train.save_steps", "2", "--train.eval_steps", "null"]
    full += ["--train.eval_on_start", "false", "--train.save_hf_weights", "false"]
    copy = tmp_path / "copy"
    finetune("train", copy, prepared, *full)
    cached = tmp_path / "cached"
    first = finetune("train", cached, prepared, *full, "--train.precompute_ref_log_probs", "true")
    assert "reference log-probs: computing them for train, eval" in first.stdout
    losses = step_losses(progress(cached))
    # The frozen copy and the precomputed table hold the same reference: the same run.
    assert close(losses, step_losses(progress(copy)), 1e-5), (losses, step_losses(progress(copy)))
    assert list((prepared / "reference_logps").glob("*.safetensors"))

    resumed = tmp_path / "resumed"
    args = [*full, "--train.precompute_ref_log_probs", "true"]
    again = finetune(
        "train",
        resumed,
        prepared,
        *args,
        "--train.load_checkpoint_path",
        str(cached / "checkpoints" / "step-2"),
    )
    assert "reference log-probs: loaded from" in again.stdout
    assert step_losses(progress(resumed)) == {k: losses[k] for k in (3, 4)}


@slow
def test_sigkill_then_resume_gives_the_same_losses_and_rewards(tmp_path, prepared):
    """DPO with LoRA dropout on (the RNG state matters), killed with SIGKILL once the step-4 checkpoint
    exists, then resumed with `auto`: every step's loss and reward margin equal the uninterrupted run's."""
    steps = ["--train.max_steps", "8", "--train.save_steps", "2", "--train.eval_on_start", "false"]
    steps += ["--train.save_hf_weights", "false", "--lora.lora_dropout", "0.1"]
    steps += ["--train.micro_batch_size", "1"]
    reference = tmp_path / "reference"
    finetune("train", reference, prepared, *steps)
    expected = {r["step"]: r for r in records(reference)[0]}
    assert sorted(expected) == list(range(1, 9))

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(DPO_DEMO), *short_run(*steps)]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    kill_once_saved(cmd, out, 4)
    killed_at = max(step_losses(progress(out)))
    assert 4 <= killed_at < 8, f"killed after step {killed_at}: the run should have been mid-way"

    # A process, as after a real crash: the killed run's training process outlives `finetune train` by up to
    # its supervisor poll, holding the output_dir's lock until then.
    resumed = finetune("train", out, prepared, *steps, "--train.load_checkpoint_path", "auto", process=True)
    assert "resumed from" in resumed.stdout + resumed.stderr
    after = {r["step"]: r for r in records(out)[0]}
    assert sorted(after) == list(range(1, 9))  # each step once: the log was cut back to the checkpoint
    for step, want in expected.items():
        assert after[step]["loss"] == pytest.approx(want["loss"], abs=1e-6), step
        assert after[step]["rewards/margins"] == pytest.approx(want["rewards/margins"], abs=1e-6), step
