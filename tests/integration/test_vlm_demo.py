"""The tiny vision-language demo (recipes/demo/tiny_vlm_cpu.yaml) through `accelerate launch finetune/train.py`:
it trains, saves a model that loads with its processor, and uses the pixels: on the held-out rows, the loss
with the right images is clearly below the loss with the images shuffled across rows. Resumed from a
checkpoint in the last epoch (into another output_dir), it gives the same losses step for step;
`finetune chat --image` on the trained model answers with colours from held-out pictures, `finetune eval`
gives the run's held-out loss, and 2-process DDP gives the losses of one process. The demo's generation set
(held-out pictures asked their colour) is scored during training and by `finetune eval` base vs tuned."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch
import yaml
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Config

from finetune.data.batching.vision import collate_vlm
from finetune.losses.causal_lm import token_loss_sums
from tests.integration._run import (
    REPO,
    assert_resumes_exactly,
    ddp_and_single,
    progress,
    step_grad_norms,
    step_losses,
    train_into,
)
from tests.integration._run import cli_here as cli  # in this process (tests/inprocess.py)
from tests.vlm_processors import shuffled_images

pytestmark = pytest.mark.slow
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_cpu.yaml"
COLOURS = REPO / "recipes" / "demo" / "data" / "vlm" / "colours.jsonl"  # the demo's generation set
STEPS, RESUME_AT = 180, 170  # 480 rows / 16 a step = 30 steps an epoch, 6 epochs
CHECKPOINTS_AND_LOGS = ("--train.save_steps", str(RESUME_AT), "--train.save_total_limit", "null",
                        "--train.eval_steps", "90", "--train.log_steps", "1")  # fmt: skip


def from_base(root) -> tuple[str, ...]:
    """The demo pointed at its random init saved under `root` (see `trained`)."""
    return "--model.model_path", str(root / "base"), "--model.config_path", "null"


def base_overrides(root) -> tuple[str, ...]:
    """`from_base` and the run's prepared data (for `finetune eval`)."""
    return *from_base(root), "--data.dataset_prepared_path", str(root / "prepared")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The demo's 180 steps, evaluated at 90 and 180, from its random init (torch seed = train.seed) saved
    as a model folder with the processor: `finetune eval` then has that folder as the base to compare
    against (a config is no loadable base). The DDP test below trains from the recipe's config itself."""
    root = tmp_path_factory.mktemp("vlm-demo")
    recipe = yaml.safe_load(RECIPE.read_text())
    torch.manual_seed(recipe["train"]["seed"])
    model = AutoModelForImageTextToText.from_config(Idefics3Config(**recipe["model"]["config_path"]))
    model.save_pretrained(root / "base")
    AutoProcessor.from_pretrained(REPO / "recipes" / "demo" / "vlm_processor").save_pretrained(root / "base")
    train_into(RECIPE, root, *from_base(root), *CHECKPOINTS_AND_LOGS)
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
    shuffled = eval_loss(model, processor, shuffled_images(rows))
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


def test_resume_in_the_last_epoch_gives_the_same_losses(trained):
    """Exact resume of a VLM run: the checkpoint's position in the epoch (its sampler), model, optimizer
    and RNG states restored, the pixels processed again at collate time as in the first run."""
    resumed = assert_resumes_exactly(
        RECIPE, trained, *from_base(trained), *CHECKPOINTS_AND_LOGS, steps=STEPS, resume_at=RESUME_AT
    )
    checkpoint = trained / "out" / "checkpoints" / f"step-{RESUME_AT}"
    assert f"resumed from {checkpoint}" in resumed.stdout + resumed.stderr


def test_chat_with_an_image_answers_with_a_colour(trained):
    """`finetune chat OUT --image PATH --prompt ...` on the trained model, held-out pictures of different
    colours: each answer is one colour word, ending at the template's end of turn (<end_of_utterance>),
    and the answers differ with the picture. (The tiny demo is not always right: it mixes up purple and
    blue, so which colour it names is not asserted.)"""
    rows = [json.loads(line) for line in (REPO / "recipes/demo/data/vlm/eval.jsonl").read_text().splitlines()]
    colours = {"blue", "green", "orange", "purple", "red", "yellow"}
    answers = []
    for k in (4, 8):  # green, orange
        image = REPO / "recipes/demo/data/vlm" / rows[k]["messages"][0]["content"][0]["image"]
        result = cli("chat", str(trained / "out"), "--image", str(image), "--prompt", "What colour is the shape?",
                     "--max-new-tokens", "6")  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        answers.append(result.stdout.strip())
    assert set(answers) <= colours and answers[0] != answers[1], answers
    missing = cli("chat", str(trained / "out"), "--image", "no/such.png", "--prompt", "Hi")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "error: --image no/such.png:" in missing.stderr and "cannot be read" in missing.stderr


