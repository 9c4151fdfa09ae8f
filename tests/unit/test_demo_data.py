"""The embedded demo's generated data and the shipped demo tokenizer (recipes/demo)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo"
TOKENIZER_DIR = DEMO / "tokenizer"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_demo_data", DEMO / "make_demo_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_a")
    gen.main(["--out-dir", str(out), "--num-rows", "120", "--seed", "3"])
    return out


def test_generator_is_deterministic(generated, tmp_path):
    gen.main(["--out-dir", str(tmp_path), "--num-rows", "120", "--seed", "3"])
    a, b = _tree(generated), _tree(tmp_path)
    assert set(a) >= {
        "data/arithmetic.jsonl",
        "data/chat.jsonl",
        "data/sharegpt.jsonl",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    }
    assert a == b


def test_seed_changes_rows(generated, tmp_path):
    gen.generate(tmp_path, num_rows=120, seed=4)
    assert (tmp_path / "data/arithmetic.jsonl").read_bytes() != (
        generated / "data/arithmetic.jsonl"
    ).read_bytes()


def test_arithmetic_schema(generated):
    rows = _read_jsonl(generated / "data" / "arithmetic.jsonl")
    assert len(rows) == 120
    for row in rows:
        assert set(row) == {"instruction", "input", "output"}
        assert all(isinstance(v, str) for v in row.values())
        assert row["instruction"] and row["output"]
    assert any(r["input"] == "" for r in rows)
    assert len({json.dumps(r) for r in rows}) > len(rows) // 2  # rows vary


def test_arithmetic_answers_are_correct():
    import random

    rng = random.Random(0)
    for _ in range(200):
        _, _, out, value = gen.task_add(rng)
        lhs, rhs = out.rstrip(".").split(" = ")
        a, b = (int(x) for x in lhs.split(" + "))
        assert a + b == int(rhs) == value


def test_chat_schema(generated):
    rows = _read_jsonl(generated / "data" / "chat.jsonl")
    assert len(rows) == 12
    for row in rows:
        assert set(row) == {"messages"}
        msgs = row["messages"]
        roles = [m["role"] for m in msgs]
        assert set(roles) <= {"system", "user", "assistant"}
        assert "system" not in roles[1:]
        turns = roles[1:] if roles[0] == "system" else roles
        assert turns and turns == ["user", "assistant"] * (len(turns) // 2)
        assert all(set(m) == {"role", "content"} and m["content"] for m in msgs)


def test_sharegpt_schema(generated):
    rows = _read_jsonl(generated / "data" / "sharegpt.jsonl")
    assert len(rows) == 4
    for row in rows:
        assert set(row) == {"conversations"}
        froms = [t["from"] for t in row["conversations"]]
        turns = froms[1:] if froms[0] == "system" else froms
        assert turns and turns == ["human", "gpt"] * (len(turns) // 2)
        assert all(set(t) == {"from", "value"} and t["value"] for t in row["conversations"])


# ---------------------------------------------------------------------------------------------
# Shipped tokenizer
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def test_shipped_files_are_small():
    total = sum(p.stat().st_size for d in ("data", "tokenizer") for p in (DEMO / d).rglob("*") if p.is_file())
    # The budget of every demo's data and tokenizer together: 1 MB until the GRPO-on-images demo's prompt
    # files (57 kB: 540 one-line prompts naming images the other VLM demos already ship) came in.
    assert total < 1_100_000
    assert sum(p.stat().st_size for p in TOKENIZER_DIR.rglob("*") if p.is_file()) < 300_000


def test_special_tokens(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in gen.SPECIAL_TOKENS}
    assert ids == {t: i for i, t in enumerate(gen.SPECIAL_TOKENS)}
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert tok.unk_token_id not in {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    # Each special token is one token, also inside text.
    enc = tok("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert enc[0] == ids["<|im_start|>"] and enc[-1] == ids["<|im_end|>"]


def test_bos_prepended_no_eos(tok):
    ids = tok("What is 1 plus 2?")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.bos_token_id not in ids[1:]
    assert tok.eos_token_id not in ids
    assert tok("What is 1 plus 2?", add_special_tokens=False)["input_ids"] == ids[1:]


def test_digits_split_individually(tok):
    ids = tok("12345", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == list("12345")


@pytest.mark.parametrize(
    "text",
    [
        "What is 37 plus 45?",
        "37 + 45 = 82.",
        "Reverse the list: cat, dog, sun.\n\n  indented   spaces  ",
        "Line one\nLine two\r\n\ttab 1000000 -7 3.14",
        "Unicode still round-trips: café naïve 東京 🙂",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_round_trip_shipped_rows(tok):
    rows = _read_jsonl(DEMO / "data" / "arithmetic.jsonl")[:200]
    for row in rows:
        for value in row.values():
            assert tok.decode(tok(value)["input_ids"], skip_special_tokens=True) == value


def test_chat_template_renders_chatml(tok):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
        "<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected.rsplit("<|im_start|>assistant", 1)[0] + "<|im_start|>assistant\n"
    assert "<s>" not in prompt


def test_chat_template_assistant_mask(tok):
    messages = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
    ]
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    kept = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(kept) == "2 + 3 = 5.<|im_end|>"
