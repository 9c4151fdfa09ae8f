"""Tools in the loop (finetune.generation.tools): inline triggers matched across token boundaries on real
`generate`, inserted results marked as not the model's own, seeds per segment, and what a failing,
hanging, noisy or over-called tool gives the model; the loading errors."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from finetune.errors import FinetuneError
from finetune.generation.backends import backend_for
from finetune.generation.pattern_stop import PatternStop
from finetune.generation.prompts import prompt_ids, stop_token_ids
from finetune.generation.protocol import Completion, SamplingParams
from finetune.generation.tools import completion_text, generate_with_tools, load_tools, segment_seed
from finetune.generation.triggers import compile_triggers, match_at_end
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[3]

TOOLS_PY = '''
import os, time

def add(expression: str) -> int:
    """Add the numbers of an expression.

    Args:
        expression: numbers joined by +, e.g. 2+3
    """
    return sum(int(x) for x in expression.split("+"))

def noisy(expression):
    print("a tool that prints")
    os.write(2, b"and writes to fd 2")
    return "quiet"

def crash(expression):
    os._exit(3)

def boom(expression):
    raise ValueError("cannot read " + expression)

def hang(expression):
    while True:
        time.sleep(0.05)

def two(a, b):
    return a + b

def no_doc(city: str):
    return city
'''


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools")
    (path / "mytools.py").write_text(TOOLS_PY)
    return path


def toolbox(folder, tok, *tools, max_tool_calls=4, timeout_s=5.0):
    """A toolbox of (function, trigger, close) triples from mytools.py."""
    specs = [SimpleNamespace(function=f"mytools.py:{f}", trigger=t, close=c) for f, t, c in tools]
    return load_tools(
        specs, tokenizer=tok, max_tool_calls=max_tool_calls, timeout_s=timeout_s, base=folder, label="grpo"
    )


def bigram_model(tok, segments: list[str], prompt: list[int]):
    """A tiny Llama that greedily writes the script `segments` (each continues where the one before,
    plus what the tool inserted, ended): attention and MLPs output nothing, so the next token depends on
    the current one only, and the output head maps each script token to its successor."""
    model = tiny_model(
        vocab_size=len(tok), hidden_size=128, intermediate_size=64, max_position_embeddings=256
    )
    successor: dict[int, int] = {}
    chain = [prompt[-1]]
    for text in segments:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        chain = [*chain, *ids]
    pairs = list(itertools.pairwise(chain))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        hidden = model.model.norm(model.model.embed_tokens.weight)
        for current, nxt in pairs:
            assert successor.setdefault(current, nxt) == nxt, "the script repeats a token with two successors"
            model.lm_head.weight[nxt] += hidden[current] / hidden[current].norm() * 20
    return model


def test_a_trigger_is_matched_across_token_boundaries_and_inside_the_last_token():
    patterns = compile_triggers([r"\[([^\]=]*)="])
    assert match_at_end(patterns, "Sum [2+3", 7) is None
    index, found = match_at_end(patterns, "Sum [2+3=", 8)
    assert (index, found.groups()) == (0, ("2+3",))
    assert match_at_end(patterns, "Sum [2+3=5", 8)[1].end() == 9  # "=5" was one token: ends inside it
    assert match_at_end(patterns, "Sum [2+3=5", 9) is None  # the match ended before the last token


def test_the_stopping_criterion_stops_each_row_at_its_own_trigger(tok):
    """Rows grow a token at a time, as in generate: each stops at the token that completes its own
    trigger; a row that ended at eos is never a call, even if padding-like tokens after it would match."""
    patterns = compile_triggers([r"\[([^\]=]*)="])
    prompt = tok("Q:", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Sum [2+3= and", "no call at all", "[1")]
    rows[2] = rows[2] + [eos] + tok("[4=4=4", add_special_tokens=False)["input_ids"]
    width = max(map(len, rows))
    rows = [r + [eos] * (width - len(r)) for r in rows]
    stop = PatternStop(tok, patterns, start=len(prompt), stops=[eos])
    first_done: dict[int, int] = {}
    for t in range(1, width + 1):
        batch = torch.tensor([prompt + r[:t] for r in rows])
        for row, done in enumerate(stop(batch, None).tolist()):
            if done:
                first_done.setdefault(row, t)
    assert first_done == {0: len(tok("Sum [2+3=", add_special_tokens=False)["input_ids"])}
    assert stop.stopped_at == first_done


def test_an_inline_call_on_real_generate_inserts_the_result_which_is_not_the_models(folder, tok):
    prompt = prompt_ids(tok, "What is 2 + 3?")
    model = bigram_model(tok, ["Sum [2+3=", "5]", ".</s>"], prompt)
    backend = backend_for("transformers", model, tok)
    box = toolbox(folder, tok, ("add", r"\[([^\]=]*)=", "]"))
    [[made]] = generate_with_tools(backend, [prompt], SamplingParams(max_new_tokens=20), box)
    box.close()
    assert made.finished and tok.decode(made.ids) == "Sum [2+3=5].</s>"
    assert [c.as_dict()["result"] for c in made.calls] == ["5"] and made.calls[0].arguments == ["2+3"]
    inserted = [t for t, own in zip(made.ids, made.own, strict=True) if not own]
    assert tok.decode(inserted) == "5]"  # the result and close: never trained
    assert completion_text(tok, made, stops=stop_token_ids(tok)) == "Sum [2+3=5]."


def test_a_match_inside_the_last_token_replaces_that_token(folder, tok):
    """The model writes ' h' (one token) after 'Sam': the trigger '(\\w+) ' ends inside it, so ' h' is
    dropped, ' ' is inserted (not trained), then the result: the call sees exactly the text to the match."""
    backend = Scripted(tok, [("Sam h", False), ("as it.", True)])
    box = toolbox(folder, tok, ("noisy", r"(\w+) ", "!"))
    [[made]] = generate_with_tools(backend, [[5]], SamplingParams(max_new_tokens=30), box)
    box.close()
    text = tok.decode(made.ids, skip_special_tokens=True)
    assert text == "Sam quiet!as it."
    assert tok.decode([t for t, own in zip(made.ids, made.own, strict=True) if not own]) == " quiet!"
    assert made.calls[0].arguments == ["Sam"]


class Scripted:
    """A generation backend that answers every generate call with the next scripted segment
    ((text, ended at the end-of-turn token)), recording the contexts it was given."""

    name, processor, copies_weights = "scripted", None, False

    def __init__(self, tokenizer, segments, end: str | None = None):
        self.tokenizer, self.segments, self.contexts = tokenizer, list(segments), []
        self.end_id = tokenizer.convert_tokens_to_ids(end) if end else tokenizer.eos_token_id
        self.stops = list(dict.fromkeys([self.end_id, *stop_token_ids(tokenizer)]))

    def generate(self, prompts, params, *, seeds=None, batch_size=8, images=None, progress=False):
        out = []
        for context in prompts:
            self.contexts.append(list(context))
            text, ended = self.segments.pop(0)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + (
                [self.end_id] if ended else []
            )
            out.append([Completion(ids, ended)])
        return out


def test_errors_and_calls_past_the_limit_are_results_the_model_reads(folder, tok):
    trigger = r"\[([^\]=]*)="
    backend = Scripted(tok, [("x [1=", False), (" ok.", True)])
    box = toolbox(folder, tok, ("boom", trigger, "]"))
    [[made]] = generate_with_tools(backend, [[5]], SamplingParams(max_new_tokens=40), box)
    box.close()
    expected = "error: ValueError: cannot read 1"
    assert made.finished and made.calls[0].result == expected
    assert tok.decode(made.ids, skip_special_tokens=True) == f"x [1={expected}] ok."
    assert made.calls[0].error and not made.calls[0].timeout
    # One call allowed: the second gets an error result, and generation goes on.
    backend = Scripted(tok, [("a [1+1=", False), (" b [2+2=", False), (" c.", True)])
    box = toolbox(folder, tok, ("add", trigger, "]"), max_tool_calls=1)
    [[made]] = generate_with_tools(backend, [[5]], SamplingParams(max_new_tokens=60), box)
    box.close()
    assert [c.result for c in made.calls] == ["2", "error: no more tool calls (max_tool_calls 1)"]
    assert [c.error for c in made.calls] == [False, True]


@pytest.mark.slow  # the tool worker is a process
def test_the_worker_stops_a_hung_tool_survives_a_crash_and_silences_prints(folder, tok, capfd):
    trigger = r"\[([^\]=]*)="
    cases = {
        "boom": "error: ValueError: cannot read 1",
        "hang": "error: the tool did not answer within 0.5 s",
        "noisy": "quiet",
        "crash": "error: the tool crashed its process",
    }
    for name, expected in cases.items():
        backend = Scripted(tok, [("x [1=", False), (" y {1+1=", False), (" ok.", True)])
        # `add` answers the second call: in a new worker after a hang or a crash
        box = toolbox(folder, tok, (name, trigger, "]"), ("add", r"\{([^\}=]*)=", "}"), timeout_s=0.5)
        [[made]] = generate_with_tools(backend, [[5]], SamplingParams(max_new_tokens=60), box)
        box.close()
        assert made.finished and [c.result for c in made.calls] == [expected, "2"], name
        assert made.calls[0].error == (name in ("boom", "crash")) and made.calls[0].timeout == (
            name == "hang"
        )
    printed = capfd.readouterr()
    assert "a tool that prints" not in printed.out + printed.err and "fd 2" not in printed.out + printed.err


def test_inserted_results_count_toward_max_new_tokens(folder, tok):
    backend = Scripted(tok, [("ab [1+1=", False), ("never", True)])
    box = toolbox(folder, tok, ("add", r"\[([^\]=]*)=", "]]]]]]]]"))
    [[made]] = generate_with_tools(backend, [[5]], SamplingParams(max_new_tokens=10), box)
    box.close()
    assert len(made.ids) == 10 and not made.finished and len(backend.contexts) == 1


def test_sampled_completions_depend_on_their_seeds_only(folder, tok):
    """Random tiny model, a trigger that fires often: the same seeds give the same completions (calls
    and continuations included) whatever the batching and order of the prompts."""
    torch.manual_seed(0)
    model = tiny_model(vocab_size=len(tok), max_position_embeddings=256)
    backend = backend_for("transformers", model, tok)
    box = toolbox(folder, tok, ("noisy", r"([aeiou])", "|"))
    prompts = [prompt_ids(tok, "Hi"), prompt_ids(tok, "What is 2 + 3?")]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, num_return_sequences=3)
    seeds = [[11, 12, 13], [21, 22, 23]]
    first = generate_with_tools(backend, prompts, params, box, seeds=seeds, batch_size=2)
    again = generate_with_tools(backend, prompts[::-1], params, box, seeds=seeds[::-1], batch_size=1)[::-1]
    box.close()
    assert sum(len(c.calls) for row in first for c in row) > 3  # continuations were sampled
    assert [[(c.ids, c.own) for c in row] for row in again] == [
        [(c.ids, c.own) for c in row] for row in first
    ]
    assert segment_seed(11, 1) != segment_seed(12, 1)


def test_loading_errors_name_the_tool(folder, tok):
    with pytest.raises(FinetuneError, match=r"grpo.tools\[0\].function: .*tool file nope.py does not exist"):
        load_tools(
            [SimpleNamespace(function="nope.py:f", trigger="(a)", close=None)],
            tokenizer=tok, max_tool_calls=1, timeout_s=1, base=folder, label="grpo",
        )  # fmt: skip
    with pytest.raises(FinetuneError, match=r"has no function 'missing'"):
        toolbox(folder, tok, ("missing", "(a)", ""))
    with pytest.raises(FinetuneError, match=r"has 1 group, so the tool is called with 1 argument.*\(a, b\)"):
        toolbox(folder, tok, ("two", r"\[([^\]=]*)=", "]"))
    with pytest.raises(FinetuneError, match=r"get_json_schema.*no docstring"):
        toolbox(folder, tok, ("no_doc", None, None))
    with pytest.raises(FinetuneError, match=r"no `tools` variable"):  # the demo template takes no tools
        toolbox(folder, tok, ("add", None, None))
