"""The `lora` section: LoRA / DoRA / rsLoRA adapters and QLoRA's 4-bit base."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

from pydantic import Field

from finetune.recipe.base import Problem, _Section


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
    init_adapter: str | None = Field(
        None,
        description="A trained adapter folder to start from (e.g. an SFT run's output_dir, then DPO or GRPO on "
        "top): its weights are trained further. Its base must be this recipe's model and its LoRA settings "
        "(rank, alpha, targets, modules_to_save, DoRA, rsLoRA) this section's: both are checked at start.",
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
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
