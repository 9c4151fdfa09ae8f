"""recipes/demo/make_vlm_data.py's kto examples (the tiny VLM KTO demo): the shipped files are what it writes,
and an example is desirable exactly when its answer is the picture's colour (only the pixels tell)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tests.vlm_processors import demo_generator

REPO = Path(__file__).resolve().parents[2]
make_vlm_data = demo_generator()
SHIPPED = REPO / "recipes" / "demo" / "data" / "vlm"


def test_shipped_kto_examples_are_generated_and_labelled_by_the_pictures_colour(tmp_path):
    make_vlm_data.write_kto(tmp_path, num_train=480, num_eval=60, seed=0)
    for split in ("train", "eval"):
        name = f"kto_{split}.jsonl"
        assert (tmp_path / name).read_text() == (SHIPPED / name).read_text(), name
    train = [json.loads(line) for line in (SHIPPED / "kto_train.jsonl").read_text().splitlines()[:40]]
    held_out = [json.loads(line) for line in (SHIPPED / "kto_eval.jsonl").read_text().splitlines()]
    examples = [(row["images"][0], row["completion"], row["label"]) for row in train] + [
        (row["prompt"][0]["content"][0]["image"], row["completion"][0]["content"], row["label"])
        for row in held_out
    ]
    assert all(row["prompt"].startswith("<image>") for row in train)
    assert {label for *_, label in examples} == {True, False}
    for image, answer, label in examples:
        colours = {
            c for _, c in Image.open(SHIPPED / image).convert("RGB").getcolors() if c != (255, 255, 255)
        }
        assert (make_vlm_data.COLOURS[answer] in colours) is label, (image, answer, label)
