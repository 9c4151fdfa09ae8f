"""The `preference` section: the settings of the preference objectives (dpo, ipo, simpo, orpo, kto).

Which objective reads which field is the objective table's business (finetune.recipe.objectives):
a field set to something other than its default under an objective that does not read it is an
error naming the objectives that do. Every field is fixed on resume (it shapes the loss).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from finetune.recipe.base import _Section


class PreferenceSection(_Section):
    fixed_on_resume: ClassVar[bool] = True

    beta: float = Field(
        0.1,
        gt=0,
        description="TRL's beta: DPO/KTO temperature of the implicit reward, IPO's tau, SimPO's reward "
        "scale, ORPO's lambda weighting the odds-ratio term.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo, simpo: probability that a preference label is flipped (0 = off; 0.1 is typical).",
    )
    dpo_smoothing: Literal["conservative", "robust"] = Field(
        "conservative",
        description="dpo with label_smoothing > 0: conservative (cDPO, Mitchell 2023) or robust (rDPO, "
        "Chowdhury et al. 2024; TRL's loss_type robust).",
    )
    simpo_gamma: float = Field(
        0.5,
        description="simpo: target reward margin gamma (TRL's simpo_gamma; the paper's gamma/beta 0.3-0.8).",
    )
    orpo_nll_reduction: Literal["sequence", "batch"] = Field(
        "sequence",
        description="orpo: the NLL term per pair over its chosen completion tokens (sequence, the paper; "
        "independent of how pairs are batched) or TRL's (batch: a token mean over every token, prompt "
        "included, of the micro-batch's chosen sequences).",
    )
    kto_desirable_weight: float = Field(1.0, gt=0, description="kto: weight of the desirable examples' loss.")
    kto_undesirable_weight: float = Field(
        1.0, gt=0, description="kto: weight of the undesirable examples' loss."
    )
    precompute_ref_log_probs: bool = Field(
        False,
        description="dpo, ipo, kto: compute the reference log-probs of every prepared pair once before "
        "training and cache them next to the prepared data (keyed by its fingerprint and the reference "
        "model), instead of a reference forward every step. Without it the reference is the base with the "
        "adapters disabled (LoRA) or a frozen copy of the initial model (full fine-tuning).",
    )
