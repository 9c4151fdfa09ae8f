"""finetune.generation.rewards: built-ins score like the eval metrics, users' functions load by path,
and a reward that misbehaves stops the run with its name, the row and the value (never a silent 0)."""

from __future__ import annotations

import sys

import pytest

from finetune.errors import FinetuneError
from finetune.generation.rewards import Reward, build_rewards, builtin_reward, load_function, score_rewards

ROWS = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]


def test_exact_match_extracts_answers_as_the_eval_metric_does():
    fn = builtin_reward("exact_match", field_expected="answer")
    assert fn(["1 + 1 = 2. #### 2", "#### 5"], ROWS) == [1.0, 0.0]
    assert fn(["the answer is 2", "it is $4.00"], ROWS) == [1.0, 1.0]  # last number, normalised
    custom = builtin_reward("exact_match", field_expected="answer", answer_pattern=r"ANSWER: (\d+)")
    assert custom(["ANSWER: 2", "ANSWER: 3"], [{"answer": "ANSWER: 2"}, {"answer": "ANSWER: 4"}]) == [
        1.0,
        0.0,
    ]


def test_math_verify_compares_mathematically():
    pytest.importorskip("math_verify", reason="math-verify is in the test extra")
    fn = builtin_reward("math_verify", field_expected="answer")
    rows = [{"answer": "$\\frac{1}{2}$"}, {"answer": "$\\frac{1}{2}$"}, {"answer": "3"}]
    assert fn(["The answer is 0.5", "It is $\\boxed{\\frac{2}{4}}$", "4"], rows) == [1.0, 1.0, 0.0]


def test_format_and_length():
    fmt = builtin_reward("format", pattern=r"#### -?\d+$")
    assert fmt(["so 3. #### 3", "three"], ROWS) == [1.0, 0.0]
    length = builtin_reward("length", max_new_tokens=10, soft_cache=4, count_tokens=lambda t: len(t.split()))
    assert length(["a " * 6, "a " * 8, "a " * 12], [{}] * 3) == [0.0, -0.5, -1.0]


def _reward(fn, name="mine") -> list[Reward]:
    return [Reward(name, 1.0, fn)]


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda c, r: 1 / 0, r"reward mine raised ZeroDivisionError"),
        (lambda c, r: [1.0], r"reward mine returned 1 values for 2 completions"),
        (lambda c, r: [1.0, float("nan")], r"returned nan for completion 1 \(row \{'question': '2\+2\?'"),
        (lambda c, r: [1.0, float("inf")], r"returned inf for completion 1"),
        (lambda c, r: [1.0, "1"], r"returned '1' for completion 1"),
        (lambda c, r: [True, 0.0], r"returned True for completion 0"),
        (lambda c, r: {0: 1.0, 1: 0.0}, r"reward mine returned a dict, not a list"),
        (lambda c, r: [1e308, 0.0], r"returned 1e\+308 for completion 0 .*within \+-1e\+15"),
        (lambda c, r: sys.exit(0), r"reward mine called sys\.exit"),
        (lambda c, r: _interrupt(), r"reward mine raised KeyboardInterrupt"),
    ],
)
def test_a_misbehaving_reward_stops_with_name_row_and_value(fn, match):
    with pytest.raises(FinetuneError, match=match):
        score_rewards(_reward(fn), ["a", "b"], ROWS)


def _interrupt():
    raise KeyboardInterrupt


def test_numpy_and_torch_scalars_are_numbers():
    import numpy as np
    import torch

    rewards = _reward(lambda c, r: [np.float32(0.5), torch.tensor(2.0)])
    assert score_rewards(rewards, ["a", "b"], ROWS).tolist() == [[0.5], [2.0]]


def test_scores_are_a_completions_by_rewards_tensor():
    rewards = [
        Reward("one", 1.0, lambda c, r: [1.0] * len(c)),
        Reward("len", 0.5, lambda c, r: [len(x) for x in c]),
    ]
    assert score_rewards(rewards, ["ab", "c"], ROWS).tolist() == [[1.0, 2.0], [1.0, 1.0]]


def test_user_functions_load_from_a_module_or_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, rows):\n    return [-len(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_function("my_rewards:brevity", base=tmp_path)(["ab"], [{}]) == [-2]
    assert load_function("my_rewards.py:brevity", base=tmp_path)(["abc"], [{}]) == [-3]
    with pytest.raises(FinetuneError, match="has no function 'nope'"):
        load_function("my_rewards:nope", base=tmp_path)
    with pytest.raises(FinetuneError, match=r"cannot import no_such_module"):
        load_function("no_such_module:fn", base=tmp_path)
    with pytest.raises(FinetuneError, match=r"reward file missing.py does not exist"):
        load_function("missing.py:fn", base=tmp_path)


def test_build_rewards_from_recipe_entries():
    from finetune.recipe.grpo import RewardSpec

    specs = [
        RewardSpec(name="exact_match", field_expected="answer"),
        RewardSpec(name="format", pattern="####", weight=0.5),
    ]
    rewards = build_rewards(specs, max_new_tokens=8, count_tokens=len)
    assert [(r.name, r.weight) for r in rewards] == [("exact_match", 1.0), ("format", 0.5)]
    assert score_rewards(rewards, ["#### 2", "5"], ROWS).tolist() == [[1.0, 1.0], [0.0, 0.0]]
