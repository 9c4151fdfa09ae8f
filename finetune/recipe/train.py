"""The `train` section: optimisation, schedule, precision, checkpoints, evaluation and logging."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from finetune.recipe.base import Problem, _Section

Objective = Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto"]
PAIRED_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
"""Objectives trained on preference pairs (dataset type `preference`); `kto` takes type `kto`."""
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
"""Objectives whose loss compares the policy with a reference model (SimPO and ORPO need none)."""

# Which objectives read each objective-specific field: a non-default value under another objective
# is an error naming the objectives it belongs to (never silently ignored).
OBJECTIVE_FIELDS: dict[str, tuple[str, ...]] = {
    "loss_chunk_size": ("sft",),  # the chunked cross-entropy of the SFT loss
    "beta": ("dpo", "ipo", "simpo", "orpo", "kto"),
    "label_smoothing": ("dpo", "simpo"),
    "dpo_smoothing": ("dpo",),
    "simpo_gamma": ("simpo",),
    "orpo_nll_reduction": ("orpo",),
    "kto_desirable_weight": ("kto",),
    "kto_undesirable_weight": ("kto",),
    "precompute_ref_log_probs": REFERENCE_OBJECTIVES,
}


class TrainSection(_Section):
    output_dir: str = Field(description="Checkpoints, logs, final weights.")
    objective: Objective = Field(
        "sft",
        description="What is trained: sft (next-token loss on the trained tokens), or preference tuning: "
        "dpo, ipo, simpo, orpo (on `preference` pairs) or kto (on `kto` examples labelled desirable or not).",
    )
    seed: int = Field(42, description="Global seed (data order, init, dropout).")
    micro_batch_size: int = Field(1, ge=1, description="Rows per device per micro step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro steps per optimizer step.")
    num_train_epochs: float = Field(1, gt=0, description="Passes over the data.")
    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps; overrides epochs and bounds the LR schedule."
    )
    mixed_precision: Literal["bf16", "fp16", "no"] = Field(
        "bf16", description="bf16, fp16 (dynamic loss scaling), or no."
    )
    gradient_checkpointing: bool = Field(False, description="Activation recomputation (non-reentrant).")
    loss_chunk_size: int | None = Field(
        None,
        ge=0,
        description="Tokens per chunk of the output head and cross-entropy, which then never materialise "
        "the whole [tokens x vocab] logits or their gradient; 0 = off (full logits); null = auto: on (with "
        "a chunk whose fp32 logits fit in 256 MiB) once a micro batch's fp32 logits would reach 1 GB.",
    )
    optimizer: Literal["adamw", "adamw_8bit", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(5e-5, gt=0, description="Peak learning rate.")
    lr_min: float = Field(0.0, ge=0, description="Learning-rate floor at the end of the decay.")
    lr_warmup_ratio: float = Field(
        0.0, ge=0, lt=1, description="Fraction of optimizer steps spent warming up."
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="LR schedule after warmup."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    no_decay_params: list[str] = Field(
        default_factory=lambda: ["bias", "norm"],
        description="Parameters whose name contains one of these (case-insensitive) get no weight decay.",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clipping threshold; null = off.")
    save_steps: int = Field(0, ge=0, description="Checkpoint every N optimizer steps (0 or null = off).")
    save_epochs: float = Field(
        1, ge=0, description="Checkpoint every N epochs, fractions allowed (0 or null = off)."
    )
    save_total_limit: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints.")
    save_hf_weights: bool = Field(True, description="Write HF-format weights or adapter at the end.")
    load_checkpoint_path: str | None = Field(
        None, description="A checkpoint to resume from, or `auto` for the latest in output_dir."
    )
    eval_steps: int | None = Field(
        None,
        ge=1,
        description="Evaluate every N steps, and at the end when there is eval data (0 or null = only at the end).",
    )
    log_steps: int = Field(1, ge=1, description="Log every N optimizer steps.")
    log_format: Literal["progress_bar", "structured"] = Field(
        "progress_bar", description="progress_bar (tqdm) or structured (key=value lines)."
    )
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="Trackers (through Accelerate)."
    )
    accelerate_config: str | None = Field(
        None, description="Name in accelerate_configs/ or a path, used by `finetune train`."
    )
    exit_duration_in_mins: float | None = Field(
        None, gt=0, description="Checkpoint and exit cleanly after this many minutes."
    )
    iterations_to_skip: list[int] = Field(
        default_factory=list, description="Optimizer steps whose batches are consumed without an update."
    )
    max_consecutive_nonfinite: int = Field(
        5, ge=1, description="Nonfinite losses in a row before aborting (each one skips its step)."
    )
    enable_profiling: bool = Field(False, description="Write a torch profiler trace for a step window.")
    profile_start_step: int = Field(1, ge=1, description="First profiled optimizer step.")
    profile_end_step: int = Field(2, ge=1, description="Last profiled optimizer step.")
    profile_trace_dir: str = Field("trace", description="Trace folder, relative to output_dir.")
    enable_full_determinism: bool = Field(False, description="Deterministic algorithms (slower).")
    empty_cache_steps: int = Field(
        0, ge=0, description="Release the accelerator cache every N steps (0 or null = off)."
    )
    gc_steps: int = Field(
        0, ge=0, description="Run Python garbage collection every N steps (0 or null = off)."
    )
    eval_on_start: bool = Field(
        False, description="Evaluate once before the first step (not when resuming), as a baseline."
    )
    # Preference objectives (finetune.losses.preference); OBJECTIVE_FIELDS says which reads which.
    beta: float = Field(
        0.1,
        gt=0,
        description="dpo/ipo/simpo/orpo/kto: TRL's beta (DPO/KTO temperature of the implicit reward, IPO's "
        "tau, SimPO's reward scale, ORPO's lambda weighting the odds-ratio term).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo/simpo: probability that a preference label is flipped (0 = off; 0.1 is typical).",
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
        description="dpo/ipo/kto: compute the reference log-probs of every prepared pair once before training "
        "and cache them next to the prepared data (keyed by its fingerprint and the reference model), "
        "instead of a reference forward every step. Without it the reference is the base with the "
        "adapters disabled (LoRA) or a frozen copy of the initial model (full fine-tuning).",
    )

    @field_validator("save_steps", "empty_cache_steps", "gc_steps", "save_epochs", mode="before")
    @classmethod
    def _null_is_off(cls, value: Any) -> Any:
        # One way to say "off" for every cadence: 0 and null both mean never.
        return 0 if value is None else value

    @field_validator("eval_steps", mode="before")
    @classmethod
    def _zero_is_off(cls, value: Any) -> Any:
        return None if value == 0 and not isinstance(value, bool) else value

    def _warnings(self) -> list[Problem]:
        found: list[Problem] = []
        if self.max_steps is not None and self.save_steps > self.max_steps:
            found.append(
                (
                    "save_steps",
                    self.save_steps,
                    f"is larger than max_steps ({self.max_steps}): no periodic checkpoint will be written "
                    "(the run still ends with its final save)",
                )
            )
        if self.max_steps is not None and self.eval_steps and self.eval_steps > self.max_steps:
            found.append(
                (
                    "eval_steps",
                    self.eval_steps,
                    f"is larger than max_steps ({self.max_steps}): only the final evaluation runs",
                )
            )
        if self.lr_min > self.lr:
            found.append(
                ("lr_min", self.lr_min, f"exceeds lr ({self.lr}): the schedule rises instead of decaying")
            )
        if self.enable_profiling and self.profile_end_step < self.profile_start_step:
            found.append(
                (
                    "profile_end_step",
                    self.profile_end_step,
                    f"is before profile_start_step ({self.profile_start_step}): only that one step is profiled",
                )
            )
        if any(step < 1 for step in self.iterations_to_skip):
            found.append(
                ("iterations_to_skip", self.iterations_to_skip, "steps count from 1: step 0 is never skipped")
            )
        if self.optimizer == "sgd" and (self.adam_beta1, self.adam_beta2) != (0.9, 0.999):
            found.append(("optimizer", "sgd", "adam_beta1/adam_beta2 are set but sgd ignores them"))
        if self.objective == "dpo" and self.dpo_smoothing != "conservative" and self.label_smoothing == 0:
            found.append(("dpo_smoothing", self.dpo_smoothing, "has no effect without label_smoothing > 0"))
        return found

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """Objective-specific fields set for an objective that does not read them (an error: the value
        would do nothing)."""
        problems: list[Problem] = []
        if not ok("objective"):
            return problems
        for name, owners in OBJECTIVE_FIELDS.items():
            value = getattr(self, name)
            if not ok(name) or self.objective in owners or value == type(self).model_fields[name].default:
                continue
            problems.append(
                (
                    name,
                    value,
                    f"belongs to train.objective {' / '.join(owners)}, not {self.objective!r}; remove it "
                    "or change the objective",
                )
            )
        return problems
