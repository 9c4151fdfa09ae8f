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

A trained reward model (grpo.rewards[].model) is a reward function too: finetune.generation.reward_model.

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
from finetune.notices import warn

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


class RewardTimeout(Exception):
    """A reward function that did not answer within grpo.reward_timeout_s (or was stopped by a stop
    signal): a counted failure of its batch, not an error."""


class _Shown(str):
    """A value a reward returned in its worker that is not a number, shown as its repr there."""

    def __repr__(self) -> str:
        return str(self)


@dataclass
class WorkerReward:
    """A reward function run in the reward worker (finetune.generation.tool_worker: a process of its own,
    the functions imported there), so a hung one is stopped after `timeout_s` (a RewardTimeout) and its
    prints reach nobody. What it returns comes back as JSON and is checked as an in-process reward's."""

    runner: Any  # a tool_worker.ToolRunner holding the section's reward functions
    index: int
    name: str

    def __call__(self, completions: list[str], rows: list[dict[str, Any]]):
        result = self.runner.request(
            {"op": "reward", "fn": self.index, "completions": completions, "rows": rows}
        )
        if result.timeout:
            stopped = self.runner.stopping.is_set()
            raise RewardTimeout(
                "stopped by the run's stop signal"
                if stopped
                else f"did not answer within {self.runner.timeout_s:g} s (grpo.reward_timeout_s; its worker was stopped)"
            )
        if result.error:
            text = result.text.removeprefix("error: ")
            if text.startswith("the tool crashed"):  # os._exit, a segfault: the worker is gone
                raise FinetuneError(
                    _failure(
                        self.name, "ended its worker process (os._exit or a crash)", "", rows, completions
                    )
                )
            kind, _, message = text.partition(": ")
            what = {"SystemExit": "called sys.exit", "KeyboardInterrupt": "raised KeyboardInterrupt"}
            raise FinetuneError(
                _failure(self.name, what.get(kind, f"raised {kind}"), message, rows, completions)
            )
        answer = result.value
        if "not_list" in answer:
            raise FinetuneError(_not_a_list(self.name, answer["not_list"], len(completions)))
        return [v if isinstance(v, float) else _Shown(v["shown"]) for v in answer["values"]]


def build_rewards(
    specs: Sequence[Any],
    *,
    max_new_tokens: int,
    count_tokens,
    base: Path | None = None,
    device: Any = "cpu",
    prompt_fields: Sequence[str] = (),
    section: str = "grpo",
    timeout_s: float | None = None,
) -> list[Reward]:
    """The recipe's grpo.rewards as Reward objects (functions imported now, reward models loaded now onto
    `device`, so a bad path or a model with the wrong head fails at start). A reward model reads each
    row's prompt from its field_prompt, else from the first of `prompt_fields` the row has. With
    `timeout_s` (grpo.reward_timeout_s) the functions run in a worker process (WorkerReward), started on
    the first call; without, in this process."""
    from finetune.generation import tool_worker

    functions = [s for s in specs if getattr(s, "model", None) is None and s.function is not None]
    runner = None
    if timeout_s is not None and functions:
        where = [(s.function, str(base) if base else None) for s in functions]
        runner = tool_worker.ToolRunner(where, timeout_s=timeout_s)
    rewards = []
    for i, spec in enumerate(specs):
        if getattr(spec, "model", None) is not None:
            from finetune.generation.reward_model import reward_model_reward

            fields = (spec.field_prompt,) if spec.field_prompt else tuple(prompt_fields)
            where = f"{section}.rewards.{i}.model"
            fn = reward_model_reward(
                spec.model, batch_size=spec.batch_size, device=device, prompt_fields=fields, where=where
            )
        elif spec.function is not None:
            fn = load_function(spec.function, base=base)  # imported here too: its errors now, at start
            if runner is not None:
                fn = WorkerReward(runner, functions.index(spec), spec.label)
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


# The largest reward magnitude: the logging sums squares of rewards, and float32 holds them to ~3e38.
MAX_REWARD = 1e15


