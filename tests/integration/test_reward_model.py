"""A reward model through the real CLI on the tiny demo (recipes/demo/tiny_reward_cpu.yaml):

- full fine-tuning logs the held-out pair accuracy at the start and the end; the saved folder loads with
  transformers' AutoModelForSequenceClassification alone and scores a text as finetune scores it;
  `finetune eval --model` gives the run's last held-out figures;
- LoRA on a pretrained causal LM: the adapter loads with PEFT's AutoPeftModelForSequenceClassification;
  `finetune eval --adapter` scores the base with the new score head the run started from (its figures are
  the run's step-0 figures, exactly) beside the tuned model;
- 2-process DDP gives one process's losses with the same global batch of pairs;
- a run killed with SIGKILL resumes with `auto` to the same losses and accuracies;
- GRPO takes the trained model as a reward (grpo.rewards[].model), logged under its folder's name; a
  reward model that is not there stops the run at its start with the recipe path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration._run import REPO, kill_once_saved, progress, run, short_run

pytestmark = pytest.mark.slow

DEMO = REPO / "recipes" / "demo" / "tiny_reward_cpu.yaml"
GRPO_DEMO = REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml"


def command(name: str, out: Path, prepared: Path, *args: str, recipe: Path = DEMO) -> list[str]:
    cmd = [sys.executable, "-m", "finetune.cli", name, str(recipe), *short_run(*args)]
    return [*cmd, "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]


def finetune(
    name: str, out: Path, prepared: Path, *args: str, recipe: Path = DEMO
) -> subprocess.CompletedProcess:
    result = run(command(name, out, prepared, *args, recipe=recipe))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def steps_of(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in progress(out) if r.get("event") is None and "loss" in r}


def evals_of(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in progress(out) if r.get("event") == "eval"}


def evaluate(out: Path, *args: str) -> dict:
    report = out / "eval.json"
    result = run([sys.executable, "-m", "finetune.cli", "eval", str(DEMO), *args, "--output", str(report)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "eval_accuracy" in result.stdout and "score head" in result.stdout
    return json.loads(report.read_text())["results"]


def finetune_score(folder: Path, prompt: str, completion: str) -> float:
    """The reward finetune gives (prompt, completion) with the model in `folder` (grpo's reward path)."""
    from finetune.generation.reward_model import reward_model_reward

    fn = reward_model_reward(str(folder), batch_size=2, device="cpu", prompt_fields=("prompt",), where="test")
    return fn([completion], [{"prompt": prompt}])[0]


PROMPT, COMPLETION = "Compute 12 * 6.", "12 * 6 = 72."


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prepared")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, prepared) -> Path:
    out = tmp_path_factory.mktemp("runs") / "rm"
    result = finetune("train", out, prepared, "--train.max_steps", "12", "--train.eval_steps", "12")
    assert "LOAD REPORT" not in result.stdout + result.stderr  # the new score head is expected
    return out


def test_full_fine_tuning_evaluates_saves_and_loads_with_transformers(full_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.generation.reward_model import reward_text_ids

    steps, evals = steps_of(full_run), evals_of(full_run)
    assert sorted(steps) == list(range(1, 13)) and sorted(evals) == [0, 12]
    for key in (
        "loss",
        "accuracy",
        "margin",
        "rewards/chosen",
        "rewards/rejected",
        "pairs",
        "tokens_per_sec",
    ):
        assert key in steps[12], key
    assert evals[0]["eval_pairs"] == evals[12]["eval_pairs"] == 60
    model = AutoModelForSequenceClassification.from_pretrained(full_run).eval()
    tokenizer = AutoTokenizer.from_pretrained(full_run)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert "pipeline_tag: text-classification" in (full_run / "README.md").read_text()
    ids = reward_text_ids(tokenizer, PROMPT, COMPLETION)
    with torch.no_grad():
        hf = model(
            **tokenizer(tokenizer.decode(ids), add_special_tokens=False, return_tensors="pt")
        ).logits.item()
    assert finetune_score(full_run, PROMPT, COMPLETION) == pytest.approx(hf, abs=1e-5)
    results = evaluate(full_run, "--model", str(full_run), "--no-base")
    tuned = results["tuned"]["reward"]
    assert tuned["score_head"] == "trained" and tuned["eval_pairs"] == 60
    for key in ("eval_loss", "eval_accuracy", "eval_margin"):
        assert tuned[key] == pytest.approx(evals[12][key], abs=1e-5), key


def test_lora_on_a_pretrained_base_and_the_base_scored_with_its_first_head(tmp_path, prepared):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    base = tmp_path / "base"  # a "pretrained" causal LM: no score head
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=704, bos_token_id=1, eos_token_id=2, pad_token_id=3)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer").save_pretrained(base)
    out = tmp_path / "lora"
    lora = ["--model.config_path", "null", "--model.model_path", str(base), "--model.tokenizer_path", "null",
            "--lora.enable_lora", "true", "--lora.lora_rank", "8", "--train.max_steps", "6", "--train.eval_steps", "6"]  # fmt: skip
    trained = finetune("train", out, prepared, *lora)
    assert "LOAD REPORT" not in trained.stdout + trained.stderr  # a causal LM's head unused, a score head new
    evals = evals_of(out)
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    # The base's config is a causal LM's: one label is said when loading, as for any classifier adapter.
    model = AutoPeftModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": COMPLETION}],
            tokenize=False,
        )
        peft_score = model(**tokenizer(text, return_tensors="pt")).logits.item()
    assert finetune_score(out, PROMPT, COMPLETION) == pytest.approx(peft_score, abs=1e-5)
    recipe = [*lora, "--data.dataset_prepared_path", str(prepared)]
    report = out / "eval.json"
    result = run([sys.executable, "-m", "finetune.cli", "eval", str(DEMO), *recipe, "--adapter", str(out),
                  "--output", str(report)])  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(report.read_text())["results"]
    assert results["base"]["reward"]["score_head"] == "new, train.seed 42"
    assert results["tuned"]["reward"]["score_head"] == "trained"
    for name, step in (("base", 0), ("tuned", 6)):
        for key in ("eval_loss", "eval_accuracy", "eval_rewards/chosen"):
            assert results[name]["reward"][key] == pytest.approx(evals[step][key], abs=1e-5), (name, key)


