"""The arithmetic of the preference objectives, shared by training (finetune.objectives.preference)
and `finetune eval` (finetune.objectives.preference_eval), so that held-out pairs are scored with
exactly the numbers training logs: per-sequence log-prob sums of a batch (`policy_logps`,
`completion_logps`), each objective's loss on them (`LOSSES`, by objective name), the per-unit
metric values and their held-out means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from finetune.constants import IGNORE_INDEX
from finetune.losses import preference as losses
from finetune.losses.causal_lm import forward
from finetune.recipe.objectives import OBJECTIVES


def policy_logps(model, batch: dict, *, name: str, settings) -> tuple:
    """A forward of `model` on a packed batch (or a vision-language batch, one sequence per row):
    (per-sequence completion log-prob sums, their token counts, ORPO's batch-NLL sums and counts over
    every token of the chosen sequences, or None)."""
    labels, position_ids = batch["labels"], batch.get("position_ids")  # None: one sequence per row
    num_sequences = batch["num_units"] * (2 if OBJECTIVES[name].kind == "paired" else 1)
    logits = forward(model, _model_inputs(batch)).logits
    orpo_batch_nll = name == "orpo" and settings.orpo_nll_reduction == "batch"
    if orpo_batch_nll:  # TRL's NLL term scores the prompt too: one log-prob per real token
        real = real_tokens(batch, num_sequences)
        token_logps = losses.token_logps(logits, batch["input_ids"].masked_fill(~real, IGNORE_INDEX))
    else:
        token_logps = losses.token_logps(logits, labels)
    total = int(num_sequences.sum())  # sync point (sequence_sums has one anyway)
    sums, counts = losses.sequence_sums(
        token_logps, labels != IGNORE_INDEX, position_ids, num_sequences=total
    )
    nll = None
    if orpo_batch_nll:
        all_sums, all_counts = losses.sequence_sums(token_logps, real, position_ids, num_sequences=total)
        nll = (all_sums[0::2], all_counts[0::2])
    return sums, counts, nll


def completion_logps(model, batch: dict, *, paired: bool, kl: bool = False) -> torch.Tensor:
    """Per-sequence completion log-prob sums of a packed batch (kto's KL rows with `kl`), no gradient
    taken here: the caller decides (a reference pass wraps it in no_grad)."""
    inputs = _kl_inputs(batch) if kl else batch
    logits = forward(model, _model_inputs(inputs)).logits
    num_sequences = int(batch["num_units"].sum()) * (2 if paired and not kl else 1)
    return _completion_sums(logits, inputs, num_sequences)


@dataclass
class SequenceScores:
    """What a preference loss reads from a micro-batch: per-sequence completion log-prob sums (pairs
    interleaved chosen, rejected; kto: one per example), their token counts, ORPO's batch NLL (or
    None), the reference's sums `ref` (dpo, ipo, kto), kto's labels and reference point `z0`."""

    sums: torch.Tensor
    counts: torch.Tensor
    nll: tuple | None = None
    ref: torch.Tensor | None = None
    desirable: torch.Tensor | None = None
    z0: torch.Tensor | None = None

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log-prob sums of the pairs."""
        return self.sums[0::2], self.sums[1::2]

    @property
    def ref_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) log-prob sums."""
        return self.ref[0::2], self.ref[1::2]

    @property
    def count_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) completion token counts."""
        return self.counts[0::2], self.counts[1::2]


def _dpo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    smoothing = {"label_smoothing": settings.label_smoothing, "smoothing": settings.dpo_smoothing}
    return losses.dpo_loss(*s.pair, *s.ref_pair, beta=settings.beta, **smoothing)


def _ipo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    return losses.ipo_loss(*s.pair, *s.ref_pair, *s.count_pair, beta=settings.beta)


def _simpo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    margin = {"gamma": settings.simpo_gamma, "label_smoothing": settings.label_smoothing}
    return losses.simpo_loss(*s.pair, *s.count_pair, beta=settings.beta, **margin)


def _orpo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    nll = s.nll if s.nll is not None else (s.pair[0], s.count_pair[0])
    return losses.orpo_loss(
        *s.pair, *s.count_pair, *nll, beta=settings.beta, nll_reduction=settings.orpo_nll_reduction
    )


def _kto(s: SequenceScores, settings) -> losses.PreferenceLoss:
    return losses.kto_loss(
        s.sums, s.ref, s.desirable, s.z0,
        beta=settings.beta, desirable_weight=settings.kto_desirable_weight,
        undesirable_weight=settings.kto_undesirable_weight,
    )  # fmt: skip