def test_training_scores_the_generation_set_with_its_images(trained):
    """The demo's set (held-out pictures asked their colour, metric contains) scored at each evaluation,
    its samples naming their images."""
    evals = [r for r in progress(trained / "out") if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [90, 180]
    assert evals[-1]["eval_colours_contains"] >= 0.5, evals  # the demo learns the colours (~0 at init)
    rows = [json.loads(line) for line in COLOURS.read_text().splitlines()]
    samples = evals[-1]["eval_colours_samples"]
    assert len(samples) == 3  # the set's num_samples (default 3)
    for sample, row in zip(samples, rows, strict=False):
        assert sample["images"] == [f"recipes/demo/data/vlm/{row['prompt'][0]['content'][0]['image']}"]
        assert sample["expected"] == row["expected"] and sample["correct"] == (
            row["expected"] in sample["output"]
        )


def test_eval_base_vs_tuned_loss_and_generation_set_with_images(trained):
    """`finetune eval RECIPE --model OUT` against the saved random init: the held-out rows collated with
    their pixels give the run's own final eval_loss, and on the generation set with images the tuned
    model answers clearly better than its base, with the run's own greedy answers."""
    report = trained / "eval.json"
    sets = json.dumps([{"name": "colours", "path": str(COLOURS), "metric": "contains", "max_new_tokens": 4,
                        "num_samples": 16}])  # fmt: skip
    result = cli("eval", str(RECIPE), *base_overrides(trained), "--model", str(trained / "out"), "--no-progress",
                 "--output", str(report), "--eval.generation_sets", sets)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    final = [r for r in progress(trained / "out") if r.get("event") == "eval"][-1]
    results = json.loads(report.read_text())["results"]
    tuned = results["tuned"]
    assert tuned["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-4)
    assert tuned["eval_tokens"] == final["eval_tokens"] and tuned["eval_loss"] < results["base"]["eval_loss"]
    scored, untrained = tuned["generation"]["colours"], results["base"]["generation"]["colours"]
    assert scored["n"] == untrained["n"] == 16
    assert untrained["score"] <= 0.2 and scored["score"] >= untrained["score"] + 0.4, (untrained, scored)
    assert [s["output"] for s in scored["samples"][:3]] == [
        s["output"] for s in final["eval_colours_samples"]
    ]
    rows = [json.loads(line) for line in COLOURS.read_text().splitlines()]
    for model in ("base", "tuned"):
        samples = results[model]["generation"]["colours"]["samples"]
        assert [s["images"] for s in samples] == [
            [str(COLOURS.parent / r["prompt"][0]["content"][0]["image"])] for r in rows
        ]
    assert "colours contains (n=16)" in result.stdout and "images: " in result.stdout


def test_a_missing_image_in_a_generation_set_is_an_error_before_any_model_loads(trained, tmp_path):
    rows = COLOURS.read_text().splitlines()
    broken = tmp_path / "colours.jsonl"
    shutil.copytree(COLOURS.parent / "images", tmp_path / "images")  # row 0's image stays readable
    broken.write_text("\n".join([rows[0], rows[1].replace("images/", "gone/")]) + "\n")
    sets = json.dumps([{"name": "colours", "path": str(broken), "metric": "contains"}])
    result = cli(
        "eval",
        str(RECIPE),
        *base_overrides(trained),
        "--model",
        str(trained / "out"),
        "--eval.generation_sets",
        sets,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: eval.generation_sets[colours]: {broken} row 1:" in result.stderr
    assert (
        "image file 'gone/00481.png' cannot be read" in result.stderr and "loading base" not in result.stderr
    )


def test_two_process_ddp_matches_one_process(trained):
    """DDP on 2 gloo processes (finetune train --accelerate-config multi_cpu, torchrun) of the VLM demo:
    each process collates its own rows' pixels; the same global batches give the same losses and
    gradient norms as one process, up to float summation order."""
    ddp_and_single(RECIPE, trained, 8, "--train.max_steps", "4", "--train.log_steps", "1", "--train.eval_steps", "null",
                   "--train.save_epochs", "0", "--train.save_hf_weights", "false")  # fmt: skip
    ddp_log, single_log = progress(trained / "ddp"), progress(trained / "single")
    assert sorted(step_losses(ddp_log)) == [1, 2, 3, 4]
    for measure in (step_losses, step_grad_norms):
        a, b = measure(ddp_log), measure(single_log)
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a), (a, b)
