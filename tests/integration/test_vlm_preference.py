"""DPO of the tiny vision-language demo (recipes/demo/tiny_vlm_dpo_cpu.yaml) through `accelerate launch
finetune/train.py`: pairs whose prompt holds a picture (image parts in training, LLaVA style `<image>` and an
images column held out). The held-out reward accuracy and margin rise from the start; the saved adapter
loads and uses the pixels (its reward accuracy with the right pictures beats the same pairs with the pictures
shuffled across pairs); a checkpoint resumes to the same losses; `finetune eval --adapter` scores base and
tuned on the held-out pairs with the run's own numbers; 2-process DDP gives the losses and rewards of one
process."""

from __future__ import annotations

import json

import datasets
import pytest
import yaml

from finetune.data.batching.vision import collate_vlm_pairs
from finetune.model.inference import load_vlm_for_inference
from finetune.objectives.preference_eval import score_batches, summarize
from finetune.recipe import validate_recipe
from tests.integration._run import REPO, assert_resumes_exactly, ddp_and_single, progress, train_into
from tests.integration._run import cli_here as cli  # in this process (tests/inprocess.py)
from tests.vlm_processors import shuffled_images

pytestmark = pytest.mark.slow
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_dpo_cpu.yaml"
STEPS, RESUME_AT = 30, 25  # 480 pairs / 16 a step = 30 steps an epoch; the test trains one (the demo two)
SHORT = ("--train.num_train_epochs", "1", "--train.save_epochs", "1", "--train.log_steps", "1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-dpo")
    train_into(RECIPE, root, "--train.save_steps", str(RESUME_AT), "--train.save_total_limit", "null", *SHORT)
    return root


def evals(root, name: str = "out") -> list[dict]:
    """The eval records of the run in root / name."""
    return [r for r in progress(root / name) if r.get("event") == "eval"]


def steps(root, name: str) -> list[dict]:
    """The step records (loss, rewards, log-probs) of the run in root / name."""
    return [r for r in progress(root / name) if r.get("event") is None and r.get("loss") is not None]


def test_held_out_reward_accuracy_and_margin_rise(trained):
    first, *_, last = evals(trained)
    assert first["step"] == 0 and last["step"] == STEPS
    assert first["eval_loss"] == pytest.approx(0.693147, abs=1e-5)  # the policy is its reference
    assert last["eval_rewards/accuracies"] >= 0.8 and last["eval_rewards/margins"] > 0.3, last
    assert last["eval_loss"] < first["eval_loss"] - 0.1 and last["eval_pairs"] == 60
    manifest = json.loads(next((trained / "prepared").glob("*/manifest.json")).read_text())
    assert manifest["kind"] == "preference" and manifest["rows_dropped"] == 0
    assert manifest["splits"]["train"]["packed"] is False  # rows with images are never packed


def test_the_saved_adapter_loads_and_uses_the_pixels(trained):
    """Rewards of the tuned adapter against its base (the reference: the adapters disabled) on the held-out
    pairs: with their own pictures, the run's final eval figures; with the pictures shuffled across pairs,
    the accuracy falls toward chance."""
    recipe = validate_recipe(yaml.safe_load(RECIPE.read_text()))
    tuned, processor = load_vlm_for_inference(str(trained / "out"))
    base, _ = load_vlm_for_inference(str(trained / "out" / "base_model"))
    split = datasets.load_from_disk(next((trained / "prepared").glob("*/eval")))
    rows = [{**split[i], "row_index": i} for i in range(len(split))]
    shuffled = shuffled_images(rows)

    def accuracy(pairs) -> dict:
        batches = [
            collate_vlm_pairs(pairs[i : i + 16], pad_token_id=3, pad_to_multiple_of=8, processor=processor)
            for i in range(0, len(pairs), 16)
        ]
        scores = {
            name: score_batches(model, batches, name="dpo", settings=recipe.preference, device="cpu")
            for name, model in (("base", base), ("tuned", tuned))
        }
        return summarize(scores["tuned"], scores["base"], name="dpo", settings=recipe.preference)

    right, wrong = accuracy(rows), accuracy(shuffled)
    last = evals(trained)[-1]
    assert right["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-4)
    assert right["eval_rewards/accuracies"] == pytest.approx(last["eval_rewards/accuracies"])
    assert right["eval_rewards/accuracies"] >= wrong["eval_rewards/accuracies"] + 0.25, (right, wrong)
    assert right["eval_rewards/margins"] > wrong["eval_rewards/margins"] + 0.2, (right, wrong)


def test_resume_from_a_checkpoint_gives_the_same_losses(trained):
    assert_resumes_exactly(
        RECIPE, trained, "--train.eval_on_start", "false", *SHORT, steps=STEPS, resume_at=RESUME_AT
    )


def test_eval_scores_base_and_tuned_on_the_held_out_pairs(trained):
    report = trained / "eval.json"
    result = cli("eval", str(RECIPE), "--adapter", str(trained / "out"), "--no-progress", "--output", str(report),
                 "--data.dataset_prepared_path", str(trained / "prepared"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    first, *_, last = evals(trained)
    for model, logged in (("base", first), ("tuned", last)):
        figures = results[model]["preference"]
        for key in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"):
            assert figures[key] == pytest.approx(logged[key], rel=1e-4, abs=1e-6), (model, key)


def test_two_process_ddp_matches_one_process(trained):
    """DDP on 2 gloo processes (finetune train --accelerate-config multi_cpu: torchrun) of the DPO demo, 8 pairs
    a process against 16 in one process: each process collates its own pairs' pictures, and the policy and
    its reference (the unwrapped model with the adapters disabled) both see them. At step 1 the policy is
    its reference on every pair of both processes (no pair's reward margin above 0, and their mean 0: a
    reference forward without the pixels would score the pairs differently); then the losses, rewards and
    log-probs of each step, and the held-out figures (the eval pairs split between the processes), are one
    process's up to float summation order (rel 1e-5)."""
    ddp_and_single(RECIPE, trained, 8, "--train.max_steps", "2", "--train.log_steps", "1", "--train.eval_steps", "2",
                   "--train.eval_on_start", "false", "--train.save_epochs", "0", "--train.save_hf_weights", "false",
                   "--lora.lora_dropout", "0.0")  # fmt: skip
    for name in ("ddp", "single"):
        first = steps(trained, name)[0]
        assert [r["step"] for r in steps(trained, name)] == [1, 2] and first["pairs"] == 16
        assert [e["step"] for e in evals(trained, name)] == [2]
        assert first["loss"] == pytest.approx(0.693147, abs=1e-6) and first["rewards/accuracies"] == 0.0
        assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-7), first
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    for a, b in zip(steps(trained, "ddp"), steps(trained, "single"), strict=True):
        for key in (*keys, "rewards/accuracies"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key, a[key], b[key])
    (ddp,), (single,) = evals(trained, "ddp"), evals(trained, "single")
    assert ddp["eval_pairs"] == single["eval_pairs"] == 60 and single["eval_rewards/margins"] != 0.0
    for key in ("eval_rewards/accuracies", *(f"eval_{k}" for k in keys)):
        assert ddp[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), (key, ddp[key], single[key])
