"""GRPO through the real CLI on the tiny demo (recipes/demo/tiny_grpo_cpu.yaml):

- `finetune validate` reports every GRPO problem at once;
- a run logs rewards (total and per function), group spread, completion lengths, clip ratios, the
  rollout time apart from the training time and sampled completions, evaluates its held-out prompts,
  and saves the adapter;
- a run killed with SIGKILL (LoRA dropout, a KL term to the reference, rollouts reused for two
  steps) resumes with `auto` to the same completions, rewards and losses as an uninterrupted run;
- 2-process DDP trains on the same completions and gets the same losses as one process with the
  same global batch of prompts;
- `finetune eval` scores base and tuned on the held-out prompts with the rewards.

One-process runs go through the CLI's main in this process (tests/inprocess.py); DDP and the killed
run are real processes (slow tier).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._run import REPO, cli_here, kill_once_saved, progress, run, short_run

slow = pytest.mark.slow  # real processes: DDP, or killed

GRPO_DEMO = REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml"


def command(name: str, out: Path, prepared: Path, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "finetune.cli", name, str(GRPO_DEMO), *short_run(*args)]
    return [*cmd, "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]


def finetune(
    name: str, out: Path, prepared: Path, *args: str, process: bool = False
) -> subprocess.CompletedProcess:
    """`finetune NAME` on the GRPO demo: in a subprocess for a 2-process launch (--accelerate-config) or with
    `process`, else in this process."""
    cmd = command(name, out, prepared, *args)
    result = run(cmd) if process or "--accelerate-config" in args else cli_here(*cmd[3:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def steps_of(out: Path) -> dict[int, dict]:
    """Each step's record (the last one wins: a resumed run appends)."""
    return {r["step"]: r for r in progress(out) if r.get("event") is None and "loss" in r}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prepared")


def test_validate_reports_every_grpo_problem_at_once(tmp_path):
    bad = [
        "--grpo.num_generations", "3",
        "--grpo.rewards", "[{name: exact_match}, {name: format, pattern: '(unclosed'}, {name: nope}]",
    ]  # fmt: skip
    result = cli_here("validate", str(GRPO_DEMO), *bad)
    assert result.returncode == 2
    err = result.stderr
    assert "grpo.num_generations" in err and "must divide" in err
    assert "grpo.rewards[0].field_expected" in err and "needs it" in err
    assert "grpo.rewards[1].pattern" in err and "not a valid regular expression" in err
    assert "grpo.rewards[2].name" in err and "'exact_match'" in err
    assert "Traceback" not in err
    missing = cli_here("validate", str(GRPO_DEMO), "--grpo", "null")
    assert missing.returncode == 2 and "train.objective grpo needs a grpo section" in missing.stderr


