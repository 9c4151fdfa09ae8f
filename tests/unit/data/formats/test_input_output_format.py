"""The input_output format: (prompt, completion) pairs from two mapped columns."""

from __future__ import annotations

from finetune.data.formats import input_output
from finetune.data.formats.chat import pair_turns
from finetune.data.formats.rows import BadRow
from finetune.recipe import DatasetEntry, dataset_entry


def entry(**kw) -> DatasetEntry:
    return dataset_entry(path="data/x.jsonl", type="input_output", **kw)


def test_pairs_with_mapping() -> None:
    e = entry(field_prompt="question", field_completion="answer")
    out = input_output.pairs({"question": ["Q?", "Q2", None], "answer": ["A", ["x"], "A3"]}, e)
    assert out[0] == ("Q?", "A")
    assert isinstance(out[1], BadRow) and (out[1].field, out[1].reason) == ("answer", "wrong_type")
    assert isinstance(out[2], BadRow) and (out[2].field, out[2].reason) == ("question", "missing_field")


def test_empty_completion_is_dropped_unless_train_on_inputs() -> None:
    [bad] = input_output.pairs({"q": ["Q?"], "a": [""]}, entry(field_prompt="q", field_completion="a"))
    assert isinstance(bad, BadRow) and (bad.field, bad.reason) == ("a", "empty_completion")
    # With train_on_inputs the prompt is trained: the row is kept.
    e = entry(field_prompt="q", field_completion="a", train_on_inputs=True)
    assert input_output.pairs({"q": ["Q?"], "a": [""]}, e) == [("Q?", "")]


def test_pairs_as_turns_for_the_chat_template() -> None:
    e = entry(field_prompt="question", field_completion="answer", apply_chat_template=True)
    out = pair_turns(input_output.pairs({"question": ["Q?", None, "Q3"], "answer": ["A", "x", ""]}, e))
    assert out[0] == [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}]
    assert (out[1].field, out[1].reason) == ("question", "missing_field")
    assert (out[2].field, out[2].reason) == ("answer", "empty_completion")
