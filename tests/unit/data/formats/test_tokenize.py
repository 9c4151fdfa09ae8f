"""tokenize_dataset: ids and labels per format, length policy, bad rows, accounting, speed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from finetune.constants import IGNORE_INDEX
from finetune.data.formats import tokenize as tokenize_module
from finetune.data.formats.alpaca import alpaca_prompt
from finetune.data.formats.tokenize import TokenizeResult, tokenize_dataset
from finetune.data.sources.readers import load_source
from finetune.errors import DataError
from finetune.recipe import DatasetEntry, dataset_entry

REPO = Path(__file__).resolve().parents[4]
DEMO_TOKENIZER = REPO / "recipes" / "demo" / "tokenizer"
SHARED_DATA = REPO.parent / "shared" / "data"
LLAMA2 = SHARED_DATA / "tokenizers" / "llama2-hf"
GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"
needs_shared = pytest.mark.skipif(
    not (LLAMA2.exists() and GSM8K.exists()),
    reason=f"real tokenizer/data not available: {SHARED_DATA} is absent (see docs/DESIGN.md, 'Real data')",
)


@pytest.fixture(scope="module")
def tok():
    """The demo tokenizer: byte-level BPE, adds <s> itself, eos </s>, ChatML template."""
    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))


@pytest.fixture(scope="module")
def llama():
    if not LLAMA2.exists():
        pytest.skip(f"{LLAMA2} is absent")
    return AutoTokenizer.from_pretrained(str(LLAMA2))


def entry(type: str, **kw) -> DatasetEntry:
    return dataset_entry(path=kw.pop("path", "mem.jsonl"), type=type, **kw)


def run(rows, e, tokenizer, **kw) -> TokenizeResult:
    ds = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows)
    kw.setdefault("sequence_len", 512)
    kw.setdefault("excess_length_strategy", "drop")
    kw.setdefault("on_bad_row", "raise")
    return tokenize_dataset(ds, e, tokenizer, **kw)


def assert_accounted(result: TokenizeResult) -> None:
    assert result.rows_in == len(result.dataset) + sum(result.dropped.values())


def trained(row: dict) -> list[int]:
    return [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != IGNORE_INDEX]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ formats


def test_completion(tok) -> None:
    res = run([{"text": "What is 2 plus 3?"}, {"text": "hello"}], entry("completion"), tok)
    row = res.dataset[0]
    assert row["input_ids"] == [tok.bos_token_id, *ids(tok, "What is 2 plus 3?"), tok.eos_token_id]
    assert row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]
    assert res.dataset.column_names == ["input_ids", "labels", "source_row"]
    assert res.dataset["source_row"][:] == [0, 1]
    assert res.dataset.features["input_ids"].feature.dtype == "int32"
    assert_accounted(res)


def test_completion_without_tokenizer_bos(llama) -> None:
    # The Llama-2 tokenizer here adds no bos itself: none is added, and labels[0] is still -100.
    row = run([{"text": "Hello world"}], entry("completion"), llama).dataset[0]
    assert row["input_ids"] == [*ids(llama, "Hello world"), llama.eos_token_id]
    assert row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]


def test_eos_untrained_with_train_on_eos_none(tok) -> None:
    row = run([{"text": "hello there"}], entry("completion", train_on_eos="none"), tok).dataset[0]
    assert row["input_ids"][-1] == tok.eos_token_id and row["labels"][-1] == IGNORE_INDEX


@pytest.mark.parametrize("with_input", [True, False])
def test_alpaca_masks_the_prompt(tok, with_input: bool) -> None:
    rec = {
        "instruction": "Add the two numbers.",
        "input": "2 and 3" if with_input else "",
        "output": "2 + 3 = 5.",
    }
    row = run([rec], entry("alpaca"), tok).dataset[0]
    prompt = alpaca_prompt(rec["instruction"], rec["input"])
    assert ("### Input:" in prompt) is with_input
    prompt_ids, output_ids = ids(tok, prompt), ids(tok, rec["output"])
    assert row["input_ids"] == [tok.bos_token_id, *prompt_ids, *output_ids, tok.eos_token_id]
    assert trained(row) == [*output_ids, tok.eos_token_id]
    assert tok.decode(trained(row)) == "2 + 3 = 5.</s>"


def test_alpaca_train_on_inputs(tok) -> None:
    rec = {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "5"}
    row = run([rec], entry("alpaca", train_on_inputs=True), tok).dataset[0]
    assert row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]


def test_input_output_boundary_is_exact(llama) -> None:
    # Separate tokenization: no token straddles prompt and completion, whatever the merges.
    rec = {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 72 clips.\n#### 72"}
    e = entry("input_output", field_prompt="question", field_completion="answer")
    row = run([rec], e, llama).dataset[0]
    p, c = ids(llama, rec["question"]), ids(llama, rec["answer"])
    assert row["input_ids"] == [*p, *c, llama.eos_token_id]
    assert row["labels"] == [IGNORE_INDEX] * len(p) + [*c, llama.eos_token_id]


def test_tokenized_passthrough_and_checks(tok) -> None:
    vocab = len(tok)
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [5, -100, 7, 8]},
        {"input_ids": [5, 6, 7], "labels": None},
        {"input_ids": [5, vocab, 7], "labels": [5, 6, 7]},
        {"input_ids": [5, 6, 7], "labels": [-100, 6]},
        {"input_ids": [5, 6, 7], "labels": [-100, -5, 7]},
    ]
    res = run(rows, entry("tokenized"), tok, on_bad_row="skip")
    assert res.dataset[0]["input_ids"] == [5, 6, 7, 8]
    assert res.dataset[0]["labels"] == [IGNORE_INDEX, IGNORE_INDEX, 7, 8]  # labels[0] forced to -100
    assert res.dropped == {
        "bad_row:length_mismatch": 1,
        "bad_row:missing_field": 1,
        "bad_row:out_of_vocab": 2,
    }
    assert [(s["row"], s["field"], s["reason"]) for s in res.bad_row_samples] == [
        (1, "labels", "missing_field"),
        (2, "input_ids", "out_of_vocab"),
        (3, "labels", "length_mismatch"),
        (4, "labels", "out_of_vocab"),
    ]
    no_labels = run([{"input_ids": [5, 6, 7]}], entry("tokenized"), tok).dataset[0]
    assert no_labels["labels"] == [IGNORE_INDEX, 6, 7]
    floats = run([{"input_ids": [1.5, 2.0]}], entry("tokenized"), tok, on_bad_row="skip")
    assert floats.dropped == {"bad_row:wrong_type": 1}


# ------------------------------------------------------------------------------------ length policy


def long_and_short(tok) -> tuple[list[dict], int]:
    rows = [{"text": "one two three"}, {"text": " ".join(["word"] * 40)}, {"text": "four five"}]
    n_long = len(ids(tok, rows[1]["text"])) + 2  # bos + eos
    return rows, n_long


def test_length_drop(tok) -> None:
    rows, n_long = long_and_short(tok)
    res = run(rows, entry("completion"), tok, sequence_len=20)
    assert n_long > 20
    assert res.dropped == {"too_long": 1} and res.truncated == 0
    assert res.dataset["source_row"][:] == [0, 2]
    assert_accounted(res)


def test_length_truncate(tok) -> None:
    rows, _ = long_and_short(tok)
    res = run(rows, entry("completion"), tok, sequence_len=20, excess_length_strategy="truncate")
    assert res.truncated == 1 and res.dropped == {}
    assert [len(x) for x in res.dataset["input_ids"]][1] == 20
    assert all(
        len(i) == len(lab) for i, lab in zip(res.dataset["input_ids"], res.dataset["labels"], strict=True)
    )


def test_truncate_that_leaves_nothing_trainable_is_dropped(tok) -> None:
    rec = {"instruction": " ".join(["long"] * 50), "output": "short"}
    res = run([rec], entry("alpaca"), tok, sequence_len=30, excess_length_strategy="truncate")
    assert res.dropped == {"no_trainable_tokens": 1} and res.truncated == 0
    assert_accounted(res)


def test_length_raise(tok) -> None:
    rows, n_long = long_and_short(tok)
    with pytest.raises(DataError) as err:
        run(rows, entry("completion", path="d/x.jsonl"), tok, sequence_len=20, excess_length_strategy="raise",
            entry_label="data.datasets[4]")  # fmt: skip
    msg = str(err.value)
    assert "data.datasets[4]" in msg and "d/x.jsonl" in msg and "row 1" in msg
    assert f"{n_long} tokens" in msg and "limit of 20" in msg and "data.sequence_len" in msg
    assert "drop" in msg and "truncate" in msg


def test_entry_max_seq_len_wins(tok) -> None:
    rows, n_long = long_and_short(tok)
    assert len(run(rows, entry("completion", max_seq_len=n_long), tok, sequence_len=10).dataset) == 3
    res = run(rows, entry("completion", max_seq_len=3), tok, sequence_len=4096)
    assert res.dropped == {"too_long": 3}
    with pytest.raises(DataError, match=r"data.datasets\[0\].max_seq_len"):
        run(rows, entry("completion", max_seq_len=3), tok, excess_length_strategy="raise")


# ----------------------------------------------------------------------------------------- bad rows


def test_bad_row_raise_names_row_field_and_fix(tok) -> None:
    rows = [{"instruction": "Do it.", "output": "ok"}, {"instruction": None, "output": "x"}]
    with pytest.raises(DataError) as err:
        run(rows, entry("alpaca", path="data/a.jsonl"), tok, entry_label="data.datasets[1]")
    msg = str(err.value)
    assert "data.datasets[1]" in msg and "data/a.jsonl" in msg and "row 1" in msg
    assert "'instruction'" in msg and "missing or null" in msg and "on_bad_row: skip" in msg


def test_bad_rows_skip_counted_with_ten_samples(tok) -> None:
    rows = [{"text": "fine"} if i % 3 else {"text": None} for i in range(40)]
    res = run(rows, entry("completion"), tok, on_bad_row="skip", entry_label="data.datasets[0]")
    assert res.dropped == {"bad_row:missing_field": 14}
    assert len(res.bad_row_samples) == 10
    assert res.bad_row_samples[0] == {
        "dataset": "data.datasets[0]",
        "row": 0,
        "field": "text",
        "reason": "missing_field",
        "detail": "'text' is missing or null",
    }
    assert [s["row"] for s in res.bad_row_samples] == list(range(0, 30, 3))
    assert_accounted(res)


@pytest.mark.parametrize("on_bad_row", ["raise", "skip"])
def test_empty_completions_are_dropped_with_samples(tok, on_bad_row: str) -> None:
    # Kept, they would train nothing but an eos: dropped and counted in both modes, never an error.
    rows = [
        {"instruction": "Add 2 and 3.", "output": "5"},
        {"instruction": "Say nothing.", "output": ""},
        {"instruction": "Say a space.", "output": "  \n"},
    ]
    res = run(rows, entry("alpaca"), tok, on_bad_row=on_bad_row)
    assert res.dropped == {"empty_completion": 2} and res.dataset["source_row"][:] == [0]
    assert [(s["row"], s["field"], s["reason"]) for s in res.bad_row_samples] == [
        (1, "output", "empty_completion"),
        (2, "output", "empty_completion"),
    ]
    assert_accounted(res)
    pairs = [{"question": "Q?", "answer": ""}, {"question": "Q2?", "answer": "A2"}]
    e = entry("input_output", field_prompt="question", field_completion="answer")
    res = run(pairs, e, tok, on_bad_row=on_bad_row)
    assert res.dropped == {"empty_completion": 1} and res.bad_row_samples[0]["field"] == "answer"


def test_chat_with_only_empty_trained_turns_is_an_empty_completion(tok) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ]
    res = run(rows, entry("chat_template"), tok)
    assert res.dropped == {"empty_completion": 1} and res.bad_row_samples[0]["field"] == "messages"


def test_unknown_role_raise_names_row_field_and_fix(tok) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Abracadabra"}]},
    ]
    with pytest.raises(DataError) as err:
        run(rows, entry("chat_template", path="data/chat.jsonl"), tok)
    msg = str(err.value)
    assert "data/chat.jsonl" in msg and "row 1" in msg and "field 'messages[1].role'" in msg
    assert "'wizard'" in msg and "role_map" in msg and "on_bad_row: skip" in msg
    res = run(rows, entry("chat_template"), tok, on_bad_row="skip")
    assert res.dropped == {"bad_row:unknown_role": 1} and res.dataset["source_row"][:] == [0]


def test_roles_to_train_must_be_known_roles(tok) -> None:
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    with pytest.raises(
        DataError, match=r"roles_to_train: \['gpt'\].*role_map renames \{'gpt': 'assistant'\}"
    ):
        run(rows, entry("chat_template", roles_to_train=["gpt"], role_map={"gpt": "assistant"}), tok)
    res = run(rows, entry("chat_template", roles_to_train=["assistant", "tool"]), tok)
    assert len(res.dataset) == 1


def test_placeholder_rows_become_bad_rows(tok) -> None:
    # Rows that the readers loaded in place of damaged lines carry their reason in BAD_ROW_COLUMN.
    from finetune.data.sources.damage import BAD_ROW_COLUMN

    mark = "invalid_json\td.jsonl line 2 (byte 14): invalid JSON: Expecting value"
    ds = datasets.Dataset.from_dict({"text": ["fine", None, "also fine"], BAD_ROW_COLUMN: [None, mark, None]})
    res = run(ds, entry("completion"), tok, on_bad_row="skip")
    assert res.dropped == {"bad_row:invalid_json": 1} and res.dataset["source_row"][:] == [0, 2]
    assert res.dataset.column_names == ["input_ids", "labels", "source_row"]
    assert res.bad_row_samples[0] == {
        "dataset": "data.datasets[0]",
        "row": 1,
        "field": "",
        "reason": "invalid_json",
        "detail": "d.jsonl line 2 (byte 14): invalid JSON: Expecting value",
    }
    with pytest.raises(DataError, match=r"row 1: d\.jsonl line 2 \(byte 14\): invalid JSON"):
        run(ds, entry("completion"), tok)


def test_samples_are_kept_per_reason(tok) -> None:
    rows = [{"text": None}] * 15 + [{"text": 3}] * 2
    res = run(rows, entry("completion"), tok, on_bad_row="skip")
    reasons = [s["reason"] for s in res.bad_row_samples]
    assert reasons == ["missing_field"] * 10 + ["wrong_type"] * 2


def test_first_problem_in_row_order_is_raised(tok) -> None:
    rows = [{"text": "ok"}, {"text": " ".join(["w"] * 50)}, {"text": None}]
    with pytest.raises(DataError, match="row 1 is"):
        run(rows, entry("completion"), tok, sequence_len=10, excess_length_strategy="raise")


def test_accounting_mixed_reasons(tok) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": []},
        {"messages": None},
        {"messages": [{"role": "user", "content": "only a question"}]},  # nothing to train
        {"messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "3"}, {"role": "assistant", "content": None}]},
    ]
    res = run(rows, entry("chat_template"), tok, sequence_len=100, on_bad_row="skip")
    assert res.dropped == {
        "bad_row:empty_conversation": 1,
        "bad_row:missing_field": 2,
        "no_trainable_tokens": 1,
        "too_long": 1,
    }
    assert res.dataset["source_row"][:] == [0]
    assert_accounted(res)


def test_empty_and_all_dropped(tok) -> None:
    empty = datasets.Dataset.from_dict(
        {"text": []}, features=datasets.Features({"text": datasets.Value("string")})
    )
    res = run(empty, entry("completion"), tok)
    assert res.rows_in == 0 and len(res.dataset) == 0
    assert res.dataset.column_names == ["input_ids", "labels", "source_row"]
    res = run([{"text": None}, {"text": None}], entry("completion"), tok, on_bad_row="skip")
    assert res.rows_in == 2 and len(res.dataset) == 0 and res.dropped == {"bad_row:missing_field": 2}
    assert res.dataset.features["labels"].feature.dtype == "int32"


# ------------------------------------------------------------------------------------------ columns


def test_unknown_column_error(tok) -> None:
    with pytest.raises(DataError) as err:
        run([{"question": "q", "answer": "a"}], entry("input_output", field_prompt="questions"), tok)
    msg = str(err.value)
    assert "'questions'" in msg and "Did you mean 'question'?" in msg and "['question', 'answer']" in msg


def test_chat_without_template_is_an_error(llama) -> None:
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    with pytest.raises(DataError, match=r"model\.chat_template"):
        run(rows, entry("chat_template"), llama)


def test_options_are_checked(tok) -> None:
    with pytest.raises(ValueError, match="excess_length_strategy"):
        run([{"text": "a"}], entry("completion"), tok, excess_length_strategy="cut")
    with pytest.raises(ValueError, match="on_bad_row"):
        run([{"text": "a"}], entry("completion"), tok, on_bad_row="ignore")


# ------------------------------------------------------------------------------- processes and cache


@pytest.mark.slow  # num_proc 2: datasets forks worker processes
@pytest.mark.parametrize("kind", ["completion", "chat_template"])
def test_num_proc_gives_the_same_result(tok, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "completion":
        rows = [{"text": f"row number {i} " * (1 + i % 7)} for i in range(2500)]
        rows[7]["text"] = None
    else:
        rows = [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A " * (i % 9)}]}
                for i in range(1500)]  # fmt: skip
        rows[7]["messages"] = []
    ds = datasets.Dataset.from_list(rows)
    monkeypatch.setattr(tokenize_module, "MIN_ROWS_FOR_PROCESSES", 0)  # small data normally runs in-process
    used = []
    real_map = datasets.Dataset.map

    def spy(self, *args, **kwargs):
        used.append(kwargs.get("num_proc"))
        return real_map(self, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "map", spy)
    one = run(ds, entry(kind), tok, on_bad_row="skip", sequence_len=40)
    two = run(ds, entry(kind), tok, on_bad_row="skip", sequence_len=40, num_proc=2)
    assert used == [None, 2]
    assert one.dataset.to_dict() == two.dataset.to_dict()
    assert (one.dropped, one.rows_in, one.bad_row_samples) == (two.dropped, two.rows_in, two.bad_row_samples)
    assert sum(two.dropped.values()) >= 1
    assert_accounted(two)


def test_small_non_chat_data_stays_in_process() -> None:
    assert tokenize_module._worth_processes(False, 7473, 16) is None
    assert tokenize_module._worth_processes(True, 7473, 16) == 8  # chat rendering is Python-bound
    assert tokenize_module._worth_processes(True, 500, 16) is None
    assert tokenize_module._worth_processes(False, 200_000, 4) == 4


def test_datasets_cache_follows_the_entry(tok, tmp_path: Path) -> None:
    # Loaded from a file, the map result is cached by datasets: a changed setting must not reuse it.
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"instruction": "Say hi.", "output": "hi"}) + "\n")
    ds = load_source(entry("alpaca", path=str(path)))
    masked = run(ds, entry("alpaca", path=str(path)), tok).dataset[0]["labels"]
    again = run(ds, entry("alpaca", path=str(path)), tok).dataset[0]["labels"]
    unmasked = run(ds, entry("alpaca", path=str(path), train_on_inputs=True), tok).dataset[0]["labels"]
    assert masked == again and masked != unmasked


# -------------------------------------------------------------------------------------------- GSM8K


@needs_shared
def test_gsm8k_llama2_fast_and_exact(llama) -> None:
    e = entry("input_output", path=str(GSM8K), field_prompt="question", field_completion="answer")
    ds = load_source(e)
    start = time.perf_counter()
    res = tokenize_dataset(
        ds, e, llama, sequence_len=2048, excess_length_strategy="drop", on_bad_row="raise", num_proc=None
    )
    seconds = time.perf_counter() - start
    assert res.rows_in == len(res.dataset) == 7473 and res.dropped == {}
    assert seconds < 20, f"tokenizing GSM8K took {seconds:.1f}s"  # ~1-2 s on 2 cores; generous for CI noise
    for k in (0, 1234, 7472):
        row, src = res.dataset[k], ds[k]
        answer = ids(llama, src["answer"])
        assert trained(row) == [*answer, llama.eos_token_id]
        assert row["input_ids"] == [*ids(llama, src["question"]), *answer, llama.eos_token_id]
