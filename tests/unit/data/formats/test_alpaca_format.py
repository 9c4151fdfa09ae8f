"""The alpaca format: the Stanford Alpaca prompt, (prompt, output) pairs and their bad rows."""

from __future__ import annotations

from finetune.data.formats import alpaca
from finetune.data.formats.chat import pair_turns
from finetune.data.formats.rows import BadRow
from finetune.recipe import DatasetEntry, dataset_entry


def entry(**kw) -> DatasetEntry:
    return dataset_entry(path="data/x.jsonl", type="alpaca", **kw)


def test_alpaca_prompt_with_and_without_input() -> None:
    with_input = alpaca.alpaca_prompt("Add the numbers.", "2 and 3")
    assert with_input == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    )
    for empty in ("", None):
        assert alpaca.alpaca_prompt("Say hi.", empty) == (
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            "### Instruction:\nSay hi.\n\n### Response:\n"
        )


def test_alpaca_pairs_and_bad_rows() -> None:
    batch = {
        "instruction": ["Do A.", None, "Do C.", 5],
        "input": ["ctx", "x", None, ""],
        "output": ["done", "y", None, "z"],
    }
    out = alpaca.pairs(batch, entry())
    assert out[0] == (alpaca.alpaca_prompt("Do A.", "ctx"), "done")
    assert out[1] == BadRow("instruction", "missing_field", "'instruction' is missing or null")
    assert isinstance(out[2], BadRow) and (out[2].field, out[2].reason) == ("output", "missing_field")
    assert isinstance(out[3], BadRow) and (out[3].field, out[3].reason) == ("instruction", "wrong_type")


def test_alpaca_without_input_column() -> None:
    out = alpaca.pairs({"instruction": ["Do A."], "output": ["done"]}, entry())
    assert out == [(alpaca.alpaca_prompt("Do A.", None), "done")]


def test_empty_output_is_a_counted_drop_not_a_bad_row() -> None:
    out = alpaca.pairs({"instruction": ["A", "B", "C"], "output": ["done", "", " \n"]}, entry())
    assert out[0] == (alpaca.alpaca_prompt("A", None), "done")
    for bad in out[1:]:
        assert isinstance(bad, BadRow) and not bad.malformed
        assert (bad.field, bad.reason, bad.drop_key) == ("output", "empty_completion", "empty_completion")
    assert "is empty" in out[1].detail and "only whitespace" in out[2].detail


def test_pairs_as_turns_for_the_chat_template() -> None:
    batch = {"instruction": ["Add.", "Say hi."], "input": ["2 and 3", None], "output": ["5", "hi"]}
    assert pair_turns(alpaca.pairs(batch, entry(apply_chat_template=True))) == [
        [{"role": "user", "content": "Add.\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
    ]


def test_columns_read_the_input_when_present_or_named() -> None:
    assert alpaca.columns(entry(), ["instruction", "output"]) == {
        "field_instruction": "instruction",
        "field_output": "output",
    }
    assert "field_input" in alpaca.columns(entry(), ["instruction", "input", "output"])
    assert alpaca.columns(entry(field_input="context"), ["instruction", "output"])["field_input"] == "context"
