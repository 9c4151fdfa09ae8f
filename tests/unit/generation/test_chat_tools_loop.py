"""Chat tool calls in the loop (finetune.generation.tools, .chat_tools) under the real templates of
Qwen2.5, Qwen3, Llama 3.1 and Mistral (tests/unit/data/templates/): the call the model writes in its
template's format is parsed, the tool runs with its arguments, the result goes back as the template
renders a `tool` message, and the next assistant turn continues. What the model saw and wrote is
exactly the template's rendering of the whole conversation, and only the model's own turns are marked
as its tokens. Also: transformers' response parsing where the tokenizer has a response_template, calls
of unknown tools, broken calls, and the environment protocol."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from finetune.generation.chat_tools import call_format, parse_calls
from finetune.generation.prompts import prompt_ids
from finetune.generation.protocol import SamplingParams
from finetune.generation.tools import generate_with_tools, load_tools
from tests.unit.generation.test_tool_loop import Scripted

REPO = Path(__file__).resolve().parents[3]
TEMPLATES = REPO / "tests" / "unit" / "data" / "templates"
SPECIALS = [
    *("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
    *("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
    *("[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
]
SETUPS = {  # name: (template file, end-of-turn token, the format finetune reads it in)
    "qwen25": ("Qwen-Qwen2.5-7B-Instruct.jinja", "<|im_end|>", "hermes"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "<|im_end|>", "hermes"),
    "llama31": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|eot_id|>", "llama3"),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "</s>", "mistral"),
}
TOOLS_PY = '''
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name
    """
    return {"Paris": "22 C and sunny"}.get(city, "unknown city")


class Countdown:
    """An environment: the model must say a number below the last one; 3 turns at most."""

    def reset(self, row):
        self.last = int(row["start"])
        return f"Say a number below {self.last}."

    def step(self, text):
        said = int(text.split()[-1].strip("."))
        if said >= self.last:
            return "Too high.", -1.0, True
        self.last = said
        return f"Now below {said}.", 1.0, said <= 1
