"""Rewards for online RL: built-ins that reuse the eval metrics, and users' functions by import path.

A reward is a function (completions, rows) -> one float per completion: `completions` are decoded
texts, `rows` the data rows they answer (every column, e.g. the expected answer). `score` runs every
reward of the recipe on a batch and checks what it returns: a function that raises, returns the
wrong number of values, a value that is not a number or is NaN stops the run with an error naming
the reward, the row and the value. Nothing is ever replaced by 0.

Built-ins (grpo.rewards[].name):
* ``exact_match``: 1.0 when the answer extracted from the completion equals the expected answer
  (finetune.generation.metrics, the same extraction and normalisation as the eval metric), else 0.0;
* ``math_verify``: 1.0 when Hugging Face's math-verify finds the completion's answer equal to the
  expected one (LaTeX, fractions, sets ...), else 0.0;
* ``format``: 1.0 when the completion matches a regex, else 0.0;
* ``length``: DAPO's soft overlong penalty, from the completion's token count.

>>> exact = builtin_reward("exact_match", field_expected="answer")
>>> exact(["so it is 7. #### 7", "#### 8"], [{"answer": "#### 7"}, {"answer": "#### 7"}])
[1.0, 0.0]
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.generation.functions import load_function
from finetune.generation.metrics import GSM8K_ANSWER_PATTERN, math_equal, require_math_verify, score

RewardFn = Callable[[list[str], list[dict[str, Any]]], Sequence[float]]


@dataclass(frozen=True)
class Reward:
    """A reward as the run uses it: its name in logs, its weight, and the function."""

    name: str
    weight: float
    fn: RewardFn


def builtin_reward(
    name: str,
    *,
    field_expected: str | None = None,
    answer_pattern: str | None = None,
    pattern: str | None = None,
    max_new_tokens: int | None = None,
    soft_cache: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> RewardFn:
    """The built-in reward `name` with its settings (see the module docstring)."""
    if name == "exact_match":
        answer = answer_pattern or GSM8K_ANSWER_PATTERN

        def exact_match(completions, rows):
            pairs = zip(completions, rows, strict=True)
            return [
                float(bool(score("exact_match", c, str(r[field_expected]), pattern=answer))) for c, r in pairs
            ]

        return exact_match
    if name == "math_verify":
        return _math_verify(field_expected)
    if name == "format":
        regex = re.compile(pattern)

        def format_reward(completions, rows):
            return [1.0 if regex.search(c) else 0.0 for c in completions]

        return format_reward
    if name == "length":
        return _overlong_penalty(max_new_tokens, soft_cache, count_tokens)
    raise ValueError(f"unknown built-in reward {name!r}")


def _math_verify(field_expected: str) -> RewardFn:
    require_math_verify("grpo.rewards")

    def math_verify(completions, rows):
        # The eval metric's comparison (finetune.generation.metrics.math_equal), as 1.0 or 0.0.
        return [float(math_equal(c, str(r[field_expected]))) for c, r in zip(completions, rows, strict=True)]

    return math_verify


def _overlong_penalty(max_new_tokens: int | None, soft_cache: int | None, count_tokens) -> RewardFn:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - soft_cache tokens, then linear to -1
    at max_new_tokens (soft_cache None: the last quarter of max_new_tokens).

    >>> fn = _overlong_penalty(8, 4, lambda text: len(text.split()))
    >>> fn(["a b c", "a b c d e f", "a b c d e f g h"], [{}, {}, {}])
    [0.0, -0.5, -1.0]
    """
    cache = soft_cache or max(max_new_tokens // 4, 1)
    start = max_new_tokens - cache

    def length(completions, rows):
        return [
            0.0 if (n := count_tokens(c)) <= start else -min((n - start) / cache, 1.0) for c in completions
        ]

    return length


def build_rewards(
    specs: Sequence[Any], *, max_new_tokens: int, count_tokens, base: Path | None = None
) -> list[Reward]:
    """The recipe's grpo.rewards as Reward objects (functions imported now, so a bad path fails at start)."""
    rewards = []
    for spec in specs:
        if spec.function is not None:
            fn = load_function(spec.function, base=base)
        else:
            fn = builtin_reward(
                spec.name,
                field_expected=spec.field_expected,
                answer_pattern=spec.answer_pattern,
                pattern=spec.pattern,
                max_new_tokens=max_new_tokens,
                soft_cache=spec.soft_cache,
                count_tokens=count_tokens,
            )
        rewards.append(Reward(spec.label, spec.weight, fn))
    return rewards


def score_rewards(
    rewards: Sequence[Reward], completions: list[str], rows: list[dict[str, Any]]
) -> torch.Tensor:
    """Every reward of every completion: a float32 tensor completions x rewards, checked (see the module
    docstring); rows[k] is the data row completion k answers."""
    columns = []
    for reward in rewards:
        try:
            values = list(reward.fn(list(completions), list(rows)))
        except Exception as exc:
            raise FinetuneError(
                f"reward {reward.name} raised {type(exc).__name__}: {exc} (on a batch of {len(completions)} "
                f"completions; first row: {_short(rows[0]) if rows else '-'})"
            ) from None
        if len(values) != len(completions):
            raise FinetuneError(
                f"reward {reward.name} returned {len(values)} values for {len(completions)} completions: it must "
                "return one float per completion"
            )
        for k, value in enumerate(values):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(float(value))
            ):
                raise FinetuneError(
                    f"reward {reward.name} returned {value!r} for completion {k} (row {_short(rows[k])}, completion "
                    f"{completions[k][:80]!r}): rewards must be finite numbers"
                )
        columns.append(torch.tensor([float(v) for v in values], dtype=torch.float32))
    return torch.stack(columns, dim=1)


def _short(row: dict[str, Any]) -> str:
    text = repr({k: v for k, v in row.items() if not str(k).startswith("_")})
    return text if len(text) <= 160 else text[:157] + "..."
