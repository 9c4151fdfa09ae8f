"""Preference pairs and kto examples through the data wings: formats, tokenization (plain and chat-rendered, the shared-prefix
check, the pair length policy), packing (chosen_i, rejected_i side by side, never split), kto's KL
rows, and prepare() with its manifest, cache and Hub round trip."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from finetune.data.batching.collate import collate_preference
from finetune.data.batching.packing import pack_multipack
from finetune.data.batching.pairs import kto_kl_row, pack_examples
from finetune.data.formats import preference
from finetune.data.formats.preference import shared_prefix_problem
from finetune.data.formats.tokenize import fit_lengths, tokenize_dataset
from finetune.data.prepare import build as prepare_mod
from finetune.data.prepare.build import prepare
from finetune.errors import DataError
from finetune.losses.preference import kto_mismatched_completions
from finetune.recipe import DatasetEntry, dataset_entry, validate_recipe

IGNORE = -100
PAIRS = [
    {"prompt": "Compute 2 + 3.", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."},
    {"prompt": "Compute 7 * 3.", "chosen": "7 * 3 = 21.", "rejected": "7 * 3 = 24, I think."},
    {"prompt": "Is 4 less than 9?", "chosen": "Yes, 4 is less than 9.", "rejected": "No."},
]


@pytest.fixture(scope="module")
def tokenizer(repo_root: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(repo_root / "recipes" / "demo" / "tokenizer")  # ChatML, <s> bos


def entry(**fields) -> DatasetEntry:
    return dataset_entry(**{"path": "pairs.jsonl", "type": "preference", **fields})


def tokenize(
    rows: list[dict], tokenizer, *, limit: int = 256, strategy: str = "drop", on_bad_row="raise", **fields
):
    return tokenize_dataset(
        datasets.Dataset.from_list(rows),
        entry(**fields),
        tokenizer,
        sequence_len=limit,
        excess_length_strategy=strategy,
        on_bad_row=on_bad_row,
    )


def sides(example: dict) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of the chosen and the rejected sequence of a tokenized pair."""
    n = example["chosen_len"]
    ids, labels = example["input_ids"], example["labels"]
    return [(ids[:n], labels[:n]), (ids[n:], labels[n:])]


def trained_text(tokenizer, labels: list[int]) -> str:
    return tokenizer.decode([t for t in labels if t != IGNORE])


# ------------------------------------------------------------------------------------------ formats


def test_conversations_drop_a_repeated_prompt_and_find_the_implicit_one():
    user = {"role": "user", "content": "2+2?"}
    row = preference.CompletionsRow(
        "2+2?",
        ([user, {"role": "assistant", "content": "4"}], [user, {"role": "assistant", "content": "5"}]),
    )
    shared, (chosen, _) = preference.completion_conversations(row, "chosen")
    assert shared == [user] and chosen == [{"role": "assistant", "content": "4"}]
    implicit = preference.CompletionsRow(None, row.completions)
    assert preference.completion_conversations(implicit, "chosen")[0] == [user]
    kto = preference.CompletionsRow(None, ([user, {"role": "assistant", "content": "4"}],), True)
    assert preference.completion_conversations(kto, "completion") == (
        [user],
        [[{"role": "assistant", "content": "4"}]],
    )


# ------------------------------------------------------------------------------------------ tokenize


def test_plain_pairs_share_the_prompt_tokens_and_train_only_the_completions(tokenizer):
    result = tokenize(PAIRS, tokenizer)
    assert len(result.dataset) == 3 and result.dropped == {}
    for pair, example in zip(PAIRS, result.dataset, strict=True):
        (c_ids, c_labels), (r_ids, r_labels) = sides(example)
        prompt = len(tokenizer(pair["prompt"])["input_ids"])  # with the bos
        assert c_ids[:prompt] == r_ids[:prompt] and c_ids[0] == tokenizer.bos_token_id
        assert trained_text(tokenizer, c_labels) == pair["chosen"] + "</s>"
        assert trained_text(tokenizer, r_labels) == pair["rejected"] + "</s>"
        assert c_labels[0] == r_labels[0] == IGNORE