def score_rewards(
    rewards: Sequence[Reward], completions: list[str], rows: list[dict[str, Any]]
) -> torch.Tensor:
    """Every reward of every completion: a float32 tensor completions x rewards, checked (see the module
    docstring); rows[k] is the data row completion k answers. A user's function is never silent: an
    exception, sys.exit or Ctrl-C inside it, a wrong count, a mapping, or a value that is not a finite
    number within +-MAX_REWARD is a FinetuneError naming the reward (numpy and torch scalars are numbers).
    A reward run in its worker that times out (RewardTimeout) gives NaN for that batch, with a warning
    naming it: the caller counts those completions (reward_timeouts) and trains nothing on them."""
    columns = []
    for reward in rewards:
        try:
            values = _call(reward, completions, rows)
        except RewardTimeout as exc:  # counted by the caller (NaN: no reward), never a hang or a crash
            warn(
                f"reward {reward.name}: {exc} on a batch of {len(completions)} completions (first row: "
                f"{_short(rows[0]) if rows else '-'}): they get no reward from it (logged as reward_timeouts); "
                "raise grpo.reward_timeout_s if it needs longer"
            )
            columns.append(torch.full((len(completions),), float("nan")))
            continue
        if isinstance(values, (dict, str, bytes)) or not hasattr(values, "__iter__"):
            raise FinetuneError(_not_a_list(reward.name, type(values).__name__, len(completions)))
        values = list(values)
        if len(values) != len(completions):
            raise FinetuneError(
                f"reward {reward.name} returned {len(values)} values for {len(completions)} completions: it must "
                "return one float per completion"
            )
        columns.append(torch.tensor([_number(reward, v, k, completions, rows) for k, v in enumerate(values)]))
    return torch.stack(columns, dim=1).to(torch.float32)


def _call(reward: Reward, completions: list[str], rows: list[dict[str, Any]]):
    """The reward function on a batch; what it raises (SystemExit and KeyboardInterrupt too: they would
    end the run without a word, or with a traceback) becomes a FinetuneError naming it."""
    try:
        return reward.fn(list(completions), list(rows))
    except (RewardTimeout, FinetuneError):
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as exc:
        what = {SystemExit: "called sys.exit", KeyboardInterrupt: "raised KeyboardInterrupt"}.get(type(exc))
        what = what or f"raised {type(exc).__name__}"
        raise FinetuneError(_failure(reward.name, what, str(exc), rows, completions)) from None


def _failure(name: str, what: str, message: str, rows, completions) -> str:
    return (
        f"reward {name} {what}: {message} (on a batch of {len(completions)} completions; first row: "
        f"{_short(rows[0]) if rows else '-'}); a reward function returns one float per completion and must not "
        "end the program"
    )


def _not_a_list(name: str, type_name: str, count: int) -> str:
    return (
        f"reward {name} returned a {type_name}, not a list: it must return one float per completion "
        f"({count} here), in order"
    )


def _number(reward: Reward, value: Any, k: int, completions: list[str], rows: list[dict[str, Any]]) -> float:
    """A reward value as a float: a Python, numpy or torch real number (not a bool), finite, within
    +-MAX_REWARD; anything else is a FinetuneError naming the completion."""
    import numbers

    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    number = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_":
        number = float(value)
    if number is None or not math.isfinite(number) or abs(number) > MAX_REWARD:
        allowed = (
            "finite numbers" if number is None or not math.isfinite(number) else f"within +-{MAX_REWARD:g}"
        )
        raise FinetuneError(
            f"reward {reward.name} returned {value!r} for completion {k} (row {_short(rows[k])}, completion "
            f"{completions[k][:80]!r}): rewards must be {allowed}"
        )
    return number


def _short(row: dict[str, Any]) -> str:
    text = repr({k: v for k, v in row.items() if not str(k).startswith("_")})
    return text if len(text) <= 160 else text[:157] + "..."
