"""Tool calling conversations: the trained tokens are exactly the assistant's text and tool calls plus
its end-of-turn token, under the real templates of Llama 3.1, Qwen2.5, Qwen3 and Mistral
(tests/unit/data/templates/, see its README); tool results, system, user and tool definitions are not
trained. The tokenizer is the demo byte-level BPE with each template's special tokens added.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import DataError
from finetune.recipe import KNOWN_CHAT_TEMPLATES, dataset_entry

REPO = Path(__file__).resolve().parents[4]
TEMPLATES = Path(__file__).parents[1] / "templates"
SPECIALS = [
    *("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    *("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
    *("[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


def call(name: str, arguments, call_id: str, *, openai: bool = True) -> dict:
    """A tool call: OpenAI form (arguments a JSON string) or HF form (a mapping)."""
    args = json.dumps(arguments) if openai else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def calling(*calls, content=None) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def result(text: str, call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


USER = {"role": "user", "content": "What is the weather in Paris?"}
CONVERSATIONS = {
    # system, a call (OpenAI form, content null), its result, the answer
    "call_then_answer": [
        {"role": "system", "content": "You are a helpful assistant."},
        USER,
        calling(call("get_weather", {"city": "Paris"}, "call00001")),
        result("22 C and sunny", "call00001"),
        {"role": "assistant", "content": "It is 22 C and sunny in Paris."},
    ],
    # two calls in a row (HF form, content ""), each with its result
    "two_steps": [
        {"role": "user", "content": "Add 2 and 3, then add 10 to it."},
        calling(call("add", {"a": 2, "b": 3}, "call00001", openai=False), content=""),
        result("5", "call00001"),
        calling(call("add", {"a": 5, "b": 10}, "call00002", openai=False), content=""),
        result("15", "call00002"),
        {"role": "assistant", "content": "The result is 15."},
    ],
    # a chat before the tool use: Mistral puts the tools and the system prompt into the last user
    # turn, Llama 3.1 the tools into the first, so earlier turns render differently in a prefix
    "chat_then_call": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        USER,
        calling(call("get_weather", {"city": "Paris"}, "call00004")),
        result("22 C", "call00004"),
        {"role": "assistant", "content": "22 C."},
    ],
    # the conversation ends with the call (the model's next move is to call)
    "ends_with_call": [USER, calling(call("get_weather", {"city": "Paris"}, "call00003"))],
}


def call_text(template: str, name: str, arguments: dict, call_id: str) -> str:
    """How each template writes one call (what the model must learn to emit)."""
    args = json.dumps(arguments)
    return {
        "llama31": f'{{"name": "{name}", "parameters": {args}}}',
        "qwen25": f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
        "qwen3": f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
        "mistral": f'[TOOL_CALLS][{{"name": "{name}", "arguments": {args}, "id": "{call_id}"}}]',
    }[template]


SETUPS = {  # name: (template file, end-of-turn text)
    "llama31": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|eot_id|>"),
    "qwen25": ("Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_end|>"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "<|im_end|>"),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "</s>"),
}


@pytest.fixture(scope="module")
def tok():
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "recipes" / "demo" / "tokenizer"))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


def tokenize(rows, tokenizer, template=None, *, on_bad_row="raise", **entry_kw):
    ds = datasets.Dataset.from_list(rows)
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


def trained_texts(row: dict, tokenizer) -> list[str]:
    """The maximal runs of trained tokens, decoded."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        trained = label != IGNORE_INDEX
        if trained:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = trained
    return [tokenizer.decode(run) for run in runs]


def expected(setup: str, conv: list[dict], eot: str) -> list[str]:
    """Each assistant turn's text or calls, and its end-of-turn text."""
    out = []
    for m in conv:
        if m["role"] != "assistant":
            continue
        if m.get("tool_calls"):
            (c,) = m["tool_calls"]  # one call per turn: Llama 3.1 takes no more
            args = c["function"]["arguments"]
            args = json.loads(args) if isinstance(args, str) else args
            out.append(call_text(setup, c["function"]["name"], args, c["id"]) + eot)
        else:
            out.append(m["content"] + eot)
    return out