LOSSES: dict[str, Callable[[SequenceScores, Any], losses.PreferenceLoss]] = {
    "dpo": _dpo,
    "ipo": _ipo,
    "simpo": _simpo,
    "orpo": _orpo,
    "kto": _kto,
}
"""Each preference objective's per-pair (kto: per-example) losses, by name (the objective table's)."""


def unit_values(
    out: losses.PreferenceLoss, desirable: torch.Tensor | None, z0: torch.Tensor | None, *, paired: bool
) -> dict[str, torch.Tensor]:
    """Per-unit values whose sums are averaged (over units, or over a `count:` sum)."""
    if paired:
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        return {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/accuracies": (chosen > rejected).float(),
            "rewards/margins": chosen - rejected,
            "logps/chosen": out.chosen_logps,
            "logps/rejected": out.rejected_logps,
        }
    values = {"kl": z0.expand(len(desirable))}
    for side, mask, rewards, logps in (
        ("chosen", desirable, out.chosen_rewards, out.chosen_logps),
        ("rejected", ~desirable, out.rejected_rewards, out.rejected_logps),
    ):
        for name, picked in ((f"rewards/{side}", rewards), (f"logps/{side}", logps)):
            values[name] = torch.zeros(len(mask), device=mask.device).masked_scatter(mask, picked.float())
            values[f"count:{name}"] = mask.float()
    return values


def eval_means(sums: dict[str, float], *, paired: bool, unit: str) -> dict[str, float]:
    """eval_<name> means from sums over units (`units`) or over their own `count:<name>`."""
    sums = dict(sums)
    units = sums.pop("units")
    out = {}
    for name, total in sums.items():
        if name.startswith("count:"):
            continue
        count = sums.get(f"count:{name}", units)
        if count > 0:
            out[f"eval_{name}"] = total / count
    if not paired and "eval_rewards/chosen" in out and "eval_rewards/rejected" in out:
        out["eval_rewards/margins"] = out["eval_rewards/chosen"] - out["eval_rewards/rejected"]
    out[f"eval_{unit}"] = int(units)
    return out


# ------------------------------------------------------------------------------------------ helpers


# Batch keys that are not model inputs (a vision-language batch passes every other key: pixels, masks).
_NOT_MODEL_INPUTS = {"labels", "num_units", "row_index", "desirable", "seq_lens"}


def _model_inputs(batch: dict) -> dict:
    if "position_ids" not in batch:  # a vision-language batch: padded rows, attention mask and pixels
        return {k: v for k, v in batch.items() if k not in _NOT_MODEL_INPUTS and not k.startswith("kl_")}
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}


def _kl_inputs(batch: dict) -> dict:
    """Kto's KL rows in place of the rows (same layout: one KL sequence per example); a vision-language
    batch's KL rows bring their attention mask, pixels and image-token types (every `kl_` key)."""
    if "position_ids" not in batch:
        return {k.removeprefix("kl_"): v for k, v in batch.items() if k.startswith("kl_")}
    return {k: batch[f"kl_{k}"] for k in ("input_ids", "labels", "position_ids")}


def _completion_sums(logits: torch.Tensor, inputs: dict, num_sequences: int) -> torch.Tensor:
    """Per-sequence sums of the completion tokens' log-probs of a packed batch (row-major)."""
    token_logps = losses.token_logps(logits, inputs["labels"])
    mask = inputs["labels"] != IGNORE_INDEX
    return losses.sequence_sums(token_logps, mask, inputs.get("position_ids"), num_sequences=num_sequences)[0]


def real_tokens(batch: dict, num_sequences: torch.Tensor) -> torch.Tensor:
    """Tokens of a row's real sequences (not its padding, which forms segments after them; a
    vision-language batch's rows are one sequence each, its attention mask says which tokens are real)."""
    if "position_ids" not in batch:
        return batch["attention_mask"].bool()
    position_ids = batch["position_ids"]
    starts = position_ids == 0
    starts[:, 0] = True
    segment = torch.cumsum(starts, dim=1) - 1
    return segment < num_sequences.to(segment.device)[:, None]


def per_row(
    num_units: torch.Tensor, heads: torch.Tensor, tails: torch.Tensor | None, *, paired: bool
) -> list:
    """Split a batch's row-major per-sequence values by row: 2 x units values each (pairs: chosen and
    rejected in turn; kto: the examples, then their KL sequences)."""
    units = num_units.tolist()
    per_head = [2 * n for n in units] if paired else units
    rows = list(torch.split(heads, per_head))
    if tails is not None:
        rows = [torch.cat([h, t]) for h, t in zip(rows, torch.split(tails, units), strict=True)]
    return rows