def test_grpo_trains_logs_rewards_evaluates_and_saves(tmp_path, prepared):
    out = tmp_path / "grpo"
    made = finetune("train", out, prepared, "--train.max_steps", "4", "--train.eval_steps", "2")
    assert "prompts ->" in made.stdout
    steps = steps_of(out)
    assert sorted(steps) == [1, 2, 3, 4]
    for record in steps.values():
        for key in ("reward", "reward_std", "reward/digits", "reward/exact_match", "frac_reward_zero_std",
                    "completion_length", "completion_length_max", "clipped_ratio", "clip_ratio/low",
                    "rollout_seconds", "train_seconds", "tokens_per_sec"):  # fmt: skip
            assert key in record, key
        assert record["rollout_seconds"] > 0 and record["train_seconds"] > 0
        assert 0 <= record["frac_reward_zero_std"] <= 1 and record["completion_length_max"] <= 12
        samples = record["completions_sample"]
        assert len(samples) == 2 and {"prompt", "completion", "reward", "reward/digits"} <= set(samples[0])
        assert "What is" in samples[0]["prompt"]
    evals = [r for r in progress(out) if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"eval_reward", "eval_reward/digits", "eval_reward/exact_match", "eval_prompts"} <= set(evals[-1])
    assert evals[-1]["eval_prompts"] == 8
    assert (out / "adapter_model.safetensors").is_file() and (out / "README.md").is_file()
    assert "grpo" in (out / "README.md").read_text()

    result = cli_here("eval", str(GRPO_DEMO), "--adapter", str(out), "--data.dataset_prepared_path", str(prepared),
                      "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out prompts" in result.stdout and "eval_reward/digits" in result.stdout
    table = {
        line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.startswith("eval_")
    }
    assert len(table["eval_reward"]) == 2  # base and tuned side by side
    assert float(table["eval_reward"][1]) == pytest.approx(evals[-1]["eval_reward"], abs=1e-4)


@slow
@pytest.mark.parametrize(
    "variant",
    [[], ["--train.objective", "rloo", "--grpo.loss_type", "rloo", "--grpo.scale_rewards", "none"]],
    ids=["grpo", "rloo"],
)
def test_sigkill_then_resume_gives_the_same_completions_rewards_and_losses(tmp_path, prepared, variant):
    """LoRA dropout (the RNG matters), a KL term to the reference (adapters disabled; RLOO pays it out of
    the reward) and each rollout reused for two steps (the checkpoint at step 3 falls between them), the
    LoRA merged for every generate call (grpo.merged_generation: the weights put back bit for bit):
    killed once step-3 is saved."""
    # 6 steps: rollouts at 1, 3 and 5; killed once step-3 is saved, the resumed run reuses step 3's
    # rollout (step 4) and makes a new one (step 5).
    args = [*variant, "--train.max_steps", "6", "--train.save_steps", "3", "--train.eval_steps", "null"]
    args += ["--lora.lora_dropout", "0.1", "--grpo.beta", "0.04", "--grpo.num_iterations", "2"]
    args += [
        "--train.save_hf_weights",
        "false",
        "--grpo.max_new_tokens",
        "24",
        "--grpo.merged_generation",
        "true",
    ]
    reference = tmp_path / "reference"
    finetune("train", reference, prepared, *args)
    expected = steps_of(reference)
    assert sorted(expected) == list(range(1, 7))
    kl = "reward_kl" if variant else "kl"  # RLOO pays the KL out of the reward at each rollout
    assert all(kl in r for r in expected.values() if "reward" in r)

    out = tmp_path / "killed"
    kill_once_saved(command("train", out, prepared, *args), out, 3)
    killed_at = max(steps_of(out))
    assert 3 <= killed_at < 6, f"killed after step {killed_at}: the run should have been mid-way"

    # A process, as after a real crash: the killed run's training process outlives `finetune train` by up to
    # its supervisor poll, holding the output_dir's lock until then.
    resumed = finetune("train", out, prepared, *args, "--train.load_checkpoint_path", "auto", process=True)
    assert "resumed from" in resumed.stdout + resumed.stderr
    after = steps_of(out)
    assert sorted(after) == list(range(1, 7))
    for step, want in expected.items():
        got = after[step]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
        if "reward" in want:  # a step that rolled out (the reused steps log no new rewards)
            assert got["reward"] == pytest.approx(want["reward"], abs=1e-6), step
            assert [s["completion"] for s in got["completions_sample"]] == [
                s["completion"] for s in want["completions_sample"]
            ], step
    rolled = [s for s, r in expected.items() if "reward" in r]
    assert rolled == [1, 3, 5]  # a new rollout every num_iterations steps


@slow
@pytest.mark.parametrize(
    "variant",
    [["--grpo.loss_type", t] for t in ("grpo", "dr_grpo", "bnpo")]
    + [["--train.objective", "rloo"], ["--train.objective", "reinforce_pp"]],
    ids=["grpo", "dr_grpo", "bnpo", "rloo", "reinforce_pp"],
)
def test_two_process_ddp_trains_on_the_same_completions_as_one_process(tmp_path, prepared, variant):
    """2 processes x 8 completions == 1 process x 8 completions x accumulation 2: the same 4 prompts a
    step, each group on one rank, the loss normalised over the global batch, for every loss type (and
    RLOO's sequence-level loss with its unscaled leave-one-out advantages) and every estimator:
    REINFORCE++-baseline's whitening over every process's tokens, with the demo's dapo loss."""
    args = [
        "--train.max_steps",
        "2",
        "--train.eval_steps",
        "null",
        "--train.save_hf_weights",
        "false",
        *variant,
    ]
    if variant[-1] == "rloo":  # the demo writes GRPO's choices: RLOO's own defaults
        args += ["--grpo.loss_type", "rloo", "--grpo.scale_rewards", "none"]
    if variant[-1] == "reinforce_pp":
        args += ["--grpo.scale_rewards", "batch"]
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    finetune("train", ddp, prepared, "--accelerate-config", "multi_cpu", *args,
             "--train.gradient_accumulation_steps", "1")  # fmt: skip
    finetune("train", single, prepared, *args, "--train.gradient_accumulation_steps", "2")
    two, one = steps_of(ddp), steps_of(single)
    assert sorted(two) == sorted(one) == [1, 2]
    for step in one:
        assert two[step]["reward"] == pytest.approx(one[step]["reward"], abs=1e-6), step
        assert two[step]["completion_length"] == pytest.approx(one[step]["completion_length"]), step
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-6), step
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-6), step


