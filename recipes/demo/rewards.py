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


def colour_named(completions: list[str], rows: list[dict]) -> list[float]:
    """Naming the picture's colour (the row's `colour`, recipes/demo/tiny_vlm_grpo_cpu.yaml): 1.0 when the
    completion's first word is it, else how close that word comes (difflib's similarity ratio, 0..1), so a
    model that starts from random weights is rewarded for getting nearer before it names a colour."""
    import difflib

    scores = []
    for text, row in zip(completions, rows, strict=True):
        words = text.lower().replace(".", " ").split()
        first = words[0] if words else ""
        scores.append(difflib.SequenceMatcher(None, first, row["colour"]).ratio())
    return scores
