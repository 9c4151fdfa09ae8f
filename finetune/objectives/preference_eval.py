"""`finetune eval` for preference recipes: did the tuned model learn to prefer the chosen answers?

Every model is scored on the recipe's held-out pairs (kto: labelled examples) with the same packed
batches, forwards and loss functions as training (finetune.objectives.preference_scores), and with the base
model as the reference, which is what training uses for LoRA (adapters disabled) and for full
fine-tuning (a frozen copy of the initial weights). So the tuned model's figures are the `eval_`
metrics training logs at its end, and the base model's are those of step 0 (its rewards are 0: it is
its own reference).

Besides the objective's loss and implicit rewards, each model gets a reference-free figure that
means the same for every objective: `preferred`, the fraction of pairs whose chosen completion has
the higher log-prob sum (kto: not defined, there are no pairs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import finetune.objectives.preference_scores as objective
from finetune.losses.preference import kto_reference_point
from finetune.recipe.objectives import OBJECTIVES


@torch.no_grad()
def score_batches(model, batches: Iterable[dict], *, name: str, settings, device) -> list[dict[str, Any]]:
    """One model's log-prob sums for every batch (kept on the CPU, in batch order)."""
    paired = OBJECTIVES[name].kind == "paired"
    was_training = model.training
    model.eval()
    scored = []
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        sums, counts, nll = objective.policy_logps(model, batch, name=name, settings=settings)
        entry = {
            "sums": sums.float().cpu(),
            "counts": counts.cpu(),
            "nll": None if nll is None else tuple(t.float().cpu() for t in nll),
            "num_units": batch["num_units"].cpu(),
            "desirable": batch["desirable"].cpu() if "desirable" in batch else None,
        }
        if not paired:  # kto: the KL rows (mismatched completions) for the reference point
            entry["kl"] = objective.completion_logps(model, batch, paired=False, kl=True).float().cpu()
        scored.append(entry)
    model.train(was_training)
    return scored


def summarize(scored: list[dict], reference: list[dict] | None, *, name: str, settings) -> dict[str, float]:
    """The objective's eval_ metrics for one model's scores against the reference's (dpo, ipo, kto),
    averaged over the held-out units as training averages them, plus `eval_preferred` (pairs)."""
    spec = OBJECTIVES[name]
    paired = spec.kind == "paired"
    if spec.reference and reference is None:
        raise ValueError(f"{name} needs the reference model's scores")
    totals: dict[str, float] = {}
    preferred = 0.0
    for k, entry in enumerate(scored):
        ref = reference[k] if spec.reference else None
        scores = objective.SequenceScores(
            entry["sums"],
            entry["counts"],
            entry["nll"],
            ref=None if ref is None else ref["sums"],
            desirable=entry["desirable"],
        )
        if not paired:
            scores.z0 = kto_reference_point(entry["kl"], ref["kl"])
        out = objective.LOSSES[name](scores, settings)
        values = {
            "loss": out.losses,
            **objective.unit_values(out, entry["desirable"], scores.z0, paired=paired),
        }
        for key, value in values.items():
            totals[key] = totals.get(key, 0.0) + float(value.float().sum())
        totals["units"] = totals.get("units", 0.0) + float(entry["num_units"].sum())
        if paired:
            preferred += float((entry["sums"][0::2] > entry["sums"][1::2]).float().sum())
    metrics = objective.eval_means(totals, paired=paired, unit=spec.unit)
    if paired and totals.get("units"):
        metrics["eval_preferred"] = preferred / totals["units"]
    return metrics


def preference_scorer(
    batches: Callable[[Any], Iterable[dict]], *, name: str, settings, device
) -> Callable[[str, Any, Any], dict[str, Any]]:
    """A per-model hook for finetune.evaluation.compare.evaluate_models: {"preference": eval_ metrics}. Models
    come in order and "base" first when the objective has a reference (it is every model's reference)."""
    reference: dict[str, list[dict]] = {}

    def score(model_name: str, model, tokenizer) -> dict[str, Any]:
        scored = score_batches(model, batches(tokenizer), name=name, settings=settings, device=device)
        if model_name == "base":
            reference["base"] = scored
        return {"preference": summarize(scored, reference.get("base"), name=name, settings=settings)}

    return score
