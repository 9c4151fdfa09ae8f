"""Generation sets end to end: rows -> greedy answers -> a score per row -> a summary.

`eval.generation_sets` are scored by `finetune eval` (`score_generation_sets` on each model) and,
with eval.during_training, at every evaluation of a training run (`generation_metrics`: the main
process generates, the scores go to progress.jsonl and the trackers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from finetune import trackers
from finetune.errors import FinetuneError
from finetune.generation.metrics import GSM8K_ANSWER_PATTERN, METRICS, require_math_verify, score
from finetune.generation.sampling import generate


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


def load_generation_rows(gen_set) -> list[dict[str, Any]]:
    """The rows of one generation set as {"prompt", "expected"} (its first num_rows rows).

    Loaded with the data layer's own loader (local files, Hub ids, damaged-file errors that name the
    file and line), then reduced to the two columns the set names.
    """
    from finetune.data.sources import load_source
    from finetune.recipe import dataset_entry

    label = f"eval.generation_sets[{gen_set.name}]"
    if gen_set.metric == "math_verify":
        require_math_verify(f"{label}.metric")
    entry = dataset_entry(path=gen_set.path, type="input_output", split=gen_set.split)
    ds = load_source(entry, entry_label=label)
    columns = [c for c in (gen_set.field_prompt, gen_set.field_expected) if c is not None]
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise FinetuneError(
            f"{label}: {gen_set.path} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); "
            "set field_prompt / field_expected"
        )
    if gen_set.num_rows is not None:
        ds = ds.select(range(min(gen_set.num_rows, len(ds))))
    return [
        {
            "prompt": row[gen_set.field_prompt],
            "expected": row.get(gen_set.field_expected) if gen_set.field_expected else None,
        }
        for row in ds
    ]


def score_generation_sets(
    model, tokenizer, sets: Sequence, rows: dict[str, list[dict]], *, batch_size: int, progress: bool = True
) -> dict[str, dict[str, Any]]:
    """{set name: {"metric", "score", "n", "samples"}} for every generation set."""
    results = {}
    for gen_set in sets:
        results[gen_set.name] = evaluate_generations(
            model,
            tokenizer,
            rows[gen_set.name],
            metric=gen_set.metric,
            max_new_tokens=gen_set.max_new_tokens,
            batch_size=batch_size,
            num_samples=gen_set.num_samples,
            pattern=gen_set.answer_pattern,
            case_sensitive=gen_set.case_sensitive,
            use_chat_template=gen_set.use_chat_template,
            progress=progress,
        )
    return results


def training_generation_rows(eval_settings, accelerator) -> dict[str, list[dict]]:
    """The eval.generation_sets' rows by set name, when they are scored during training ({} otherwise)."""
    from accelerate.utils import DistributedType

    if not (eval_settings.generation_sets and eval_settings.during_training):
        return {}
    sharded = accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.zero_stage == 3
    )
    if sharded:
        raise FinetuneError(
            "eval.generation_sets during training: generation with a sharded model (FSDP, ZeRO-3) is not "
            "supported; set eval.during_training: false and run `finetune eval` on the saved model"
        )
    return {s.name: load_generation_rows(s) for s in eval_settings.generation_sets}


SAMPLE_COLUMNS = ["prompt", "output", "expected", "correct"]


def generation_metrics(
    accelerator, model, tokenizer, eval_settings, rows: dict, *, step: int
) -> dict[str, Any]:
    """Generation sets scored on the main process (greedy decoding of the unwrapped model); the
    others wait. Scores and samples go to progress.jsonl, and to the trackers as scalars and tables."""
    acc, fields = accelerator, {}
    if acc.is_main_process:
        results = score_generation_sets(
            acc.unwrap_model(model),
            tokenizer,
            eval_settings.generation_sets,
            rows,
            batch_size=eval_settings.batch_size,
            progress=False,
        )
        for name, result in results.items():
            if result["score"] is not None:
                fields[f"eval_{name}_{result['metric']}"] = result["score"]
                trackers.log_scalars(acc, {f"eval/{name}_{result['metric']}": result["score"]}, step)
            fields[f"eval_{name}_samples"] = result["samples"]
            table = [[sample.get(c) for c in SAMPLE_COLUMNS] for sample in result["samples"]]
            trackers.log_table(acc, f"eval/{name}_samples", SAMPLE_COLUMNS, table, step)
    acc.wait_for_everyone()
    return fields
