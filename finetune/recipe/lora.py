"""The `lora` section: LoRA / DoRA / rsLoRA adapters and QLoRA's 4-bit base."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from finetune.recipe.base import Problem, _Section

# PEFT's LoraConfig.init_lora_weights values finetune passes through, and those it refuses, with why.
INIT_LORA_WEIGHTS = ("gaussian", "pissa", "olora", "eva", "corda")
DATA_DRIVEN = ("eva", "corda")
"""Inits computed from the training data before training (finetune.model.lora_init): their settings are the
sections lora.eva and lora.corda."""
INIT_REFUSED = {
    "loftq": "replaces the base weights by their quantized approximation, so the adapter only fits a base "
    "that finetune does not save; use pissa, or enable_qlora with the default init",
    "orthogonal": "is not passed through by finetune yet",
    "mica": "is not passed through by finetune yet",
}
MODIFIES_BASE = ("pissa", "olora", "corda")
"""Inits that move part of each base weight into the adapter: finetune saves the initial adapter
(output_dir/initial_adapter) and converts the trained one to plain LoRA against the original base."""


def modifies_base(lora: Any) -> bool:
    """Whether the lora section's adapters start by rewriting the base weights (MODIFIES_BASE)."""
    init = lora.init_lora_weights
    return bool(lora.enable_lora) and isinstance(init, str) and init.startswith(MODIFIES_BASE)


class EvaSettings(_Section):
    """PEFT's EvaConfig, and how much training data the init reads."""

    rho: float = Field(
        2.0,
        ge=1.0,
        description="EVA's rank redistribution: a layer gets at most lora_rank x rho (1 = every layer keeps "
        "lora_rank).",
    )
    tau: float = Field(
        0.99,
        ge=0.0,
        le=1.0,
        description="Cosine similarity of the singular vectors between two steps at which a layer has converged.",
    )
    use_label_mask: bool = Field(
        True,
        description="Only tokens with labels (the trained ones) enter the SVD; false: every token but padding.",
    )
    whiten: bool = Field(
        False, description="Divide each singular vector by the square root of its singular value."
    )
    adjust_scaling_factors: bool = Field(
        True, description="Scale a layer's lora_alpha by its new rank / lora_rank after the redistribution."
    )
    num_batches: int | None = Field(
        None,
        ge=1,
        description="Training micro-batches the SVD reads (repeated until every layer converges); null = the "
        "main process's share of the first epoch. Computed once, on the main process; a resumed run loads it "
        "from output_dir/lora_init.",
    )


class CordaSettings(_Section):
    """PEFT's CordaConfig, and how much training data the covariance reads."""

    corda_method: Literal["ipm", "kpm"] = Field(
        "ipm",
        description="ipm (instruction-previewed: the adapter starts from the directions the data uses most; "
        "faster fitting) or kpm (knowledge-preserved: from those it uses least, keeping what the base knows).",
    )
    use_float16_for_covariance: bool = Field(
        False, description="Accumulate the covariance in float16 (half the memory, less stable)."
    )
    num_batches: int | None = Field(
        None,
        ge=1,
        description="Training micro-batches whose rows (one forward each, padding removed) make the covariance; "
        "null = the main process's share of the first epoch. Computed once, on the main process; a resumed "
        "run loads it from output_dir/lora_init.",
    )