def test_chat_rendered_pairs_train_the_assistant_turn_and_its_end(tokenizer):
    result = tokenize(PAIRS, tokenizer, apply_chat_template=True)
    for pair, example in zip(PAIRS, result.dataset, strict=True):
        (c_ids, c_labels), (r_ids, r_labels) = sides(example)
        assert trained_text(tokenizer, c_labels) == pair["chosen"] + "<|im_end|>"
        assert trained_text(tokenizer, r_labels) == pair["rejected"] + "<|im_end|>"
        first = c_labels.index(next(t for t in c_labels if t != IGNORE))
        assert c_ids[:first] == r_ids[:first]  # the shared conversation, token for token
        assert tokenizer.decode(c_ids[:first]).endswith("<|im_start|>assistant\n")


def test_message_pairs_score_only_the_completion_turns(tokenizer):
    """A multi-turn prompt: its assistant turn is context, not trained; chosen / rejected hold the whole
    conversation (as UltraFeedback) and the prompt column repeats its first turn."""
    history = [
        {"role": "user", "content": "Compute 2 + 3."},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And plus 4?"},
    ]
    row = {
        "prompt": "Compute 2 + 3.",
        "chosen": [*history, {"role": "assistant", "content": "5 + 4 = 9."}],
        "rejected": [*history, {"role": "assistant", "content": "5 + 4 = 10."}],
    }
    (example,) = tokenize([row], tokenizer).dataset
    (c_ids, c_labels), (_, r_labels) = sides(example)
    assert trained_text(tokenizer, c_labels) == "5 + 4 = 9.<|im_end|>"
    assert trained_text(tokenizer, r_labels) == "5 + 4 = 10.<|im_end|>"
    assert tokenizer.decode(c_ids).count("2 + 3 = 5.") == 1


