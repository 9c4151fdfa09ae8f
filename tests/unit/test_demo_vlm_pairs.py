"""recipes/demo/make_vlm_data.py's preference pairs (the tiny VLM DPO demo): the shipped files are what it
writes, the chosen colour is the picture's and the rejected one is not (only the pixels tell them apart)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tests.vlm_processors import demo_generator

REPO = Path(__file__).resolve().parents[2]
make_vlm_data = demo_generator()
SHIPPED = REPO / "recipes" / "demo" / "data" / "vlm"


def test_shipped_pairs_are_generated_and_chosen_is_the_pictures_colour(tmp_path):
    make_vlm_data.write_pairs(tmp_path, num_train=480, num_eval=60, seed=0)
    for split in ("train", "eval"):
        name = f"pairs_{split}.jsonl"
        assert (tmp_path / name).read_text() == (SHIPPED / name).read_text(), name
    train = [json.loads(line) for line in (SHIPPED / "pairs_train.jsonl").read_text().splitlines()[:30]]
    held_out = [json.loads(line) for line in (SHIPPED / "pairs_eval.jsonl").read_text().splitlines()[:30]]
    pairs = [
        (row["prompt"][0]["content"][0]["image"], row["chosen"][0]["content"], row["rejected"][0]["content"])
        for row in train
    ] + [(row["images"][0], row["chosen"], row["rejected"]) for row in held_out]
    assert all(row["prompt"].startswith("<image>") for row in held_out)
    for image, chosen, rejected in pairs:
        colours = {
            c for _, c in Image.open(SHIPPED / image).convert("RGB").getcolors() if c != (255, 255, 255)
        }
        assert make_vlm_data.COLOURS[chosen] in colours and make_vlm_data.COLOURS[rejected] not in colours