ZERO3_COMMON = ["--lora.enable_lora", "false", "--train.max_steps", "2", "--train.eval_steps", "2",
                "--train.log_steps", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def plain_full_run(tmp_path_factory, prepared) -> Path:
    """The plain (one process, no engine) full fine-tuning run both ZeRO-3 generation modes compare with."""
    plain = tmp_path_factory.mktemp("plain-full") / "out"
    finetune("train", plain, prepared, *ZERO3_COMMON)
    return plain


@slow
@pytest.mark.parametrize("generation", ["gather", "layerwise"])
def test_zero3_generates_from_its_gathered_weights_what_one_process_does(
    tmp_path, prepared, plain_full_run, generation
):
    """GRPO under DeepSpeed ZeRO-3 (one CPU process, full fine-tuning): the rollout and the held-out
    rewards generate from the weights gathered whole (or one layer at a time). ZeRO-3 computes its
    linear layers with its own autograd function, whose float rounding differs from torch's F.linear
    in the last bits, so a sampled token can flip where two are nearly tied: the greedy held-out
    completions and their rewards match a plain run; the sampled ones mostly agree."""
    common = [*ZERO3_COMMON, "--grpo.sharded_generation", generation]
    plain, sharded = plain_full_run, tmp_path / "zero3"
    cmd = command("train", sharded, prepared, *common, "--accelerate-config", "zero3", "--num-processes", "1")
    result = run(cmd, unset=("ACCELERATE_USE_CPU",))  # DeepSpeed picks its CPU accelerator itself
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    a, b = steps_of(plain), steps_of(sharded)
    assert sorted(b) == [1, 2]
    # The training losses are not compared: the demo model is built from a config (random init), and under
    # ZeRO-3 transformers initialises it inside DeepSpeed's zero.Init, partition by partition, so the two runs
    # start from other random weights (the first prompt's first-token distribution: top probability 0.00290
    # at token 479 against 0.00275 at token 63, also at d918f10). Nearly uniform distributions sample mostly
    # the same tokens from the same seeds, but enough flip to move a step's loss beyond any rounding
    # tolerance: a 5% one passed or failed with the sampler's draws.
    for step in (1, 2):
        same_prompts = [x["prompt"] for x in b[step]["completions_sample"]] == [
            x["prompt"] for x in a[step]["completions_sample"]
        ]
        assert same_prompts
    # The same seeds on two nearly uniform distributions: most sampled characters agree, position for position.
    pairs = list(zip(a[1]["completions_sample"], b[1]["completions_sample"], strict=True))
    agree = [sum(p == q for p, q in zip(x["completion"], y["completion"], strict=False)) for x, y in pairs]
    assert sum(agree) >= 0.7 * sum(len(x["completion"]) for x, _ in pairs), pairs
    evals = {
        name: [r for r in progress(out) if r.get("event") == "eval"][-1]
        for name, out in (("a", plain), ("b", sharded))
    }
    for key in ("eval_reward", "eval_completion_length", "eval_prompts"):
        assert evals["b"][key] == pytest.approx(evals["a"][key], abs=1e-6), key


@slow
def test_async_rollouts_resume_exactly_with_the_rollout_made_ahead(tmp_path, prepared):
    """grpo.async_rollouts: the rollout made in the background for step 3 is in step 2's checkpoint, so a
    run resumed from it trains steps 3-4 on the same completions, rewards and losses as the run that went
    on; each step logs how long it waited for the background rollout."""
    args = ["--train.max_steps", "4", "--train.save_steps", "2", "--train.eval_steps", "null",
            "--train.log_steps", "1", "--grpo.async_rollouts", "true", "--lora.lora_dropout", "0.1"]  # fmt: skip
    straight = tmp_path / "straight"
    finetune("train", straight, prepared, *args)
    expected = steps_of(straight)
    assert sorted(expected) == [1, 2, 3, 4] and all("rollout_wait_seconds" in r for r in expected.values())
    resumed = tmp_path / "resumed"
    checkpoint = straight / "checkpoints" / "step-2"
    finetune("train", resumed, prepared, *args, "--train.load_checkpoint_path", str(checkpoint))
    after = steps_of(resumed)
    assert sorted(after) == [3, 4]
    for step in (3, 4):
        assert after[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6), step
        assert after[step]["reward"] == pytest.approx(expected[step]["reward"], abs=1e-6), step
        assert after[step]["completions_sample"] == expected[step]["completions_sample"], step


def test_generation_dtype_samples_in_bfloat16_corrects_the_gap_and_resumes_exactly(tmp_path, prepared):
    """grpo.generation_dtype bfloat16: the rollouts come from a bfloat16 copy of the float32 policy, each
    step logs the sampler/trainer log-prob gap and the importance weights that correct it, and a run
    resumed from its step-2 checkpoint trains steps 3-4 on the same completions and losses."""
    args = ["--train.max_steps", "4", "--train.save_steps", "2", "--train.eval_steps", "null",
            "--train.log_steps", "1", "--grpo.generation_dtype", "bfloat16"]  # fmt: skip
    straight = tmp_path / "straight"
    finetune("train", straight, prepared, *args)
    expected = steps_of(straight)
    assert sorted(expected) == [1, 2, 3, 4]
    for record in expected.values():
        # bfloat16 sampling is not the trainer's float32: a gap, small, and weights around 1
        assert 0 < record["sampling/logp_gap"] < 0.5, record
        assert 0.5 < record["sampling/importance_weight"] < 1.5, record
    plain = tmp_path / "float32"
    finetune("train", plain, prepared, *args[:-2], "--train.max_steps", "1")
    assert "sampling/logp_gap" not in steps_of(plain)[1]  # the training model sampled: nothing to correct
    resumed = tmp_path / "resumed"
    finetune(
        "train",
        resumed,
        prepared,
        *args,
        "--train.load_checkpoint_path",
        str(straight / "checkpoints" / "step-2"),
    )
    after = steps_of(resumed)
    assert sorted(after) == [3, 4]
    for step in (3, 4):
        assert after[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6), step
        assert after[step]["reward"] == pytest.approx(expected[step]["reward"], abs=1e-6), step
        assert after[step]["sampling/logp_gap"] == pytest.approx(
            expected[step]["sampling/logp_gap"], abs=1e-6
        )


def test_generation_dtype_with_qlora_is_refused_at_start(tmp_path, prepared):
    result = cli_here(
        *command("train", tmp_path / "out", prepared, "--lora.enable_qlora", "true",
                 "--grpo.generation_dtype", "bfloat16")[3:]
    )  # fmt: skip
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "grpo.generation_dtype bfloat16: QLoRA's 4-bit base weights cannot be copied" in said, said[-2000:]
    assert "Traceback" not in said


def test_generation_dtype_on_weights_already_in_it_warns_that_it_changes_nothing(tmp_path, prepared):
    """Full fine-tuning of bfloat16 weights with generation_dtype bfloat16: nothing to copy, said once at the
    start; the run trains."""
    result = cli_here(
        *command("train", tmp_path / "out", prepared, "--lora.enable_lora", "false", "--model.torch_dtype", "bf16",
                 "--train.max_steps", "1", "--train.eval_steps", "null", "--grpo.generation_dtype", "bfloat16")[3:]
    )  # fmt: skip
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-2000:]
    assert "warning: grpo.generation_dtype bfloat16: the weights are in bfloat16 already" in said, said[
        -2000:
    ]
    lora = cli_here(
        *command("train", tmp_path / "lora", prepared, "--train.max_steps", "1", "--train.eval_steps", "null",
                 "--grpo.generation_dtype", "bfloat16")[3:]
    )  # fmt: skip
    assert (
        lora.returncode == 0 and "generation_dtype bfloat16: the weights are" not in lora.stdout + lora.stderr
    )
