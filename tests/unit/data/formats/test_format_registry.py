"""The format registry: it agrees with the recipe's entry classes, every type is handled, and the
column checks of every type go through the format its type names."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from finetune.data.formats import registry
from finetune.data.formats.registry import FORMATS
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.diffusion.sources import load_entry
from finetune.errors import DataError
from finetune.recipe import DatasetEntry, DiffusionSection, dataset_entry
from finetune.recipe.formats import ENTRY_CLASSES, ENTRY_TYPES, IMAGE_DATASET_TYPES
from tests.diffusion_data import write_color_folder

DEMO_TOKENIZER = Path(__file__).resolve().parents[4] / "recipes" / "demo" / "tokenizer"
# One row of each LLM format (the defaults of its schema name the columns).
ROWS = {
    "completion": {"text": "The cat sat on the mat."},
    "alpaca": {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    "input_output": {"prompt": "2+2?", "completion": "4"},
    "chat_template": {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    },
    "tokenized": {"input_ids": [1, 7, 8, 2], "labels": [-100, 7, 8, 2]},
    "preference": {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    "kto": {"prompt": "2+2?", "completion": "4", "label": True},
    "prompt": {"prompt": "2+2?", "answer": "4"},
}


def test_every_llm_entry_class_has_a_format_and_every_format_a_class() -> None:
    llm_types = {name for name, cls in ENTRY_TYPES.items() if cls.kind != "images"}
    assert set(FORMATS) == llm_types == set(ROWS)
    assert set(IMAGE_DATASET_TYPES) == set(ENTRY_TYPES) - set(FORMATS)
    assert len(ENTRY_TYPES) == len(ENTRY_CLASSES)  # one class per type name


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_llm_type_tokenizes_a_row_of_its_schema_defaults(name: str) -> None:
    # A format that read a field its schema class lacks would fail here (AttributeError).
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    ds = datasets.Dataset.from_list([ROWS[name]])
    for extra in (
        ({}, {"apply_chat_template": True}) if name in ("alpaca", "input_output", "kto", "prompt") else ({},)
    ):
        entry = dataset_entry(path="x.jsonl", type=name, **extra)
        result = tokenize_dataset(
            ds, entry, tokenizer, sequence_len=256, excess_length_strategy="drop", on_bad_row="raise"
        )
        assert len(result.dataset) == 1 and set(FORMATS[name].features) <= set(result.dataset.column_names)


@pytest.mark.parametrize("name", IMAGE_DATASET_TYPES)
def test_every_image_type_is_loaded_by_diffusion(tmp_path: Path, name: str) -> None:
    write_color_folder(tmp_path / "imgs", captions="txt", count=2)
    entry = dataset_entry(path=str(tmp_path / "imgs"), type=name)
    settings = DiffusionSection(instance_prompt="a photo of sks thing")
    assert len(load_entry(entry, "data.datasets[0]", settings, "raise").records) == 2


def entry(**kw) -> DatasetEntry:
    kw.setdefault("path", "data/x.jsonl")
    return dataset_entry(**kw)


def test_check_columns_missing_with_did_you_mean() -> None:
    e = entry(type="input_output", field_prompt="questoin", field_completion="answer")
    with pytest.raises(DataError) as err:
        registry.check_columns(e, ["question", "answer"], entry_label="data.datasets[2]")
    msg = str(err.value)
    assert "data.datasets[2]" in msg and "data/x.jsonl" in msg
    assert "'questoin'" in msg and "['question', 'answer']" in msg
    assert "Did you mean 'question'?" in msg
    assert "data.datasets[2].field_prompt" in msg


def test_check_columns_each_type() -> None:
    registry.check_columns(entry(type="completion"), ["text"])
    registry.check_columns(entry(type="alpaca"), ["instruction", "output"])  # input is optional
    registry.check_columns(entry(type="alpaca"), ["instruction", "input", "output"])
    registry.check_columns(entry(type="chat_template"), ["messages", "id"])
    registry.check_columns(entry(type="tokenized"), ["input_ids"])
    registry.check_columns(entry(type="preference"), ["chosen", "rejected"])  # prompt is optional
    registry.check_columns(entry(type="kto"), ["prompt", "completion", "label"])
    with pytest.raises(DataError, match="'text'"):
        registry.check_columns(entry(type="completion"), ["content"])
    with pytest.raises(DataError, match="'input_ids'"):
        registry.check_columns(entry(type="tokenized"), ["ids", "labels"])
    # An explicitly mapped input column must exist: no silent fallback to "no input".
    with pytest.raises(DataError, match="'context'"):
        registry.check_columns(entry(type="alpaca", field_input="context"), ["instruction", "output"])
    with pytest.raises(DataError, match="'label'"):
        registry.check_columns(entry(type="kto"), ["prompt", "completion"])


def test_image_types_have_no_llm_format() -> None:
    with pytest.raises(DataError, match="unknown dataset type 'images'"):
        registry.format_of(entry(type="images"))