class LoraSection(_Section):
    fixed_on_resume: ClassVar[bool] = True  # every field, except those marked FREE_ON_RESUME

    enable_lora: bool = Field(False, description="Inject LoRA adapters with PEFT.")
    lora_rank: int = Field(16, ge=1, description="LoRA rank r.")
    lora_alpha: float = Field(
        16, gt=0, description="LoRA alpha (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA)."
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    lora_target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or `all-linear`."
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained fully and saved with the adapter (e.g. lm_head)."
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA scaling.")
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    save_lora_only: bool = Field(True, description="Final save holds the adapter, not the merged model.")
    enable_qlora: bool = Field(
        False, description="4-bit base weights (bitsandbytes) + LoRA; implies enable_lora."
    )
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit format.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too.")
    init_lora_weights: bool | str = Field(
        True,
        description="How PEFT initialises the adapter (LoraConfig.init_lora_weights): true (B = 0, A Kaiming: "
        "the adapter starts as a no-op), false (random, for tests), gaussian, pissa, pissa_niter_N (PiSSA "
        "with N randomized-SVD iterations), olora, eva or corda. pissa and olora start from the base weights' "
        "principal directions, corda from those weighted by the covariance of the layer inputs over the "
        "training data (lora.corda), and subtract them from the base; the saved adapter is converted to plain "
        "LoRA against the original base (PEFT's path_initial_model_for_weight_conversion, 2 x lora_rank). eva "
        "sets each A to the principal directions of the layer's inputs over the training data and "
        "redistributes the ranks across layers (lora.eva). Not accepted: "
        + ", ".join(INIT_REFUSED)
        + " (the error says why).",
    )
    eva: EvaSettings = Field(
        default_factory=EvaSettings, description="EVA's settings (init_lora_weights: eva)."
    )
    corda: CordaSettings = Field(
        default_factory=CordaSettings, description="CorDA's settings (init_lora_weights: corda)."
    )
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        description="LoRA+: the B matrices train at lr x this ratio, the A matrices at lr (PEFT's "
        "create_loraplus_optimizer; the paper suggests 16); null = off.",
    )
    init_adapter: str | None = Field(
        None,
        description="A trained adapter folder to start from (e.g. an SFT run's output_dir, then DPO or GRPO on "
        "top): its weights are trained further. Its base must be this recipe's model and its LoRA settings "
        "(rank, alpha, targets, modules_to_save, DoRA, rsLoRA) this section's: both are checked at start.",
    )

    @field_validator("init_lora_weights", mode="before")
    @classmethod
    def _known_init(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if value in INIT_REFUSED:
            raise PydanticCustomError(
                "refused_init",
                "{name} is not supported: it {reason}",
                {"name": value, "reason": INIT_REFUSED[value]},
            )
        if not isinstance(value, str) or not (
            value in INIT_LORA_WEIGHTS or re.fullmatch(r"pissa_niter_[1-9]\d*", value)
        ):
            raise PydanticCustomError(
                "init_lora_weights",
                "is not one of true, false, gaussian, pissa, pissa_niter_N (N a positive number of iterations), olora, "
                "eva, corda",
            )
        return value

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if (
            ok("init_lora_weights", "init_adapter")
            and self.init_adapter
            and self.init_lora_weights is not True
        ):
            problems.append(
                (
                    "init_lora_weights",
                    self.init_lora_weights,
                    "does nothing with init_adapter, whose trained weights are loaded: drop one of them",
                )
            )
        problems += self._data_driven_problems(ok)
        if (
            ok("loraplus_lr_ratio", "enable_lora")
            and self.loraplus_lr_ratio is not None
            and not self.enable_lora
        ):
            problems.append(
                (
                    "loraplus_lr_ratio",
                    self.loraplus_lr_ratio,
                    "sets the LoRA B learning rate: set enable_lora: true",
                )
            )
        # enable_qlora implies enable_lora (filled in by finetune.recipe.defaults when it is not set):
        # what is left here is an explicit contradiction.
        if ok("enable_qlora", "enable_lora") and self.enable_qlora and not self.enable_lora:
            problems.append(
                ("enable_lora", False, "enable_qlora trains LoRA adapters: set enable_lora: true or drop it")
            )
        if ok("init_adapter", "enable_lora") and self.init_adapter and not self.enable_lora:
            problems.append(
                ("init_adapter", self.init_adapter, "starts LoRA training: set enable_lora: true")
            )
        return problems

    def _data_driven_problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """Settings of a data-driven init that is not chosen do nothing; CorDA rewrites the base weights,
        which a 4-bit base cannot take."""
        problems: list[Problem] = []
        for name in DATA_DRIVEN:
            settings = getattr(self, name)
            if (
                ok("init_lora_weights", name)
                and self.init_lora_weights != name
                and settings != type(settings)()
            ):
                changed = sorted(settings.model_fields_set)
                problems.append(
                    (
                        name,
                        {k: getattr(settings, k) for k in changed},
                        f"does nothing unless init_lora_weights: {name}",
                    )
                )
        if (
            ok("init_lora_weights", "enable_qlora")
            and self.init_lora_weights == "corda"
            and self.enable_qlora
        ):
            problems.append(
                (
                    "init_lora_weights",
                    "corda",
                    "rewrites the base weights (weight minus the adapter's start), which a 4-bit base cannot "
                    "hold (PEFT decomposes full-precision weights): drop enable_qlora, or use eva or pissa",
                )
            )
        return problems