def test_two_process_ddp_matches_one_process(tmp_path, prepared):
    """2 gloo processes x 1 packed row x accumulation 2 == 1 process x 2 rows x accumulation 2 (the same
    pairs): the same losses and accuracies every step (the score head is read inside DDP's forward, so its
    gradients are averaged too), and the held-out figures gathered from both processes."""
    steps = ["--train.max_steps", "4", "--train.gradient_accumulation_steps", "2", "--train.eval_steps", "4",
             "--train.eval_on_start", "false", "--train.save_hf_weights", "false"]  # fmt: skip
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    finetune(
        "train", ddp, prepared, "--accelerate-config", "multi_cpu", *steps, "--train.micro_batch_size", "1"
    )
    finetune("train", single, prepared, *steps, "--train.micro_batch_size", "2")
    a, b = steps_of(ddp), steps_of(single)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step]["pairs"] == b[step]["pairs"]
        for key in ("loss", "accuracy", "margin"):
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-4, abs=1e-5), (step, key)
    for key in ("eval_loss", "eval_accuracy", "eval_pairs"):
        assert evals_of(ddp)[4][key] == pytest.approx(evals_of(single)[4][key], rel=1e-4, abs=1e-5), key


def test_sigkill_then_resume_gives_the_same_losses_and_accuracies(tmp_path, prepared):
    """LoRA with dropout (the RNG state matters), killed with SIGKILL once the step-4 checkpoint exists,
    then resumed with `auto`: every step's loss, accuracy and margin equal the uninterrupted run's."""
    steps = ["--train.max_steps", "8", "--train.save_steps", "2", "--train.eval_on_start", "false",
             "--train.save_hf_weights", "false", "--lora.enable_lora", "true", "--lora.lora_dropout", "0.1",
             "--train.micro_batch_size", "1"]  # fmt: skip
    reference = tmp_path / "reference"
    finetune("train", reference, prepared, *steps)
    expected = steps_of(reference)
    assert sorted(expected) == list(range(1, 9))

    out = tmp_path / "killed"
    kill_once_saved(command("train", out, prepared, *steps), out, 4)
    killed_at = max(steps_of(out))
    assert 4 <= killed_at < 8, f"killed after step {killed_at}: the run should have been mid-way"

    resumed = finetune("train", out, prepared, *steps, "--train.load_checkpoint_path", "auto")
    assert "resumed from" in resumed.stdout + resumed.stderr
    after = steps_of(out)
    assert sorted(after) == list(range(1, 9))
    for step, want in expected.items():
        for key in ("loss", "accuracy", "margin"):
            assert after[step][key] == pytest.approx(want[key], abs=1e-6), (step, key)


def test_grpo_takes_the_trained_model_as_a_reward(tmp_path, full_run):
    out, prepared = tmp_path / "grpo", tmp_path / "grpo-prepared"
    rewards = f"[{{model: '{full_run}', batch_size: 4, weight: 0.5}}, {{name: exact_match, field_expected: answer}}]"
    args = ["--grpo.rewards", rewards, "--train.max_steps", "2", "--train.eval_steps", "2"]
    finetune("train", out, prepared, *args, recipe=GRPO_DEMO)
    name = full_run.name
    steps = steps_of(out)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert f"reward/{name}" in record
        assert record["reward"] == pytest.approx(
            0.5 * record[f"reward/{name}"] + record["reward/exact_match"], abs=1e-5
        )
    assert f"eval_reward/{name}" in evals_of(out)[2]
    missing = run(command("train", tmp_path / "bad", prepared, "--grpo.rewards", "[{model: outputs/no-such-rm}]",
                          "--train.max_steps", "1", recipe=GRPO_DEMO))  # fmt: skip
    assert missing.returncode == 2
    assert "grpo.rewards.0.model: no reward model loads from 'outputs/no-such-rm'" in missing.stderr
    assert "train.objective reward" in missing.stderr and "Traceback" not in missing.stderr