def test_a_template_that_changes_with_the_completion_is_a_bad_row(tokenizer):
    """The system line depends on the last message: the chat masking cannot follow it (as for SFT)."""
    template = (
        "{{ 'system: ' + (messages[-1]['content'] | length | string) + '\\n' }}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = template
    with pytest.raises(DataError, match=r"row 0: field 'chosen': could not locate message 1's content"):
        tokenize(PAIRS, tokenizer, apply_chat_template=True)
    skipped = tokenize(PAIRS, tokenizer, apply_chat_template=True, on_bad_row="skip")
    assert skipped.dropped == {"bad_row:template_mismatch": 3}


def _encoding(pieces: list[str]) -> SimpleNamespace:
    """A stand-in for a tokenizers.Encoding: one id per piece (its text), with character offsets."""
    offsets, start = [], 0
    for piece in pieces:
        offsets.append((start, start + len(piece)))
        start += len(piece)
    return SimpleNamespace(ids=list(pieces), offsets=offsets)


def test_the_shared_prefix_must_render_and_tokenize_the_same():
    chosen, rejected = "<u>Hi</u> It is", "<u>Hi</u> 4"
    spans = [[(10, 15)], [(10, 11)]]
    # A token may merge the prompt's trailing space with the completion (Llama's "▁It"): allowed.
    merged = [_encoding(["<u>", "Hi", "</u>", " It", " is"]), _encoding(["<u>", "Hi", "</u>", " ", "4"])]
    assert shared_prefix_problem([chosen, rejected], spans, merged) is None
    split = [_encoding(["<u>", "Hi", "</u>", " It", " is"]), _encoding(["<u>", "H", "i", "</u>", " ", "4"])]
    assert "tokenizes differently" in shared_prefix_problem([chosen, rejected], spans, split)
    other = "<u>Ho</u> 4"
    problem = shared_prefix_problem([chosen, other], spans, merged)
    assert "renders the shared conversation differently" in problem and "character 4" in problem


@pytest.mark.parametrize("strategy", ["drop", "raise", "truncate"])
def test_the_length_limit_applies_to_the_pair(tokenizer, strategy):
    lengths = [len(s[0]) for s in sides(tokenize(PAIRS[1:2], tokenizer).dataset[0])]
    limit = sum(lengths) - 3  # each sequence fits alone, the pair does not
    if strategy == "raise":
        with pytest.raises(
            DataError, match=rf"row 0 is {sum(lengths)} tokens, longer than the limit of {limit}"
        ):
            tokenize(PAIRS[1:2], tokenizer, limit=limit, strategy=strategy)
        return
    result = tokenize(PAIRS[1:2], tokenizer, limit=limit, strategy=strategy)
    if strategy == "drop":
        assert result.dropped == {"too_long": 1} and len(result.dataset) == 0
        return
    assert result.truncated == 1
    kept = [len(s[0]) for s in sides(result.dataset[0])]
    assert kept == fit_lengths(lengths, limit) and sum(kept) == limit
    assert all(any(t != IGNORE for t in labels) for _, labels in sides(result.dataset[0]))


def test_a_pair_whose_completion_is_truncated_away_is_dropped(tokenizer):
    prompt = len(tokenizer(PAIRS[0]["prompt"])["input_ids"])
    result = tokenize(PAIRS[:1], tokenizer, limit=2 * prompt, strategy="truncate")
    assert result.dropped == {"no_trainable_tokens": 1}


def test_kto_examples_carry_their_label_and_prompt_length(tokenizer):
    rows = [
        {"prompt": p["prompt"], "completion": p["chosen"], "label": i % 2 == 0} for i, p in enumerate(PAIRS)
    ]
    result = tokenize_dataset(
        datasets.Dataset.from_list(rows),
        dataset_entry(path="k.jsonl", type="kto", apply_chat_template=True),
        tokenizer,
        sequence_len=128,
        excess_length_strategy="drop",
        on_bad_row="raise",
    )
    for row, example in zip(rows, result.dataset, strict=True):
        assert example["desirable"] == row["label"]
        assert trained_text(tokenizer, example["labels"]) == row["completion"] + "<|im_end|>"
        p = example["prompt_len"]
        assert example["labels"][p] != IGNORE and set(example["labels"][:p]) == {IGNORE}


# ------------------------------------------------------------------------------------------- packing


def _pairs_dataset(tokenizer, n: int = 6):
    rows = [
        {"prompt": f"Compute {i} + {i}.", "chosen": f"{i} + {i} = {2 * i}.", "rejected": f"{i + 1}."}
        for i in range(n)
    ]
    return tokenize(rows, tokenizer).dataset


def test_packed_rows_hold_whole_pairs_chosen_then_rejected(tokenizer):
    ds = _pairs_dataset(tokenizer)
    lengths = [len(x) for x in ds["input_ids"]]
    bins = pack_multipack(lengths, capacity=2 * max(lengths) + 5)
    rows = pack_examples(ds, bins, "preference", pad_to_multiple_of=8, pad_token_id=3)
    assert rows["num_units"] == [len(b) for b in bins] and sum(rows["num_units"]) == len(ds)
    for row, b in zip(rows, bins, strict=True):
        expected = [
            seq
            for i in b
            for seq in (ds[i]["input_ids"][: ds[i]["chosen_len"]], ds[i]["input_ids"][ds[i]["chosen_len"] :])
        ]
        assert row["seq_lens"][: 2 * len(b)] == [len(s) for s in expected]
        assert row["input_ids"][: sum(map(len, expected))] == [t for s in expected for t in s]
        starts = [k for k, p in enumerate(row["position_ids"]) if p == 0]
        assert starts[: 2 * len(b)] == [sum(map(len, expected[:j])) for j in range(2 * len(b))]
        assert len(row["input_ids"]) % 8 == 0


def test_unpacked_rows_hold_one_pair_each(tokenizer):
    ds = _pairs_dataset(tokenizer, 3)
    rows = pack_examples(ds, None, "preference", pad_to_multiple_of=None, pad_token_id=3)
    assert rows["num_units"] == [1, 1, 1] and rows["input_ids"] == ds["input_ids"]
    assert [r[:2] for r in rows["seq_lens"]] == [
        [c, len(x) - c] for c, x in zip(ds["chosen_len"], ds["input_ids"], strict=True)
    ]


def test_kto_kl_rows_pair_each_prompt_with_the_previous_completion():
    prompts = [[1, 10, 11], [1, 20], [1, 30, 31, 32]]
    completions = [[12, 2], [21, 22, 2], [33, 2]]
    ids = [t for p, c in zip(prompts, completions, strict=True) for t in (*p, *c)]
    labels = [t for p, c in zip(prompts, completions, strict=True) for t in ([IGNORE] * len(p) + c)]
    seq_lens = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)] + [2]
    kl_ids, kl_labels, kl_pos = kto_kl_row(
        [*ids, 0, 0], [*labels, IGNORE, IGNORE], seq_lens, [len(p) for p in prompts]
    )
    mismatched = kto_mismatched_completions(completions)  # TRL's rotation
    assert kl_ids == [t for p, c in zip(prompts, mismatched, strict=True) for t in (*p, *c)] + [0, 0]
    assert [t for t in kl_labels if t != IGNORE] == [t for c in mismatched for t in c]
    assert kl_pos == [*range(5), *range(4), *range(7), 0, 1] and len(kl_ids) == len(ids) + 2


