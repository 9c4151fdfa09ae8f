"""The tiny GRPO demo's prompts (recipes/demo/make_prompt_data.py) are what the generator writes, and
every answer is the sum's or difference's true value in GSM8K's `#### N` form."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"


def _generator():
    spec = importlib.util.spec_from_file_location("make_prompt_data", DEMO / "make_prompt_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_prompts_are_the_generators_output(tmp_path):
    _generator().main(["--out", str(tmp_path / "prompts.jsonl")])
    assert (tmp_path / "prompts.jsonl").read_bytes() == (DEMO / "data" / "prompts.jsonl").read_bytes()


def test_answers_are_right():
    rows = [json.loads(line) for line in (DEMO / "data" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 256
    for row in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", row["question"]).groups()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["answer"] == f"#### {value}" and value >= 0
