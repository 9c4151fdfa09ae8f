"""`finetune eval`: eval loss and perplexity on the recipe's eval split, and generation metrics on its
`eval.generation_sets`, for one or more models side by side (base vs tuned), as eval.json and a table.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from finetune.evaluation.harness import harness_rows


def token_loss(model, batches) -> dict[str, float]:
    """Token-weighted cross-entropy and perplexity of `model` over collated batches (one process)."""
    from finetune.losses.causal_lm import token_loss_sums

    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for batch in batches:
            sums, counts = token_loss_sums(model, {k: v.to(device) for k, v in batch.items()})
            total += float(sums.sum())
            count += int(counts.sum())
    loss = total / max(count, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": count}


def evaluate_models(
    models: dict[str, Callable[[], tuple[Any, Any]]],
    *,
    eval_batches: Callable[[Any], Any] | None,
    sets: Sequence,
    batch_size: int,
    progress: bool = True,
    say: Callable[[str], None] = print,
    score: Callable[[str, Any, Any], dict[str, Any]] | None = None,
    device: torch.device | None = None,
    processor=None,
    image_max_pixels: int | None = None,
    base: Path | None = None,
    images_outside: bool = False,
    harness: Callable[[Any, Any], dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Evaluate each model: eval loss on the eval split when `eval_batches(tokenizer)` gives batches,
    `score(name, model, tokenizer)`'s results (preference recipes: the held-out pairs), and every
    generation set (a set's tool files are looked up in `base`, the recipe's folder, first), and
    `harness(model, tokenizer)`'s standard benchmarks (lm-evaluation-harness, finetune.evaluation.harness).

    The models are evaluated one at a time, in order (base first: preference scoring takes it as the
    reference): each loads, moves to `device`, is evaluated and is freed before the next loads, so peak
    memory is the largest model's, not their sum. Before that, every model after the first is loaded
    once and freed, so one that does not load (an adapter PEFT refuses) fails in seconds rather than
    after the others' evaluation: a load is seconds, an evaluation with generation sets minutes.
    A vision-language recipe's `processor` (the same for every model, as in training) reads the sets'
    images (opened and checked before any model loads, resized to `image_max_pixels`).
    """
    from finetune.generation.backends import backend_for
    from finetune.generation.sets import load_generation_rows, score_generation_sets

    vision = processor is not None
    rows = {
        s.name: load_generation_rows(
            s, vision=vision, image_max_pixels=image_max_pixels, images_outside=images_outside
        )
        for s in sets
    }
    for name, load in list(models.items())[1:]:  # the first loads next anyway
        say(f"checking that {name} loads")
        load()  # and dropped at once: only one model is in memory at any time
        _free_memory(device)
    results: dict[str, dict[str, Any]] = {}
    for name, load in models.items():
        say(f"loading {name}")
        model, tokenizer = load()
        if device is not None:
            model = model.to(device)
        say(f"evaluating {name}")
        result: dict[str, Any] = {}
        if eval_batches is not None:
            result.update(token_loss(model, eval_batches(tokenizer)))
        if score is not None:
            result.update(score(name, model, tokenizer))
        backend = backend_for("transformers", model, tokenizer, processor=processor)
        result["generation"] = score_generation_sets(
            backend, sets, rows, batch_size=batch_size, progress=progress, base=base
        )
        if harness is not None:
            result["lm_eval"] = harness(model, tokenizer)
        results[name] = result
        del model, backend  # the backend holds the model too
        _free_memory(device)
    return results


