"""The tiny vision-language demo (recipes/demo/tiny_vlm_cpu.yaml) through `accelerate launch finetune/train.py`:
it trains, saves a model that loads with its processor, and uses the pixels: on the held-out rows, the loss
with the right images is clearly below the loss with the images shuffled across rows."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from finetune.data.vision import collate_vlm
from finetune.losses.causal_lm import token_loss_sums
from tests.integration._run import REPO, accelerate_cmd, progress, run

pytestmark = pytest.mark.slow
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_cpu.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-demo")
    overrides = (
        "--train.output_dir",
        str(root / "out"),
        "--data.dataset_prepared_path",
        str(root / "prepared"),
    )
    result = run(accelerate_cmd(RECIPE, *overrides, "--train.eval_steps", "90", "--train.log_steps", "30"))
    assert result.returncode == 0, result.stderr[-4000:]
    return root


def eval_loss(model, processor, rows) -> float:
    total, count = 0.0, 0
    for start in range(0, len(rows), 16):
        batch = collate_vlm(
            rows[start : start + 16], pad_token_id=3, pad_to_multiple_of=8, processor=processor
        )
        with torch.no_grad():
            sums, counts = token_loss_sums(model, batch)
        total, count = total + float(sums.sum()), count + int(counts.sum())
    return total / count


def test_the_model_uses_the_pixels(trained):
    out = trained / "out"
    model = AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)  # saved with the model
    split = datasets.load_from_disk(next((trained / "prepared").glob("*/eval")))
    rows = [split[i] for i in range(len(split))]
    right = eval_loss(model, processor, rows)
    # The run's own final eval_loss is the same computation on the same rows.
    final = [r for r in progress(out) if r.get("event") == "eval"][-1]["eval_loss"]
    assert right == pytest.approx(final, rel=1e-4)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = eval_loss(
        model, processor, [{**r, "images": rows[k]["images"]} for r, k in zip(rows, order, strict=False)]
    )
    assert right < 0.7 * shuffled, (right, shuffled)


def test_prepared_rows_and_outputs(trained):
    manifest = json.loads(next((trained / "prepared").glob("*/manifest.json")).read_text())
    assert manifest["rows_in"] == 540 and manifest["rows_dropped"] == 0
    assert manifest["splits"]["train"]["packed"] is False  # images are never packed
    assert manifest["fingerprint_inputs"]["datasets"][0]["images"]  # the image files are hashed
    split = datasets.load_from_disk(next((trained / "prepared").glob("*/train")))
    assert len(split[0]["images"]) == 1
    for name in ("model.safetensors", "processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (trained / "out" / name).is_file(), name