@pytest.mark.parametrize("conv_name", list(CONVERSATIONS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_trained_tokens_are_the_assistant_text_and_calls(tok, setup: str, conv_name: str) -> None:
    file, eot = SETUPS[setup]
    conv = CONVERSATIONS[conv_name]
    rows = [{"messages": conv, "tools": json.dumps([WEATHER, ADD])}]
    row = tokenize(rows, tok, (TEMPLATES / file).read_text()).dataset[0]
    assert trained_texts(row, tok) == expected(setup, conv, eot)
    text = tok.decode(row["input_ids"])
    assert '"description": "The weather in a city"' in text  # the definitions reach the template


def test_text_before_the_calls_is_trained_with_them(tok) -> None:
    conv = [USER, calling(call("get_weather", {"city": "Paris"}, "c1"), content="Let me check.")]
    template = (TEMPLATES / SETUPS["qwen25"][0]).read_text()
    row = tokenize([{"messages": conv, "tools": [WEATHER]}], tok, template).dataset[0]
    # Qwen writes the text, a newline, then the call: one trained run with the end token.
    assert trained_texts(row, tok) == [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_train_on_eos_applies_to_turns_with_calls(tok, setup: str) -> None:
    file, eot = SETUPS[setup]
    conv = CONVERSATIONS["call_then_answer"]
    rows = [{"messages": conv, "tools": [WEATHER]}]
    call_turn, reply = expected(setup, conv, eot)
    template = (TEMPLATES / file).read_text()
    last = tokenize(rows, tok, template, train_on_eos="last").dataset[0]
    assert trained_texts(last, tok) == [call_turn.removesuffix(eot), reply]
    none = tokenize(rows, tok, template, train_on_eos="none").dataset[0]
    assert trained_texts(none, tok) == [call_turn.removesuffix(eot), reply.removesuffix(eot)]


def test_parallel_calls(tok) -> None:
    calls = [
        call("get_weather", {"city": "Paris"}, "call00001"),
        call("get_weather", {"city": "Rome"}, "call00002"),
    ]
    conv = [USER, calling(*calls)]
    qwen = tokenize([{"messages": conv}], tok, (TEMPLATES / SETUPS["qwen25"][0]).read_text()).dataset[0]
    one = call_text("qwen25", "get_weather", {"city": "Paris"}, "")
    two = call_text("qwen25", "get_weather", {"city": "Rome"}, "")
    assert trained_texts(qwen, tok) == [f"{one}\n{two}<|im_end|>"]
    # Llama 3.1's template raises on more than one call: a bad row with the template's words.
    with pytest.raises(DataError, match="only supports single tool-calls"):
        tokenize([{"messages": conv}], tok, (TEMPLATES / SETUPS["llama31"][0]).read_text())


def test_bad_tool_calls_are_counted_bad_rows(tok) -> None:
    ok = CONVERSATIONS["ends_with_call"]
    not_json = [USER, calling({"id": "c1", "function": {"name": "get_weather", "arguments": "{city: Paris"}})]
    no_name = [USER, calling({"id": "c1", "function": {"arguments": "{}"}})]
    list_args = [USER, calling({"id": "c1", "function": {"name": "add", "arguments": "[1, 2]"}})]
    orphan = [USER, result("22 C", "c1"), calling(call("add", {"a": 1, "b": 2}, "c2"))]
    rows = [{"messages": m} for m in (ok, not_json, no_name, list_args, orphan)]
    template = (TEMPLATES / SETUPS["qwen25"][0]).read_text()
    out = tokenize(rows, tok, template, on_bad_row="skip")
    assert len(out.dataset) == 1
    assert out.dropped == {
        "bad_row:bad_tool_call": 2,
        "bad_row:missing_field": 1,
        "bad_row:orphan_tool_result": 1,
    }
    fields = {s["row"]: s["field"] for s in out.bad_row_samples}
    assert fields == {
        1: "messages[1].tool_calls[0].function.arguments",
        2: "messages[1].tool_calls[0].function.name",
        3: "messages[1].tool_calls[0].function.arguments",
        4: "messages[1]",
    }
    with pytest.raises(
        DataError, match=r"row 1: field 'messages\[1\].tool_calls\[0\].function.arguments'.*not valid JSON"
    ):
        tokenize(rows, tok, template)


def test_deeply_nested_arguments_and_tools_are_counted_bad_rows(tok) -> None:
    """Arguments nested 100,000 deep were a RecursionError out of json.loads, and a few hundred levels one
    inside the template's tojson (counted under a false reason): bad rows that say so. 100 levels pass."""

    def nested(depth: int) -> str:  # {"a": [[...]]}: depth levels in all
        return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    def deep_call(depth: int) -> list[dict]:
        return [USER, calling({"id": "c1", "function": {"name": "add", "arguments": nested(depth)}})]

    deep_tools = json.dumps([WEATHER])[:-1] + ", " + "[" * 100_000 + "]" * 100_000 + "]"
    rows = [
        {"messages": deep_call(100_000), "tools": None},
        {"messages": deep_call(900), "tools": None},
        {"messages": deep_call(100), "tools": None},
        {"messages": CONVERSATIONS["ends_with_call"], "tools": deep_tools},
    ]
    template = (TEMPLATES / SETUPS["qwen25"][0]).read_text()
    out = tokenize(rows, tok, template, on_bad_row="skip", field_tools="tools")
    assert len(out.dataset) == 1  # the call 100 levels deep
    assert out.dropped == {"bad_row:bad_tool_call": 2, "bad_row:bad_tools": 1}
    details = {s["row"]: (s["field"], s["detail"]) for s in out.bad_row_samples}
    arguments = "messages[1].tool_calls[0].function.arguments"
    assert details[0][0] == arguments and "nests too deeply to parse" in details[0][1]
    assert details[1][0] == arguments and "nests more than 100 levels deep" in details[1][1]
    assert details[3][0] == "tools" and "nests too deeply" in details[3][1]
    with pytest.raises(
        DataError, match=r"row 0: field 'messages\[1\].tool_calls\[0\].function.arguments'.*deeply"
    ):
        tokenize(rows, tok, template, field_tools="tools")


def test_bad_tools_column_is_a_bad_row(tok) -> None:
    conv = CONVERSATIONS["ends_with_call"]
    rows = [{"messages": conv, "tools": t} for t in ("[{broken", '{"name": "x"}', json.dumps([WEATHER]))]
    out = tokenize(rows, tok, (TEMPLATES / SETUPS["qwen3"][0]).read_text(), on_bad_row="skip")
    assert out.dropped == {"bad_row:bad_tools": 2} and len(out.dataset) == 1


def test_template_without_tools_is_an_error_naming_template_and_row(tok) -> None:
    conv = [USER, {"role": "assistant", "content": "Sunny."}]
    rows = [{"messages": conv, "tools": None}, {"messages": conv, "tools": [WEATHER]}]
    # Even with on_bad_row: skip: every row with tools would lose them.
    with pytest.raises(
        DataError, match=r"row 1: field 'tools'.*model.chat_template 'chatml'.*no `tools` variable"
    ):
        tokenize(rows, tok, KNOWN_CHAT_TEMPLATES["chatml"], on_bad_row="skip")
    # A template that renders tools but not an assistant's calls would drop the calls.
    calls_only = [{"messages": CONVERSATIONS["ends_with_call"]}]
    with pytest.raises(DataError, match="does not render the tool calls of message 1"):
        tokenize(calls_only, tok, KNOWN_CHAT_TEMPLATES["chatml"], on_bad_row="skip")


def test_rows_without_tools_are_unchanged(tok) -> None:
    conv = [USER, {"role": "assistant", "content": "Sunny."}]
    template = (TEMPLATES / SETUPS["qwen25"][0]).read_text()
    with_column = tokenize([{"messages": conv, "tools": None}], tok, template).dataset[0]
    without = tokenize([{"messages": conv}], tok, template).dataset[0]
    assert with_column["input_ids"] == without["input_ids"] and with_column["labels"] == without["labels"]
    assert trained_texts(without, tok) == ["Sunny.<|im_end|>"]


def test_field_tools_named_but_missing_is_an_error(tok) -> None:
    conv = [USER, {"role": "assistant", "content": "Sunny."}]
    with pytest.raises(DataError, match="functions"):
        tokenize([{"messages": conv}], tok, KNOWN_CHAT_TEMPLATES["chatml"], field_tools="functions")
