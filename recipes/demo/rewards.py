"""Reward functions of the tiny GRPO demo (recipes/demo/tiny_grpo_cpu.yaml), as users write them:
(completions, rows) -> one float per completion."""

from __future__ import annotations


def digits(completions: list[str], rows: list[dict]) -> list[float]:
    """The share of a completion's non-space characters that are digits (answers are numbers)."""
    scores = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        scores.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return scores
