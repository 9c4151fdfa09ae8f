"""Generation sets with images through the CLI, on the tiny vision-language demo (recipes/demo/tiny_vlm_cpu.yaml):
its set of held-out pictures asked "What colour is the shape?" (metric contains) is scored during training
(progress.jsonl, samples naming their images) and by `finetune eval` base vs tuned, where the tuned model
answers clearly better than its random-init base; a set with a missing image is an error naming the file,
row and path before any model loads.

The demo's base is a random-init config, which `finetune eval` cannot load as a base: the fixture saves that
same random init (torch seed = train.seed) as a model folder and trains from it (model.model_path)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Config

from tests.integration._run import REPO, cli, progress

pytestmark = pytest.mark.slow
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_cpu.yaml"
SET = REPO / "recipes" / "demo" / "data" / "vlm" / "colours.jsonl"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(root, the overrides that point the demo at the saved base and the prepared data): the demo trained
    for its 6 epochs (180 steps) from the saved base, evaluated every 60 steps, no checkpoints."""
    root = tmp_path_factory.mktemp("vlm-gensets")
    config = yaml.safe_load(RECIPE.read_text())["model"]["config_path"]
    torch.manual_seed(42)
    AutoModelForImageTextToText.from_config(Idefics3Config(**config)).save_pretrained(root / "base")
    AutoProcessor.from_pretrained(REPO / "recipes" / "demo" / "vlm_processor").save_pretrained(root / "base")
    base = ("--model.model_path", str(root / "base"), "--model.config_path", "null",
            "--data.dataset_prepared_path", str(root / "prepared"))  # fmt: skip
    result = cli("train", str(RECIPE), *base, "--train.output_dir", str(root / "out"), "--train.eval_steps", "60",
                 "--train.save_epochs", "0", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return root, base


def test_training_scores_the_set_with_its_images(run):
    root, _ = run
    evals = [r for r in progress(root / "out") if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [60, 120, 180]
    scores = [r["eval_colours_contains"] for r in evals]
    assert scores[-1] >= 0.5, scores  # the demo learns the colours (0 for the random init)
    rows = [json.loads(line) for line in SET.read_text().splitlines()]
    samples = evals[-1]["eval_colours_samples"]
    assert len(samples) == 3  # the set's num_samples (default 3)
    for sample, row in zip(samples, rows, strict=False):
        assert sample["images"] == [f"recipes/demo/data/vlm/{row['prompt'][0]['content'][0]['image']}"]
        assert sample["expected"] == row["expected"] and sample["correct"] == (
            row["expected"] in sample["output"]
        )


def test_eval_base_vs_tuned_with_images(run):
    root, base = run
    report = root / "eval.json"
    sets = json.dumps([{"name": "colours", "path": str(SET), "metric": "contains", "max_new_tokens": 4,
                        "num_samples": 16}])  # fmt: skip
    result = cli("eval", str(RECIPE), *base, "--model", str(root / "out"), "--no-progress", "--output", str(report),
                 "--eval.generation_sets", sets)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(report.read_text())["results"]
    tuned, untrained = results["tuned"]["generation"]["colours"], results["base"]["generation"]["colours"]
    assert tuned["n"] == untrained["n"] == 16
    assert untrained["score"] <= 0.2 and tuned["score"] >= untrained["score"] + 0.4, (untrained, tuned)
    # The same greedy answers as the run's own last evaluation (its first 3 samples).
    final = [r for r in progress(root / "out") if r.get("event") == "eval"][-1]
    assert [s["output"] for s in tuned["samples"][:3]] == [s["output"] for s in final["eval_colours_samples"]]
    rows = [json.loads(line) for line in SET.read_text().splitlines()]
    for model in ("base", "tuned"):
        samples = results[model]["generation"]["colours"]["samples"]
        assert [s["images"] for s in samples] == [
            [str(SET.parent / r["prompt"][0]["content"][0]["image"])] for r in rows
        ]
    assert results["tuned"]["eval_loss"] < results["base"]["eval_loss"]  # the held-out loss still works
    assert "colours contains (n=16)" in result.stdout and "images: " in result.stdout


def test_a_missing_image_is_an_error_before_any_model_loads(run, tmp_path):
    root, base = run
    rows = SET.read_text().splitlines()
    broken = tmp_path / "colours.jsonl"
    first = rows[0].replace('"images/', f'"{SET.parent}/images/')  # absolute: the copy is elsewhere
    broken.write_text("\n".join([first, rows[1].replace("images/", "gone/")]) + "\n")
    sets = json.dumps([{"name": "colours", "path": str(broken), "metric": "contains"}])
    result = cli("eval", str(RECIPE), *base, "--model", str(root / "out"), "--eval.generation_sets", sets)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: eval.generation_sets[colours]: {broken} row 1:" in result.stderr
    assert (
        "image file 'gone/00481.png' cannot be read" in result.stderr and "loading base" not in result.stderr
    )
