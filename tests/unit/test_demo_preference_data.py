"""The demo's preference pairs and kto examples (recipes/demo/make_preference_data.py) are what the
generator writes, and each rejected answer differs from the chosen one in its last number only."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo"


def _generator():
    spec = importlib.util.spec_from_file_location("make_preference_data", DEMO / "make_preference_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_files_are_the_generators_output(tmp_path):
    _generator().main(["--out-dir", str(tmp_path)])
    for name in ("preferences.jsonl", "kto.jsonl"):
        assert (tmp_path / name).read_bytes() == (DEMO / "data" / name).read_bytes(), name


def test_rejected_answers_change_only_the_last_number():
    rows = [json.loads(line) for line in (DEMO / "data" / "preferences.jsonl").read_text().splitlines()]
    assert len(rows) == 600
    for row in rows:
        chosen, rejected = row["chosen"], row["rejected"]
        assert chosen != rejected
        assert re.sub(r"\d+(?!.*\d)", "N", chosen, flags=re.S) == re.sub(
            r"\d+(?!.*\d)", "N", rejected, flags=re.S
        )
    kto = [json.loads(line) for line in (DEMO / "data" / "kto.jsonl").read_text().splitlines()]
    assert [r["label"] for r in kto[:4]] == [True, False, True, False]