def test_the_collator_builds_kto_kl_rows_and_flags(tokenizer):
    rows = [{"prompt": f"Q{i}?", "completion": f"A{i}.", "label": i != 1} for i in range(3)]
    ds = tokenize_dataset(
        datasets.Dataset.from_list(rows),
        dataset_entry(path="k.jsonl", type="kto"),
        tokenizer,
        sequence_len=64,
        excess_length_strategy="drop",
        on_bad_row="raise",
    ).dataset
    packed = pack_examples(ds, [[0, 1, 2]], "kto", pad_to_multiple_of=8, pad_token_id=3)
    batch = collate_preference(list(packed), pad_token_id=3)
    assert batch["desirable"].tolist() == [True, False, True] and batch["num_units"].tolist() == [3]
    assert batch["kl_input_ids"].shape == batch["input_ids"].shape
    assert sorted(batch["kl_input_ids"][0].tolist()) == sorted(batch["input_ids"][0].tolist())
    assert not torch.equal(batch["kl_input_ids"], batch["input_ids"])


# ------------------------------------------------------------------------------------------ prepare


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _recipe(tmp_path: Path, repo_root: Path, **data):
    pairs = [
        {"question": f"Compute {i} + 1.", "good": f"{i} + 1 = {i + 1}.", "bad": f"{i} + 1 = {i + 2}."}
        for i in range(40)
    ]
    pairs += [
        {"question": "Long?", "good": "yes " * 200, "bad": "no"},
        {"question": "x", "good": None, "bad": "y"},
    ]
    path = _write(tmp_path / "pairs.jsonl", pairs)
    entry = {
        "path": str(path),
        "type": "preference",
        "field_prompt": "question",
        "field_chosen": "good",
        "field_rejected": "bad",
    }
    return validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama"},
                "tokenizer_path": str(repo_root / "recipes/demo/tokenizer"),
            },
            "data": {
                "datasets": [entry],
                "val_set_size": 4,
                "sequence_len": 96,
                "sample_packing_sequence_len": 128,
                "pad_to_multiple_of": 8,
                "on_bad_row": "skip",
                "dataset_num_proc": 1,
                "dataset_prepared_path": str(tmp_path / "prepared"),
                **data,
            },
            "train": {"output_dir": str(tmp_path / "out"), "objective": "dpo"},
        }
    )


def test_prepare_counts_pairs_caches_and_round_trips_through_the_hub(
    tmp_path, repo_root, hub_repo_id, monkeypatch
):
    recipe = _recipe(tmp_path, repo_root, push_dataset_to_hub=hub_repo_id)
    built = prepare(recipe, log=lambda _: None)
    m = built.manifest
    assert m["kind"] == "preference"
    assert (m["rows_in"], m["rows_kept"], m["dropped"]) == (
        42,
        40,
        {"bad_row:missing_field": 1, "too_long": 1},
    )
    assert m["splits"]["train"]["examples"] == 36 and m["splits"]["eval"]["examples"] == 4
    assert sum(built.train["num_units"]) == 36 and sum(built.eval["num_units"]) == 4
    assert prepare(recipe, log=lambda _: None).source == "cache"
    # The field mappings are part of the fingerprint.
    renamed = recipe.model_copy(deep=True)
    renamed.data.datasets[0].field_rejected = "good"
    renamed.data.datasets[0].field_chosen = "bad"
    assert prepare_mod.compute_fingerprint(prepare_mod.fingerprint_inputs(renamed)) != m["fingerprint"]

    monkeypatch.setattr(
        prepare_mod, "tokenize_dataset", lambda *a, **k: pytest.fail("the Hub copy should be used")
    )
    elsewhere = recipe.model_copy(deep=True)
    elsewhere.data.dataset_prepared_path = str(tmp_path / "elsewhere")
    pulled = prepare(elsewhere, log=lambda _: None)
    assert pulled.source == "hub" and pulled.manifest["kind"] == "preference"
    assert [dict(r) for r in pulled.train] == [dict(r) for r in built.train]