def _free_memory(device: torch.device | None) -> None:
    """Return a freed model's memory before the next loads: a collection pass for any reference cycle
    (PEFT wrappers hold some), and the CUDA cache back to the driver."""
    import gc

    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def write_report(results: dict[str, dict[str, Any]], path: Path, **context: Any) -> None:
    """eval.json: the context (recipe, model paths) and every model's results with all samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**context, "results": results}, indent=2, default=str) + "\n")


# Preference recipes: the held-out pairs' metrics (finetune.objectives.preference_eval), named as training
# logs them in progress.jsonl, in this order.
PREFERENCE_ROWS = (
    "eval_loss",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_logps/chosen",
    "eval_logps/rejected",
    "eval_preferred",
    "eval_kl",
)

# Reward-model recipes (train.objective reward): the held-out pairs' metrics, as training logs them.
REWARD_MODEL_ROWS = (
    "eval_loss",
    "eval_accuracy",
    "eval_margin",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
)


def comparison_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(metric, one formatted value per model) for every metric eval.json's results hold, in the
    table's order: `format_table`'s rows, and `finetune report`'s base-vs-tuned table."""
    names = list(results)
    first = results[names[0]]
    rows: list[tuple[str, list[str]]] = []
    for key in ("eval_loss", "eval_ppl"):
        if key in first:
            rows.append((key, [f"{results[n][key]:.4f}" for n in names]))
    if "preference" in first:
        for unit in ("eval_pairs", "eval_examples"):
            if unit in first["preference"]:
                counts = [str(results[n]["preference"][unit]) for n in names]
                rows.append((f"held-out {unit.removeprefix('eval_')}", counts))
        for key in PREFERENCE_ROWS:
            if key in first["preference"]:
                rows.append((key, [f"{results[n]['preference'][key]:.4f}" for n in names]))
    if "reward" in first:  # a reward model: the held-out pairs' scores, and which score head scored them
        rows.append(("held-out pairs", [str(results[n]["reward"]["eval_pairs"]) for n in names]))
        rows.append(("score head", [results[n]["reward"]["score_head"] for n in names]))
        for key in REWARD_MODEL_ROWS:
            rows.append((key, [f"{results[n]['reward'][key]:.4f}" for n in names]))
    if "rewards" in first:  # online RL: the held-out prompts' greedy completions, scored by the rewards
        rows.append(("held-out prompts", [str(results[n]["rewards"]["eval_prompts"]) for n in names]))
        for key in first["rewards"]:
            if key != "eval_prompts":
                rows.append((key, [f"{results[n]['rewards'][key]:.4f}" for n in names]))
    rows += harness_rows(results)
    for set_name, summary in first["generation"].items():
        if summary["metric"] != "none":
            rows.append(
                (
                    f"{set_name} {summary['metric']} (n={summary['n']})",
                    [_percent(results[n]["generation"][set_name]["score"]) for n in names],
                )
            )
    return rows


def format_table(results: dict[str, dict[str, Any]], *, samples: int = 2, width: int = 100) -> str:
    """Metrics as rows and models as columns, then sample answers of each model side by side."""
    names = list(results)
    first = results[names[0]]
    rows = comparison_rows(results)
    label_width = max([len("metric"), *(len(r[0]) for r in rows)])
    col = max(12, *(len(n) for n in names), *(len(v) for _, values in rows for v in values))
    lines = [f"{'metric':<{label_width}}  " + "  ".join(f"{n:>{col}}" for n in names)]
    lines += [
        f"{label:<{label_width}}  " + "  ".join(f"{v:>{col}}" for v in values) for label, values in rows
    ]
    for set_name, summary in first["generation"].items():
        for k, sample in enumerate(summary["samples"][:samples]):
            lines += ["", f"{set_name} sample {k + 1}: {_short(sample['prompt'], width)}"]
            if sample.get("images"):
                lines.append(f"  images: {_short(', '.join(sample['images']), width)}")
            if sample.get("expected") is not None:
                lines.append(f"  expected: {_short(sample['expected'], width)}")
            for n in names:
                other = results[n]["generation"][set_name]["samples"][k]
                mark = {True: " [correct]", False: " [wrong]"}.get(other["correct"], "")
                lines.append(f"  {n}{mark}: {_short(other['output'], width)}")
                if other.get("tool_calls"):  # tools in the loop: each call and the result it inserted
                    lines.append(f"    tools: {_short('; '.join(other['tool_calls']), width)}")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _short(text: Any, width: int) -> str:
    if not isinstance(text, str):
        text = " / ".join(f"{m.get('role')}: {_content(m.get('content'))}" for m in text)
    return textwrap.shorten(" ".join(text.split()), width=width, placeholder=" ...")


def _content(content: Any) -> Any:
    """A message content as text: a list of parts as its texts, each image as <image>."""
    if not isinstance(content, list):
        return content
    return "".join(
        "<image>"
        if isinstance(p, dict) and p.get("type") == "image"
        else str(p.get("text", "") if isinstance(p, dict) else p)
        for p in content
    )
