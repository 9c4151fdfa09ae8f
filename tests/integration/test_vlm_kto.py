"""KTO of the tiny vision-language demo (recipes/demo/tiny_vlm_kto_cpu.yaml) through `finetune train`:
labelled examples whose prompt holds a picture (image parts in training, LLaVA style `<image>` and an images
column held out), desirable when the answer is the picture's colour. The held-out reward margin (desirable
minus undesirable) rises from 0 and the loss falls; the saved adapter loads and uses the pixels (its margin
with the right pictures beats the same examples with the pictures shuffled across examples); `finetune eval
--adapter` scores base and tuned on the held-out examples with the run's own numbers."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import yaml

from finetune.data.batching.vision import collate_vlm_kto, with_kl_rows
from finetune.model.inference import load_vlm_for_inference
from finetune.objectives.preference_eval import score_batches, summarize
from finetune.recipe import validate_recipe
from tests.integration._run import REPO, progress
from tests.integration._run import cli_here as cli  # in this process (tests/inprocess.py)

pytestmark = pytest.mark.slow  # long: an epoch of the VLM demo
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_kto_cpu.yaml"
STEPS = 30  # 480 examples / 16 a step; the test trains one epoch (the demo two)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-kto")
    result = cli(
        "train", str(RECIPE),
        "--train.output_dir", str(root / "out"), "--data.dataset_prepared_path", str(root / "prepared"),
        "--train.num_train_epochs", "1", "--train.save_epochs", "1", "--train.log_steps", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "alone in their packed row" not in result.stderr  # unpacked rows take their KL rows from the split
    return root


def evals(root) -> list[dict]:
    return [r for r in progress(root / "out") if r.get("event") == "eval"]


def test_held_out_reward_margin_rises_and_loss_falls(trained):
    first, *_, last = evals(trained)
    assert first["step"] == 0 and last["step"] == STEPS
    # The policy is its reference: every reward 0, z0 0, each example's loss 1 - sigmoid(0).
    assert first["eval_loss"] == pytest.approx(0.5, abs=1e-6) and first["eval_kl"] == pytest.approx(
        0, abs=1e-6
    )
    assert first["eval_rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert last["eval_rewards/margins"] > 0.1 and last["eval_rewards/chosen"] > 0, last
    assert last["eval_loss"] < first["eval_loss"] - 0.01 and last["eval_examples"] == 60
    assert last["eval_kl"] >= 0
    manifest = json.loads(next((trained / "prepared").glob("*/manifest.json")).read_text())
    assert manifest["kind"] == "kto" and manifest["rows_dropped"] == 0
    assert manifest["splits"]["train"]["packed"] is False  # rows with images are never packed


def test_the_saved_adapter_loads_and_uses_the_pixels(trained):
    """Rewards of the tuned adapter against its base (adapters disabled) on the held-out examples: with
    their own pictures, the run's final eval figures; with the pictures shuffled across examples, the
    margin between desirable and undesirable answers falls."""
    recipe = validate_recipe(yaml.safe_load(RECIPE.read_text()))
    tuned, processor = load_vlm_for_inference(str(trained / "out"))
    base, _ = load_vlm_for_inference(str(trained / "out" / "base_model"))
    split = with_kl_rows(datasets.load_from_disk(next((trained / "prepared").glob("*/eval"))), max_len=64)
    rows = [{**split[i], "row_index": i} for i in range(len(split))]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = [{**row, "images": rows[k]["images"]} for row, k in zip(rows, order, strict=True)]

    def margins(examples) -> dict:
        batches = [
            collate_vlm_kto(examples[i : i + 16], pad_token_id=3, pad_to_multiple_of=8, processor=processor)
            for i in range(0, len(examples), 16)
        ]
        scores = {
            name: score_batches(model, batches, name="kto", settings=recipe.preference, device="cpu")
            for name, model in (("base", base), ("tuned", tuned))
        }
        return summarize(scores["tuned"], scores["base"], name="kto", settings=recipe.preference)

    right, wrong = margins(rows), margins(shuffled)
    last = evals(trained)[-1]
    for key in ("eval_loss", "eval_rewards/margins", "eval_kl"):
        assert right[key] == pytest.approx(last[key], rel=1e-4, abs=1e-6), key
    assert right["eval_rewards/margins"] > wrong["eval_rewards/margins"] + 0.1, (right, wrong)


def test_eval_scores_base_and_tuned_on_the_held_out_examples(trained):
    report = trained / "eval.json"
    result = cli("eval", str(RECIPE), "--adapter", str(trained / "out"), "--no-progress", "--output", str(report),
                 "--data.dataset_prepared_path", str(trained / "prepared"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    first, *_, last = evals(trained)
    for model, logged in (("base", first), ("tuned", last)):
        figures = results[model]["preference"]
        for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_kl"):
            assert figures[key] == pytest.approx(logged[key], rel=1e-4, abs=1e-6), (model, key)