def test_prepare_warns_when_kto_examples_are_alone_in_their_rows(tmp_path, repo_root):
    rows = [
        {"prompt": f"Q{i}", "completion": "word " * 20, "label": i % 3 != 0}  # ~25 tokens: no two fit in 40
        for i in range(20)
    ]
    path = _write(tmp_path / "kto.jsonl", rows)
    recipe = validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama"},
                "tokenizer_path": str(repo_root / "recipes/demo/tokenizer"),
            },
            "data": {
                "datasets": [{"path": str(path), "type": "kto"}],
                "sequence_len": 40,
                "dataset_num_proc": 1,
                "dataset_prepared_path": str(tmp_path / "prepared"),
            },
            "train": {"output_dir": str(tmp_path / "out"), "objective": "kto"},
        }
    )
    lines: list[str] = []
    prepared = prepare(recipe, log=lines.append)
    assert (
        prepared.manifest["kind"] == "kto"
        and prepared.manifest["splits"]["train"]["examples_alone_in_row"] > 0
    )
    assert any(line.startswith("warning: train:") and "alone in their packed row" in line for line in lines)
    flags = [d for row in prepared.train["desirable"] for d in row]
    assert sorted(flags) == sorted(r["label"] for r in rows)


def test_objective_and_dataset_types_must_agree():
    from pydantic import ValidationError

    base = {"model": {"model_path": "org/m"}, "train": {"output_dir": "o"}}
    with pytest.raises(ValidationError, match=r"needs train.objective dpo, ipo, simpo, orpo or reward"):
        validate_recipe({**base, "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]}})
    with pytest.raises(ValidationError, match=r"train.objective kto trains on examples .* use type kto"):
        validate_recipe(
            {
                **base,
                "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
                "train": {"output_dir": "o", "objective": "kto"},
            }
        )
    with pytest.raises(ValidationError, match=r"simpo_gamma: belongs to train.objective simpo, not 'dpo'"):
        validate_recipe(
            {
                **base,
                "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
                "train": {"output_dir": "o", "objective": "dpo", "simpo_gamma": 1.0},
            }
        )


def test_prepare_trains_completions_that_look_like_json_as_the_strings_they_are(tmp_path, repo_root):
    """A completion column mixing strings with lists of messages: "42", "null" and "[1, 2]" train as
    those strings (datasets' Json column read them as 42, None and a list, refused as not text)."""
    answers = ["42", "null", "[1, 2]"]
    rows = [{"prompt": f"Answer {i}.", "completion": a, "label": True} for i, a in enumerate(answers)]
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hello"}]
    rows.append({"prompt": messages[:1], "completion": messages[1:], "label": False})
    path = _write(tmp_path / "kto.jsonl", rows)
    recipe = validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama"},
                "tokenizer_path": str(repo_root / "recipes/demo/tokenizer"),
            },
            "data": {
                "datasets": [{"path": str(path), "type": "kto", "apply_chat_template": True}],
                "sequence_len": 64,
                "dataset_num_proc": 1,
                "dataset_prepared_path": str(tmp_path / "prepared"),
            },
            "train": {"output_dir": str(tmp_path / "out"), "objective": "kto"},
        }
    )
    prepared = prepare(recipe, log=lambda _: None)
    assert prepared.manifest["rows_kept"] == 4 and prepared.manifest["dropped"] == {}
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(repo_root / "recipes/demo/tokenizer")
    trained = []
    for labels, seq_lens in zip(prepared.train["labels"], prepared.train["seq_lens"], strict=True):
        starts = [sum(seq_lens[:k]) for k in range(len(seq_lens))]
        trained += [trained_text(tokenizer, labels[a : a + n]) for a, n in zip(starts, seq_lens, strict=True)]
    # (kto's KL examples, mismatched completions, train nothing)
    assert sorted(t for t in trained if t) == sorted(f"{a}<|im_end|>" for a in [*answers, "hello"])
