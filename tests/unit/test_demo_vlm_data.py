"""recipes/demo/make_vlm_data.py: the same seed writes the same files, the shipped data is what it writes,
and a colour answer is the colour of the shape in the picture (the answers depend on the pixels), in the
training data as in the generation set of held-out pictures (colours.jsonl)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("make_vlm_data", REPO / "recipes" / "demo" / "make_vlm_data.py")
make_vlm_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_vlm_data)


def test_data_is_reproducible_and_answers_come_from_the_pixels(tmp_path):
    make_vlm_data.write_data(tmp_path / "a", num_train=20, num_eval=4, seed=0)
    make_vlm_data.write_data(tmp_path / "b", num_train=20, num_eval=4, seed=0)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 27  # 24 images, train, eval, and the generation set colours.jsonl
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    shipped = REPO / "recipes" / "demo" / "data" / "vlm" / "train.jsonl"
    assert shipped.read_text().splitlines()[:20] == (tmp_path / "a" / "train.jsonl").read_text().splitlines()
    for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        answer = messages[1]["content"][0]["text"]
        if answer in make_vlm_data.COLOURS:
            image = Image.open(tmp_path / "a" / messages[0]["content"][0]["image"]).convert("RGB")
            colours = {c for _, c in image.getcolors() if c != (255, 255, 255)}
            assert make_vlm_data.COLOURS[answer] in colours
    # The generation set asks the held-out pictures' colours; the expected colour is the shape's.
    prompts = [json.loads(line) for line in (tmp_path / "a" / "colours.jsonl").read_text().splitlines()]
    assert len(prompts) == 4
    held_out = [
        json.loads(line)["messages"][0]["content"][0]["image"]
        for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()
    ]
    assert [p["prompt"][0]["content"][0]["image"] for p in prompts] == held_out
    for row in prompts:
        image = Image.open(tmp_path / "a" / row["prompt"][0]["content"][0]["image"]).convert("RGB")
        assert make_vlm_data.COLOURS[row["expected"]] in {c for _, c in image.getcolors()}
    shipped_set = REPO / "recipes" / "demo" / "data" / "vlm" / "colours.jsonl"
    assert len(shipped_set.read_text().splitlines()) == make_vlm_data.NUM_COLOUR_PROMPTS
