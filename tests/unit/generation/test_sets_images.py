"""Generation sets with images (a vision-language model's eval.generation_sets): rows in the shapes the SFT
data reads (image parts with paths relative to the set's file, <image> placeholders with an images column,
Parquet image bytes), every image opened and checked when the set loads (a missing or broken image is an
error naming the set, file, row and path), the prompts encoded as training encodes them and generated in
batches with their pixels (the same answers as one by one), samples that name their images, and the
refusals for text models."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
import yaml
from PIL import Image
from pydantic import ValidationError
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Config

from finetune.data.formats.images import SENTINEL
from finetune.errors import FinetuneError
from finetune.generation.prompts import vlm_prompt_ids, vlm_prompt_inputs
from finetune.generation.sets import (
    IMAGE_SAMPLE_COLUMNS,
    evaluate_generations,
    generation_metrics,
    load_generation_rows,
)
from finetune.generation.transformers_backend import TransformersBackend
from finetune.recipe import Recipe, validate_recipe
from finetune.recipe.errors import format_validation_error
from finetune.recipe.eval import GenerationSet

DEMO = Path(__file__).resolve().parents[3] / "recipes" / "demo"
QUESTION = "What colour is the shape?"


def _part_prompt(image: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}
    ]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A set's folder: images/red.png, images/blue.png (32x32), notes.png (not an image)."""
    root = tmp_path_factory.mktemp("gensets-images")
    (root / "images").mkdir()
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        Image.new("RGB", (32, 32), colour).save(root / "images" / f"{name}.png")
    (root / "notes.png").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def vlm():
    """(model, processor): the demo's tiny Idefics3, random init, and its processor."""
    config = yaml.safe_load((DEMO / "tiny_vlm_cpu.yaml").read_text())["model"]["config_path"]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(Idefics3Config(**config)).eval()
    return model, AutoProcessor.from_pretrained(DEMO / "vlm_processor")


def test_parts_and_placeholder_rows_load_with_their_images(folder):
    path = _write(
        folder / "set.jsonl",
        [
            {"prompt": _part_prompt("images/red.png"), "expected": "red"},
            {"prompt": f"<image>{QUESTION}", "images": ["images/blue.png"], "expected": "blue"},
            {"prompt": "Say hi", "images": [], "expected": "hi"},
        ],
    )
    rows = load_generation_rows(GenerationSet(name="c", path=path, metric="contains"), vision=True)
    red, blue, text = rows
    assert red["images"] == [str(folder / "images" / "red.png")] and red["expected"] == "red"
    assert red["messages"] == [{"role": "user", "content": SENTINEL + QUESTION}]
    assert red["prompt"] == _part_prompt("images/red.png")  # shown as written
    assert blue["messages"] == [{"role": "user", "content": SENTINEL + QUESTION}]
    assert Image.open(io.BytesIO(blue["image_bytes"][0])).getpixel((0, 0)) == (20, 20, 220)
    assert text["images"] == [] and text["messages"] == [{"role": "user", "content": "Say hi"}]
    # image_max_pixels resizes as training's prepare does
    small = load_generation_rows(
        GenerationSet(name="c", path=path, metric="contains"), vision=True, image_max_pixels=256
    )
    assert Image.open(io.BytesIO(small[0]["image_bytes"][0])).size == (16, 16)


def test_parquet_image_bytes_and_a_renamed_images_column(folder):
    red = (folder / "images" / "red.png").read_bytes()
    features = datasets.Features(
        {"prompt": datasets.Value("string"), "pics": [datasets.Image()], "expected": datasets.Value("string")}
    )
    ds = datasets.Dataset.from_list(
        [{"prompt": f"<image>{QUESTION}", "pics": [{"bytes": red, "path": None}], "expected": "red"}],
        features=features,
    )
    ds.to_parquet(folder / "set.parquet")
    gen_set = GenerationSet(
        name="p", path=str(folder / "set.parquet"), metric="contains", field_images="pics"
    )
    (row,) = load_generation_rows(gen_set, vision=True)
    assert len(row["image_bytes"]) == 1 and row["images"] == ["32x32 image stored in the set"]
    assert Image.open(io.BytesIO(row["image_bytes"][0])).getpixel((0, 0)) == (220, 20, 20)


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": _part_prompt("images/gone.png")}, ["row 1", "'images/gone.png' cannot be read"]),
        ({"prompt": _part_prompt("notes.png")}, ["row 1", "not a readable image", "'notes.png'"]),
        ({"prompt": f"<image><image>{QUESTION}", "images": ["images/red.png"]}, ["row 1", "2 <image> placeholder"]),
        ({"prompt": f"<image>{QUESTION}"}, ["row 1", "holds 0 image"]),
    ],
)  # fmt: skip
def test_a_missing_or_broken_image_is_an_error_naming_set_file_row_and_path(folder, row, says):
    path = _write(
        folder / "bad.jsonl",
        [{"prompt": _part_prompt("images/red.png"), "expected": "red"}, {**row, "expected": "red"}],
    )
    with pytest.raises(FinetuneError) as info:
        load_generation_rows(GenerationSet(name="colours", path=path, metric="contains"), vision=True)
    message = str(info.value)
    assert message.startswith(f"eval.generation_sets[colours]: {path} row 1")
    assert all(s in message for s in says), message