'''


def call_text(setup: str, arguments: dict) -> str:
    """How each template writes the call get_weather(**arguments) (what the model must emit)."""
    args = json.dumps(arguments)
    return {
        "llama31": f'{{"name": "get_weather", "parameters": {args}}}',
        "qwen25": f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
        "qwen3": f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
        "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {args}, "id": "abcdef123"}}]',
    }[setup]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat_tools")
    (path / "weather.py").write_text(TOOLS_PY)
    return path


def tokenizer_for(setup: str):
    tok = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = (TEMPLATES / SETUPS[setup][0]).read_text()
    return tok


def box_for(folder, tok, *, environment=None, tools=("weather.py:get_weather",), max_tool_calls=4):
    specs = [SimpleNamespace(function=f, trigger=None, close=None) for f in tools]
    return load_tools(
        specs, tokenizer=tok, max_tool_calls=max_tool_calls, timeout_s=5, base=folder, label="grpo",
        environment=environment,
    )  # fmt: skip


def own_runs(tok, ids, own) -> list[str]:
    """The maximal runs of the model's own tokens, decoded."""
    runs, previous = [], False
    for token, mine in zip(ids, own, strict=True):
        if mine and not previous:
            runs.append([])
        if mine:
            runs[-1].append(token)
        previous = mine
    return [tok.decode(run) for run in runs]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_chat_call_runs_and_its_result_comes_back_as_the_template_renders_it(folder, setup):
    _, eot, fmt = SETUPS[setup]
    tok = tokenizer_for(setup)
    box = box_for(folder, tok)
    assert box.call_format == fmt
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = prompt_ids(tok, user, tools=box.schemas)
    call = call_text(setup, {"city": "Paris"})
    # Qwen3 writes an (empty) think block in its last turn, as its template renders one there.
    reply = ("<think>\n\n</think>\n\n" if setup == "qwen3" else "") + "It is 22 C and sunny."
    backend = Scripted(tok, [(call, True), (reply, True)], end=eot)
    [[made]] = generate_with_tools(
        backend, [prompt], SamplingParams(max_new_tokens=200), box, messages=[user]
    )
    box.close()
    assert made.finished and [c.result for c in made.calls] == ["22 C and sunny"]
    assert made.calls[0].arguments == {"city": "Paris"}
    call_id = "abcdef123" if setup == "mistral" else "call00001"
    conversation = [
        *user,
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": call_id, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": call_id, "content": "22 C and sunny"},
        {"role": "assistant", "content": "It is 22 C and sunny."},
    ]  # fmt: skip
    rendered = tok.apply_chat_template(conversation, tools=box.schemas, tokenize=False)
    seen = tok.decode(prompt + made.ids)
    if not rendered.startswith(tok.bos_token):  # prompt_ids puts the tokenizer's bos first, as training does
        seen = seen.removeprefix(tok.bos_token)
    assert rendered.startswith(seen) and len(rendered) - len(seen) <= 1, (rendered, seen)
    assert backend.contexts[1] == prompt + made.ids[: len(backend.contexts[1]) - len(prompt)]
    assert own_runs(tok, made.ids, made.own) == [call + eot, reply + eot]


def test_transformers_response_parsing_reads_the_call_where_the_tokenizer_has_a_schema(folder, monkeypatch):
    tok = tokenizer_for("qwen25")
    tok.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "content": {},
            "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                           "transform": {"type": "function", "function": "{content}"}},
        },
    }  # fmt: skip
    seen = []
    real = type(tok).parse_response
    monkeypatch.setattr(
        type(tok), "parse_response", lambda self, *a, **k: seen.append(a) or real(self, *a, **k)
    )
    box = box_for(folder, tok)
    assert box.call_format == "response_template"
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = "Let me check.\n" + call_text("qwen25", {"city": "Paris"})
    backend = Scripted(tok, [(call, True), ("Sunny.", True)], end="<|im_end|>")
    prompt = prompt_ids(tok, user, tools=box.schemas)
    [[made]] = generate_with_tools(
        backend, [prompt], SamplingParams(max_new_tokens=200), box, messages=[user]
    )
    box.close()
    assert seen and made.calls[0].result == "22 C and sunny" and made.finished


def test_unknown_tools_and_broken_calls_are_counted_errors(folder):
    tok = tokenizer_for("qwen25")
    box = box_for(folder, tok)
    user = [{"role": "user", "content": "Weather?"}]
    prompt = prompt_ids(tok, user, tools=box.schemas)
    unknown = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
    backend = Scripted(tok, [(unknown, True), (bad_args, True), ("Sorry.", True)], end="<|im_end|>")
    [[made]] = generate_with_tools(
        backend, [prompt], SamplingParams(max_new_tokens=300), box, messages=[user]
    )
    assert [c.result for c in made.calls] == [
        "error: no tool named 'get_time' (tools: get_weather)",
        "error: TypeError: get_weather() got an unexpected keyword argument 'town'",
    ]
    assert all(c.error for c in made.calls) and made.finished
    broken = Scripted(tok, [("<tool_call>\n{name: get_weather}\n</tool_call>", True)], end="<|im_end|>")
    [[made]] = generate_with_tools(broken, [prompt], SamplingParams(max_new_tokens=100), box, messages=[user])
    box.close()
    assert made.finished and made.calls[0].error and "not valid JSON" in made.calls[0].result
    assert parse_calls("plain answer", "hermes") == ("plain answer", None, None)


def test_a_template_without_a_known_call_format_is_an_error(folder):
    from finetune.errors import FinetuneError

    tok = tokenizer_for("qwen25")
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{# tools #}"
    with pytest.raises(FinetuneError, match="in none of the call formats finetune reads"):
        call_format(tok, "grpo.tools")


def test_an_environment_answers_each_turn_until_done_and_its_rewards_add_up(folder):
    """reset(row) gives the first message (the prompt), step(text) -> (observation, reward, done): each
    observation is a user turn rendered by the template, not trained; the episode ends when done."""
    tok = tokenizer_for("qwen25")
    box = box_for(folder, tok, tools=(), environment="weather.py:Countdown")
    turns = [("I say 5.", True), ("I say 3.", True), ("I say 1.", True), ("never asked", True)]
    backend = Scripted(tok, turns, end="<|im_end|>")
    [[made]] = generate_with_tools(
        backend, [[1, 2]], SamplingParams(max_new_tokens=300), box, rows=[{"start": 7}]
    )
    assert made.environment_reward == 3.0 and made.finished and len(backend.segments) == 1
    first = [{"role": "user", "content": "Say a number below 7."}]
    assert made.prompt == prompt_ids(tok, first)  # the first message made the prompt
    text = tok.decode(made.ids)
    assert "<|im_start|>user\nNow below 5.<|im_end|>\n<|im_start|>assistant\n" in text
    assert own_runs(tok, made.ids, made.own) == [
        "I say 5.<|im_end|>",
        "I say 3.<|im_end|>",
        "I say 1.<|im_end|>",
    ]
    assert [c.name for c in made.calls] == ["environment"] * 3
    # Too high: -1 and done at once; max_tool_calls caps the turns answered.
    backend = Scripted(tok, [("I say 9.", True)], end="<|im_end|>")
    [[high]] = generate_with_tools(
        backend, [[1]], SamplingParams(max_new_tokens=100), box, rows=[{"start": 7}]
    )
    assert high.environment_reward == -1.0 and high.own is None
    box.close()
    capped = box_for(folder, tok, tools=(), environment="weather.py:Countdown", max_tool_calls=1)
    backend = Scripted(tok, turns, end="<|im_end|>")
    [[one]] = generate_with_tools(
        backend, [[1]], SamplingParams(max_new_tokens=300), capped, rows=[{"start": 7}]
    )
    capped.close()
    assert one.environment_reward == 1.0 and len(one.calls) == 1
