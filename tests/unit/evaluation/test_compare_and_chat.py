"""finetune eval's table and generation-set loading; finetune chat's conversation loop (with a fake
backend: generation itself is tested in tests/unit/generation/test_transformers_backend.py)."""

from __future__ import annotations

import io
import json

import pytest

import finetune.generation.prompts as prompts_mod
from finetune.errors import FinetuneError
from finetune.evaluation.chat import chat
from finetune.evaluation.compare import format_table
from finetune.generation.sets import load_generation_rows
from finetune.recipe import GenerationSet


def _result(loss: float, score: float, output: str, correct: bool) -> dict:
    sample = {"prompt": "What is 2 + 3?", "output": output, "expected": "#### 5", "correct": correct}
    return {
        "eval_loss": loss,
        "eval_ppl": 2.0,
        "generation": {"arith": {"metric": "exact_match", "score": score, "n": 4, "samples": [sample]}},
    }


def test_table_puts_models_side_by_side_with_samples():
    table = format_table(
        {"base": _result(3.5, 0.25, "Five, I think.", False), "tuned": _result(1.25, 1.0, "#### 5", True)}
    )
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "base", "tuned"]
    assert lines[1].split() == ["eval_loss", "3.5000", "1.2500"]
    assert lines[3].split()[-2:] == ["25.0%", "100.0%"] and "arith exact_match (n=4)" in lines[3]
    assert "arith sample 1: What is 2 + 3?" in table and "expected: #### 5" in table
    assert "base [wrong]: Five, I think." in table and "tuned [correct]: #### 5" in table


def test_generation_rows_come_from_the_named_columns(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"q": f"q{k}", "a": str(k), "x": 0}) + "\n" for k in range(5)))
    rows = load_generation_rows(
        GenerationSet(name="qa", path=str(path), field_prompt="q", field_expected="a", num_rows=3)
    )
    assert rows == [
        {"prompt": "q0", "expected": "0"},
        {"prompt": "q1", "expected": "1"},
        {"prompt": "q2", "expected": "2"},
    ]
    with pytest.raises(
        FinetuneError, match=r"eval.generation_sets\[qa\]: .*qa.jsonl has no column 'question'"
    ):
        load_generation_rows(
            GenerationSet(name="qa", path=str(path), field_prompt="question", field_expected="a")
        )


class EchoBackend:
    """A generation backend that answers with how many turns it saw, in two pieces (its inputs are the
    messages themselves: chat_inputs is replaced in the `echo` fixture)."""

    tokenizer = processor = None

    def __init__(self, seen: list):
        self.seen = seen

    def stream(self, inputs, params):
        self.seen.append([dict(m) for m in inputs["messages"]])
        yield "turns="
        yield str(len(inputs["messages"]))


@pytest.fixture
def echo(monkeypatch):
    """The turns each answer saw (see EchoBackend)."""
    monkeypatch.setattr(prompts_mod, "chat_inputs", lambda tokenizer, messages, **kw: {"messages": messages})
    return []


def test_one_prompt_is_answered_and_streamed(echo):
    out = io.StringIO()
    assert chat(EchoBackend(echo), prompt="hi", system="be brief", out=out) == 0
    assert out.getvalue() == "turns=2\n"
    assert echo == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]


def test_a_conversation_keeps_its_history_until_reset(echo):
    lines = iter(["hello", "", "again", "/reset", "fresh", "/exit", "never read"])
    out = io.StringIO()
    assert chat(EchoBackend(echo), read=lambda _: next(lines), out=out) == 0
    assert [len(turns) for turns in echo] == [1, 3, 1]  # user; user+assistant+user; after /reset
    assert echo[1][1] == {"role": "assistant", "content": "turns=1"}
    assert "(new conversation)" in out.getvalue()


def test_end_of_input_ends_the_conversation(echo):
    def read(_):
        raise EOFError

    assert chat(EchoBackend(echo), read=read, out=io.StringIO()) == 0


def test_math_verify_set_is_scored_in_the_eval_table(tmp_path, monkeypatch):
    """A generation set with metric math_verify, through finetune eval's evaluate_models and table:
    answers equal in math but not as text score as correct (generation replaced by fixed answers)."""
    pytest.importorskip("math_verify", reason="math-verify is in the test extra")
    import finetune.generation.sets as sets_mod
    from finetune.evaluation.compare import evaluate_models

    path = tmp_path / "math.jsonl"
    rows = [{"q": "Half of 1?", "a": "0.5"}, {"q": "Solve x+1=3.", "a": "$2$"}, {"q": "1/3?", "a": "0.5"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = {"base": ["1", "x = 5", "0.3"], "tuned": ["\\frac{1}{2}", "so $x = 2$", "1/3"]}
    monkeypatch.setattr(sets_mod, "answers", lambda backend, prompts, **kw: answers[backend.model])
    gen_set = GenerationSet(
        name="math", path=str(path), field_prompt="q", field_expected="a", metric="math_verify"
    )
    results = evaluate_models(
        {name: (lambda name=name: (name, "tokenizer")) for name in answers},
        eval_batches=None,
        sets=[gen_set],
        batch_size=2,
        progress=False,
        say=lambda text: None,
    )
    assert [s["correct"] for s in results["tuned"]["generation"]["math"]["samples"]] == [True, True, False]
    row = next(line for line in format_table(results).splitlines() if line.startswith("math math_verify"))
    assert row.split()[-2:] == ["0.0%", "66.7%"]