def test_a_text_model_refuses_image_parts_and_keeps_text_sets(folder):
    images = _write(folder / "parts.jsonl", [{"prompt": _part_prompt("images/red.png"), "expected": "red"}])
    with pytest.raises(FinetuneError, match=r"row 0 has image parts, but the model reads only text"):
        load_generation_rows(GenerationSet(name="c", path=images, metric="contains"))
    text = _write(folder / "text.jsonl", [{"prompt": "Hi", "images": ["x.png"], "expected": "hi"}])
    assert load_generation_rows(GenerationSet(name="c", path=text, metric="contains")) == [
        {"prompt": "Hi", "expected": "hi"}
    ]


def _recipe(kind: str, **gen_set) -> dict:
    model = (
        {"kind": "vlm", "model_path": "HuggingFaceTB/SmolVLM-Instruct"}
        if kind == "vlm"
        else {"model_path": "m"}
    )
    return {
        "model": model,
        "data": {"datasets": [{"path": "d.jsonl", "type": "chat_template"}]},
        "train": {"output_dir": "out"},
        "eval": {"generation_sets": [{"name": "colours", "path": "g.jsonl", **gen_set}]},
    }


def test_recipe_rules():
    assert validate_recipe(_recipe("vlm", field_images="pics")).eval.generation_sets[0].field_images == "pics"
    assert validate_recipe(_recipe("llm")).eval.generation_sets[0].name == "colours"
    with pytest.raises(ValidationError) as info:
        validate_recipe(_recipe("vlm", use_chat_template=False))
    assert "rendered with its chat template" in format_validation_error(info.value, Recipe)
    with pytest.raises(ValidationError) as info:
        validate_recipe(_recipe("llm", field_images="pics"))
    message = format_validation_error(info.value, Recipe)
    assert "eval.generation_sets[0].field_images: got 'pics'" in message and "set model.kind: vlm" in message


def test_prompt_ids_are_training_ids_and_batches_answer_as_one_by_one(vlm, folder):
    model, processor = vlm
    red = Image.open(folder / "images" / "red.png").convert("RGB")
    messages = [{"role": "user", "content": SENTINEL + QUESTION}]
    assert (
        vlm_prompt_ids(processor, messages, [red])
        == vlm_prompt_inputs(processor, messages, [red])["input_ids"][0].tolist()
    )
    path = _write(
        folder / "mixed.jsonl",
        [
            {"prompt": _part_prompt("images/red.png"), "expected": "red"},
            {"prompt": "Say something long enough to be the longest prompt", "expected": "x"},
            {"prompt": _part_prompt("images/blue.png"), "expected": "blue"},
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": "images/red.png"},
                                                      {"type": "image", "image": "images/blue.png"},
                                                      {"type": "text", "text": "Two?"}]}], "expected": "y"},
        ],
    )  # fmt: skip
    rows = load_generation_rows(GenerationSet(name="m", path=path, metric="contains"), vision=True)

    def run(batch_size):
        backend = TransformersBackend(model, processor.tokenizer, processor=processor)
        return evaluate_generations(
            backend, rows, metric="contains", max_new_tokens=5, batch_size=batch_size, num_samples=None,
            progress=False,
        )  # fmt: skip

    together, alone = run(4), run(1)
    assert [s["output"] for s in together["samples"]] == [s["output"] for s in alone["samples"]]
    samples = together["samples"]
    assert samples[0]["images"] == [str(folder / "images" / "red.png")] and "images" not in samples[1]
    assert len(samples[3]["images"]) == 2 and together["n"] == 4
    # the pixels matter: the same question about the other picture is answered from other logits
    first = vlm_prompt_inputs(processor, messages, [red])
    other = vlm_prompt_inputs(
        processor, messages, [Image.open(folder / "images" / "blue.png").convert("RGB")]
    )
    with torch.no_grad():
        assert not torch.allclose(model(**first).logits[0, -1], model(**other).logits[0, -1])


class _Tracker:
    name = "tensorboard"

    def __init__(self):
        self.logged, self.images = [], []

    def log(self, values, step):
        self.logged.append(values)

    def log_images(self, values, step, dataformats):
        self.images.append((values, dataformats))


def test_training_metrics_log_samples_with_images(vlm, folder):
    model, processor = vlm
    path = _write(folder / "train-set.jsonl", [{"prompt": _part_prompt("images/red.png"), "expected": "red"}])
    gen_set = GenerationSet(name="colours", path=path, metric="contains", max_new_tokens=3)
    rows = {"colours": load_generation_rows(gen_set, vision=True)}
    tracker = _Tracker()
    accelerator = SimpleNamespace(
        is_main_process=True,
        trackers=[tracker],
        log=tracker.log,
        unwrap_model=lambda m: m,
        wait_for_everyone=lambda: None,
    )
    settings = SimpleNamespace(generation_sets=[gen_set], batch_size=8)
    fields = generation_metrics(
        accelerator, model, processor.tokenizer, settings, rows, step=5, processor=processor
    )
    assert fields["eval_colours_contains"] in (0.0, 1.0)
    assert fields["eval_colours_samples"][0]["images"] == [str(folder / "images" / "red.png")]
    table = next(v["eval/colours_samples"] for v in tracker.logged if "eval/colours_samples" in v)
    assert table.splitlines()[0].count("|") == len(IMAGE_SAMPLE_COLUMNS) + 1 and "red.png" in table
    ((grids, dataformats),) = tracker.images
    assert dataformats == "NHWC" and grids["eval/colours_images/00"].shape == (1, 32, 32, 3)
