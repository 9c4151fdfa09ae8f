"""A preference entry's margin column (field_margin, read by train.objective reward): each pair carries
its margin through tokenizing, merging, the split and packing to the batch, in the pairs' order; a value
that is not a number is a bad row; the field enters the fingerprint only when set (the fingerprints of
every other preference recipe stay what they were); and the recipe's rules around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from finetune.data.batching.collate import collate_preference
from finetune.data.prepare.build import prepare
from finetune.data.prepare.fingerprint import fingerprint_inputs
from finetune.recipe import validate_recipe

DEMO_TOKENIZER = Path(__file__).resolve().parents[4] / "recipes" / "demo" / "tokenizer"


def recipe(
    tmp_path: Path, *, objective: str = "reward", margin: str | None = "gap", rows=None, **extra
) -> dict:
    rows = rows or [
        {
            "question": f"Compute {i} + 1.",
            "good": f"{i} + 1 = {i + 1}.",
            "bad": f"{i} + 1 = {i + 2}.",
            "gap": i / 4,
        }
        for i in range(24)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    entry = {"path": str(path), "type": "preference", "field_prompt": "question", "field_chosen": "good",
             "field_rejected": "bad"}  # fmt: skip
    if margin is not None:
        entry["field_margin"] = margin
    return {
        "model": {"config_path": {"model_type": "llama"}, "tokenizer_path": str(DEMO_TOKENIZER)},
        "data": {
            "datasets": [entry], "val_set_size": 4, "sequence_len": 96, "sample_packing_sequence_len": 128,
            "pad_to_multiple_of": 8, "on_bad_row": "skip", "dataset_num_proc": 1,
            "dataset_prepared_path": str(tmp_path / "prepared"),
        },
        "train": {"output_dir": str(tmp_path / "out"), "objective": objective},
        **extra,
    }  # fmt: skip


def test_each_pair_carries_its_margin_to_the_batch(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    built = prepare(validate_recipe(recipe(tmp_path)), log=lambda _: None)
    for split in (built.train, built.eval):
        assert "margins" in split.column_names
        batch = collate_preference(list(split), pad_token_id=3)
        chosen = []  # each pair's chosen sequence, row-major: its number says which margin it has
        for row in split:
            starts = [k for k, p in enumerate(row["position_ids"]) if p == 0]
            chosen += [row["input_ids"][starts[2 * j] : starts[2 * j + 1]] for j in range(row["num_units"])]
        numbers = [int(tokenizer.decode(ids).split("Compute ")[1].split(" ")[0]) for ids in chosen]
        assert batch["margin"].tolist() == [n / 4 for n in numbers]
    assert sum(len(m) for m in built.train["margins"]) == 20


def test_a_margin_that_is_not_a_number_is_a_bad_row(tmp_path):
    rows = [{"question": f"Q{i}", "good": "yes", "bad": "no", "gap": 1.0} for i in range(8)]
    rows[3]["gap"], rows[5]["gap"] = None, float("nan")
    built = prepare(validate_recipe(recipe(tmp_path, rows=rows)), log=lambda _: None)
    assert built.manifest["dropped"] == {"bad_row:missing_field": 1, "bad_row:wrong_type": 1}


def test_the_margin_field_is_fingerprinted_only_when_set(tmp_path):
    plain = fingerprint_inputs(
        validate_recipe(recipe(tmp_path, objective="dpo", margin=None)), with_files=False
    )
    assert "field_margin" not in plain["datasets"][0]["settings"]  # as before the field existed
    with_margin = fingerprint_inputs(validate_recipe(recipe(tmp_path)), with_files=False)
    assert with_margin["datasets"][0]["settings"]["field_margin"] == "gap"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"objective": "dpo"}, r"data.datasets.0.field_margin: is read by train.objective reward only"),
        (
            {"extra_entry": True},
            r"data.test_datasets.0.field_margin: .* set field_margin on every preference entry",
        ),
        (
            {"eval": {"generation_sets": [{"name": "s", "path": "p.jsonl"}]}},
            "a reward model scores text, it does not generate",
        ),
        (
            {"lora": {"enable_lora": True, "init_lora_weights": "eva"}},
            "lora.init_lora_weights: .* train.objective reward",
        ),
        ({"model_compile": True}, "model.enable_compile: .* forward hook"),
    ],
)
def test_what_a_reward_recipe_cannot_do_is_refused(tmp_path, change, message):
    data = recipe(tmp_path, objective=change.pop("objective", "reward"))
    if change.pop("extra_entry", False):
        data["data"]["test_datasets"] = [{"path": "t.jsonl", "type": "preference"}]
        del data["data"]["val_set_size"]
    if change.pop("model_compile", False):
        data["model"]["enable_compile"] = True
    data.update(change)
    with pytest.raises(ValidationError, match=message):
        validate_recipe(data)
