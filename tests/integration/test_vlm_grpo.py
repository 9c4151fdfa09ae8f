"""GRPO of the tiny vision-language demo (recipes/demo/tiny_vlm_grpo_cpu.yaml) through finetune/train.py: prompts
whose picture is in the prompt (LLaVA style in training, image parts held out), a reward function of the recipe's
folder scoring how close the answer comes to naming the picture's colour. The run (60 of the demo's 120 steps)
logs its rewards every step, its held-out reward rises from the start, and it saves the adapter; resumed from a
checkpoint (into another output_dir), or killed with SIGKILL and resumed with `auto`, it samples the same
completions and gets the same rewards and losses step for step; `finetune eval --adapter` gives the run's first and last held-out rewards for base and tuned."""

from __future__ import annotations

import json

import pytest

from tests.integration._run import REPO, assert_resumes_exactly, progress, train_into
from tests.integration._run import cli_here as cli  # in this process (tests/inprocess.py)

pytestmark = pytest.mark.slow  # 60 steps of generation and training (half a minute on 2 idle cores)
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_grpo_cpu.yaml"
STEPS, RESUME_AT = 60, 50  # half the demo's steps
LOGS = ("--train.max_steps", str(STEPS), "--train.eval_steps", str(STEPS), "--train.log_steps", "1",
        "--train.save_steps", str(RESUME_AT), "--train.save_total_limit", "null",
        "--lora.lora_dropout", "0.0")  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-grpo")
    train_into(RECIPE, root, *LOGS)
    return root


def steps(root, name: str = "out") -> dict[int, dict]:
    return {
        r["step"]: r for r in progress(root / name) if r.get("event") is None and r.get("loss") is not None
    }


def evals(root, name: str = "out") -> list[dict]:
    return [r for r in progress(root / name) if r.get("event") == "eval"]


def test_the_run_logs_rewards_and_its_held_out_reward_rises(trained):
    manifest = json.loads(next((trained / "prepared").glob("*/manifest.json")).read_text())
    assert manifest["kind"] == "prompt" and manifest["rows_dropped"] == 0
    logged = steps(trained)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for record in logged.values():
        assert record["reward"] == pytest.approx(record["reward/colour_named"])
        assert 0.0 <= record["reward"] <= 1.0 and record["completions_sample"]
        assert record["kl"] >= 0 and record["completion_length"] <= 2
    first, *_, last = evals(trained)
    assert first["step"] == 0 and last["step"] == STEPS and last["eval_prompts"] == 60
    # Measured: 0.13 at step 0, 0.46 at step 60 (benchmarks/RESULTS.md, "GRPO on images").
    assert last["eval_reward"] >= first["eval_reward"] + 0.2, (first, last)
    early = sum(logged[s]["reward"] for s in range(1, 21)) / 20
    late = sum(logged[s]["reward"] for s in range(STEPS - 19, STEPS + 1)) / 20
    # training rewards of sampled answers: 0.16 -> 0.24 with the two-race sampler's draws (0.1+ with
    # torch.multinomial's); the held-out rise above is the learning check
    assert late >= early + 0.05, (early, late)
    assert (trained / "out" / "adapter_model.safetensors").is_file()


def test_resume_from_a_checkpoint_samples_the_same_completions(trained):
    assert_resumes_exactly(
        RECIPE, trained, *LOGS, "--train.eval_on_start", "false", steps=STEPS, resume_at=RESUME_AT
    )
    first, again = steps(trained), steps(trained, "resumed")
    for step in range(RESUME_AT + 1, STEPS + 1):
        assert again[step]["reward"] == pytest.approx(first[step]["reward"], abs=1e-6), step
        assert [s["completion"] for s in again[step]["completions_sample"]] == [
            s["completion"] for s in first[step]["completions_sample"]
        ], step


def test_eval_scores_base_and_tuned_on_the_held_out_prompts_with_their_pictures(trained):
    """`finetune eval --adapter`: greedy completions of the held-out prompts (image parts) by the base and the
    tuned model, scored by the recipe's reward: the run's own first and last held-out rewards."""
    report = trained / "eval.json"
    result = cli("eval", str(RECIPE), "--adapter", str(trained / "out"), "--no-progress", "--output", str(report),
                 "--data.dataset_prepared_path", str(trained / "prepared"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    first, *_, last = evals(trained)
    for model, logged in (("base", first), ("tuned", last)):
        figures = results[model]["rewards"]
        assert figures["eval_reward"] == pytest.approx(logged["eval_reward"], abs=1e-6), model


def test_a_run_killed_with_sigkill_resumes_to_the_same_completions(trained, tmp_path):
    """A run of the first steps killed with SIGKILL once its step-4 checkpoint is the latest (a real process, as
    after a crash), resumed with `auto`: each step's completions, rewards and loss are those of the uninterrupted
    run (the module's: constant learning rate, no warmup, so its first 8 steps are these 8 steps')."""
    import sys

    from tests.integration._run import kill_once_saved, run

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(RECIPE), *LOGS, "--train.max_steps", "8",
           "--train.save_steps", "4", "--train.eval_steps", "null", "--train.output_dir", str(out),
           "--data.dataset_prepared_path", str(trained / "prepared")]  # fmt: skip
    kill_once_saved(cmd, out, 4)
    killed_at = max(steps(tmp_path, "killed"), default=0)
    assert 4 <= killed_at < 8, f"killed after step {killed_at}: the run should have been mid-way"
    resumed = run([*cmd, "--train.load_checkpoint_path", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    after, expected = steps(tmp_path, "killed"), steps(trained)
    assert sorted(after) == list(range(1, 9))
    for step in after:
        assert after[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6), step
        assert after[step]["reward"] == pytest.approx(expected[step]["reward"], abs=1e-6), step
        assert [s["completion"] for s in after[step]["completions_sample"]] == [
            s["completion"] for s in expected[step]["completions_sample"]
        ], step
