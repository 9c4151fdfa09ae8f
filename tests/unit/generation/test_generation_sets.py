"""finetune.generation.sets: rows -> answers -> scores -> summary (generation replaced by fixed answers)."""

from __future__ import annotations

import doctest
from unittest import mock

import pytest

from finetune.generation import sets as run
from finetune.generation.sets import evaluate_generations, summarize

ROWS = [
    {"prompt": "Tom has 3 apples and buys 4. How many?", "expected": "3 + 4 = 7\n#### 7"},
    {"prompt": [{"role": "user", "content": "What is 10 - 12?"}], "expected": "#### -2"},
    {"prompt": "What is 1,000 + 1?", "expected": "#### 1001"},
]
ANSWERS = ["He has 7 apples.", "10 - 12 = 2", "The answer is $1,001."]


class _TextBackend:
    """A backend stand-in: evaluate_generations reads its processor (None: a text model)."""

    processor = None


BACKEND = _TextBackend()


def _evaluate(rows=ROWS, answers=ANSWERS, **kwargs):
    with mock.patch.object(run, "answers", return_value=list(answers)) as generate:
        result = evaluate_generations(BACKEND, rows, progress=False, **kwargs)
    return result, generate


def test_doctests() -> None:
    assert doctest.testmod(run).failed == 0


def test_exact_match_summary_with_samples() -> None:
    result, generate = _evaluate(num_samples=2, max_new_tokens=64, batch_size=4)
    assert generate.call_args.args == (BACKEND, [r["prompt"] for r in ROWS])
    assert generate.call_args.kwargs == {
        "max_new_tokens": 64, "batch_size": 4, "use_chat_template": True, "progress": False,
    }  # fmt: skip
    assert (result["metric"], result["n"]) == ("exact_match", 3)
    assert result["score"] == pytest.approx(2 / 3)
    assert result["samples"] == [
        {"prompt": ROWS[0]["prompt"], "output": ANSWERS[0], "expected": ROWS[0]["expected"], "correct": True},
        {
            "prompt": ROWS[1]["prompt"],
            "output": ANSWERS[1],
            "expected": ROWS[1]["expected"],
            "correct": False,
        },
    ]


def test_all_samples_contains_and_none() -> None:
    short = [{**row, "expected": answer} for row, answer in zip(ROWS, ["7", "-2", "1001"], strict=True)]
    result, _ = _evaluate(short, metric="contains", num_samples=None)
    assert [s["correct"] for s in result["samples"]] == [True, False, False]  # plain text: "1001" != "1,001"
    prompts_only = [{"prompt": r["prompt"]} for r in ROWS]
    result, _ = _evaluate(prompts_only, metric="none")
    assert result["score"] is None and result["n"] == 3
    assert [s["correct"] for s in result["samples"]] == [None, None, None]


def test_bad_rows_and_metrics_are_errors() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\] have no prompt and expected"):
        _evaluate([ROWS[0], {"prompt": "x"}])
    with pytest.raises(ValueError, match="unknown metric 'rouge'"):
        _evaluate(metric="rouge")


def test_summary_of_no_rows() -> None:
    assert summarize([], metric="exact_match") == {
        "metric": "exact_match",
        "score": None,
        "n": 0,
        "samples": [],
    }
