"""One generation evaluation end to end: rows -> greedy answers -> a score per row -> a summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from finetune.evaluation.generate import generate
from finetune.evaluation.metrics import GSM8K_ANSWER_PATTERN, METRICS, score


def evaluate_generations(
    model,
    tokenizer,
    rows: Sequence[Mapping[str, Any]],
    *,
    metric: str = "exact_match",
    max_new_tokens: int = 256,
    batch_size: int = 8,
    num_samples: int | None = 5,
    pattern: str | None = GSM8K_ANSWER_PATTERN,
    case_sensitive: bool = False,
    use_chat_template: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate an answer for every row and score it.

    rows: mappings with "prompt" (a string or a list of chat messages) and, unless metric is none,
    "expected" (the reference answer; for exact_match a GSM8K answer with "#### 42" works as is).
    Returns {"metric", "score" (fraction correct; None for none), "n" (rows), "samples"}: the
    first `num_samples` rows (all of them when None) as {"prompt", "output", "expected", "correct"}.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    missing = [
        k for k, row in enumerate(rows) if "prompt" not in row or (metric != "none" and "expected" not in row)
    ]
    if missing:
        need = "prompt" if metric == "none" else "prompt and expected"
        raise ValueError(f"rows {missing[:5]} have no {need}; every row needs them for metric {metric}")
    outputs = generate(
        model,
        tokenizer,
        [row["prompt"] for row in rows],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        use_chat_template=use_chat_template,
        progress=progress,
    )
    results = [
        {
            "prompt": row["prompt"],
            "output": output,
            "expected": row.get("expected"),
            "correct": score(
                metric, output, row.get("expected"), pattern=pattern, case_sensitive=case_sensitive
            ),
        }
        for row, output in zip(rows, outputs, strict=True)
    ]
    return summarize(results, metric=metric, num_samples=num_samples)


def summarize(
    results: Sequence[Mapping[str, Any]], *, metric: str, num_samples: int | None = 5
) -> dict[str, Any]:
    """{"metric", "score", "n", "samples"} from scored rows: score is the fraction of rows correct
    (None for metric none or no rows).

    >>> summarize([{"correct": True}, {"correct": False}], metric="contains", num_samples=1)
    {'metric': 'contains', 'score': 0.5, 'n': 2, 'samples': [{'correct': True}]}
    """
    scored = [bool(r["correct"]) for r in results if r["correct"] is not None]
    value = sum(scored) / len(scored) if scored and metric != "none" else None
    samples = list(results if num_samples is None else results[:num_samples])
    return {"metric": metric, "score": value, "n": len(results), "samples": [dict(s) for s in samples]}
