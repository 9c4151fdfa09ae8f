"""The prompt format (online RL): prompt ids up to where the answer starts, nothing trained, the row
kept whole for the rewards; through tokenize_dataset, the manifest and the recipe's rules."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.recipe import dataset_entry

DEMO_TOKENIZER = Path(__file__).resolve().parents[4] / "recipes" / "demo" / "tokenizer"
ROWS = [
    {"question": "What is 2 + 3?", "answer": "#### 5", "level": 1},
    {"question": None, "answer": "#### 0", "level": 3},
]
MESSAGES = [
    {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 4 - 1?"}],
     "answer": "#### 3"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))


def _tokenize(tokenizer, rows, **entry):
    entry = dataset_entry(path="p.jsonl", type="prompt", field_prompt="question", **entry)
    ds = datasets.Dataset.from_list(rows)
    return tokenize_dataset(
        ds, entry, tokenizer, sequence_len=64, excess_length_strategy="drop", on_bad_row="skip"
    )


def test_prompts_end_with_the_generation_prompt_and_train_nothing(tokenizer):
    result = _tokenize(tokenizer, ROWS[:1], apply_chat_template=True)
    (row,) = result.dataset
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    text = tokenizer.decode(row["input_ids"], skip_special_tokens=False)
    assert text.endswith(expected) and text.endswith("<|im_start|>assistant\n")
    assert set(row["labels"]) == {IGNORE_INDEX}
    assert json.loads(row["row"]) == ROWS[0]  # every column, for the rewards
    assert result.dropped == {}


def test_without_the_template_a_string_prompt_is_tokenized_as_it_is(tokenizer):
    (row,) = _tokenize(tokenizer, ROWS[:1]).dataset
    ids = tokenizer("What is 2 + 3?", add_special_tokens=False)["input_ids"]
    assert row["input_ids"][-len(ids) :] == ids and row["input_ids"][0] == tokenizer.bos_token_id


def test_message_prompts_are_rendered_and_a_missing_prompt_is_counted(tokenizer):
    (row,) = _tokenize(tokenizer, MESSAGES).dataset
    text = tokenizer.decode(row["input_ids"], skip_special_tokens=False)
    assert "Be brief." in text and text.endswith("<|im_start|>assistant\n")
    assert json.loads(row["row"])["answer"] == "#### 3"
    result = _tokenize(tokenizer, ROWS, apply_chat_template=True)
    assert len(result.dataset) == 1 and result.dropped == {"bad_row:missing_field": 1}


def test_the_recipe_pairs_prompt_data_with_grpo_only():
    from pydantic import ValidationError

    from finetune.recipe import validate_recipe

    recipe = {
        "model": {"model_path": "m"},
        "data": {"datasets": [{"path": "p.jsonl", "type": "prompt"}]},
        "train": {"output_dir": "o"},
    }
    with pytest.raises(ValidationError, match=r"needs train\.objective grpo"):
        validate_recipe(recipe)
    from finetune.recipe import Recipe
    from finetune.recipe.errors import format_validation_error

    entry = {"path": "p.jsonl", "type": "prompt", "train_on_inputs": True}
    grpo = {"train": {"output_dir": "o", "objective": "grpo"}, "grpo": {"rewards": [{"name": "length"}]}}
    with pytest.raises(ValidationError) as info:
        validate_recipe({**recipe, **grpo, "data": {"datasets": [entry]}})
    message = format_validation_error(info.value, Recipe)
    assert "train_on_inputs: unknown key" in message and "the prompt is never trained" in message


def test_prepare_keeps_answers_that_look_like_json_as_the_strings_they_are(tmp_path):
    """GSM8K-style answers in a column where other rows hold a list of accepted answers: "42",
    "null" and "[1, 2]" reach the rewards as those strings (datasets' Json column read them as 42,
    None and a list)."""
    from finetune.data.prepare.build import prepare
    from finetune.recipe import validate_recipe

    answers = ["42", "null", "[1, 2]", ["7", "seven"]]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"Q{i}?", "answer": a}) + "\n" for i, a in enumerate(answers))
    )
    recipe = validate_recipe(
        {
            "model": {"config_path": {"model_type": "llama"}, "tokenizer_path": str(DEMO_TOKENIZER)},
            "data": {
                "datasets": [{"path": str(path), "type": "prompt", "field_prompt": "question"}],
                "sequence_len": 64,
                "dataset_num_proc": 1,
                "dataset_prepared_path": str(tmp_path / "prepared"),
            },
            "train": {"output_dir": str(tmp_path / "out"), "objective": "grpo", "micro_batch_size": 8},
            "grpo": {"rewards": [{"name": "exact_match", "field_expected": "answer"}]},
        }
    )
    prepared = prepare(recipe, log=lambda _: None)
    kept = [json.loads(row)["answer"] for row in prepared.train["row"]]  # one prompt per row
    assert sorted(kept, key=json.dumps) == sorted(answers, key=json.dumps)
