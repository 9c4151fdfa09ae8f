"""`finetune prepare-dataset` on tool-calling conversations, through the CLI's main in this process
(tests/inprocess.py): the manifest counts the bad calls, and the prepared rows train exactly the calls
and replies (Qwen2.5's real template)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import datasets
import pytest
import yaml
from transformers import AutoTokenizer

from finetune.constants import IGNORE_INDEX
from tests.inprocess import finetune

TEMPLATE = (
    Path(__file__).resolve().parents[1] / "unit" / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, repo_root: Path):
    tmp = tmp_path_factory.mktemp("tools")
    tok = AutoTokenizer.from_pretrained(str(repo_root / "recipes" / "demo" / "tokenizer"))
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(tmp / "tokenizer")
    spec = importlib.util.spec_from_file_location(
        "make_tool_calls", repo_root / "recipes/tools/make_tool_calls.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    import random

    rng = random.Random(1)
    rows = [gen.conversation(rng, i) for i in range(6)]
    broken = json.loads(json.dumps(rows[0]))
    broken["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    orphan = json.loads(json.dumps(rows[1]))
    del orphan["messages"][2]["tool_calls"]  # its tool result now answers no call...
    orphan["messages"][2]["content"] = "Let me see."
    orphan["messages"].append({**rows[1]["messages"][2]})  # ...though a later turn calls
    data = tmp / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*rows, broken, orphan]))
    recipe = {
        "model": {"config_path": {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1},
                  "tokenizer_path": str(tmp / "tokenizer")},
        "data": {"datasets": [{"path": str(data), "type": "chat_template"}], "on_bad_row": "skip",
                 "sequence_len": 2048, "dataset_num_proc": 1, "dataset_prepared_path": str(tmp / "prepared")},
        "train": {"output_dir": str(tmp / "out")},
    }  # fmt: skip
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = finetune("prepare-dataset", str(tmp / "recipe.yaml"))
    assert run.returncode == 0, run.stderr
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("prepared dataset "))
    return Path(line.rsplit(" at ", 1)[1]), rows, tok


def test_manifest_counts_the_bad_tool_rows(prepared) -> None:
    folder, _, _ = prepared
    m = json.loads((folder / "manifest.json").read_text())
    assert m["rows_in"] == 8 and m["rows_kept"] == 6
    assert m["dropped"] == {"bad_row:bad_tool_call": 1, "bad_row:orphan_tool_result": 1}
    fields = sorted(s["field"] for s in m["bad_row_samples"])
    assert fields == ["messages[2].tool_calls[0].function.arguments", "messages[3]"]


def test_prepared_rows_train_the_calls_and_replies(prepared) -> None:
    folder, rows, tok = prepared
    train = datasets.load_from_disk(str(folder / "train"))
    trained = ""  # rows are packed: the trained tokens of all of them, several conversations a row
    for row in train:
        ids = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]
        trained += tok.decode(ids)
    expected = []
    for r in rows:
        call = r["messages"][2]["tool_calls"][0]["function"]
        args = json.dumps(json.loads(call["arguments"]))
        expected.append(
            f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {args}}}\n</tool_call><|im_end|>'
            f"{r['messages'][4]['content']}<|im_end|>"
        )
    assert all(e in trained for e in expected) and len(trained) == sum(len(e) for e in expected)
