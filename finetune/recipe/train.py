"""The `train` section: what every objective shares (optimisation, schedule, precision, checkpoints,
evaluation, logging). An objective's own settings live in its section (finetune.recipe.objectives)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

import finetune.recipe.optimizers as optimizers
from finetune.recipe.base import FIXED_ON_RESUME, Problem, _Section
from finetune.recipe.objectives import ObjectiveName
from finetune.recipe.parallel import EXPERT_REFUSAL, PIPELINE_REFUSAL, parallel_warnings
from finetune.trackers import TRACKERS


class TrainSection(_Section):
    output_dir: str = Field(description="Checkpoints, logs, final weights.")
    objective: ObjectiveName = Field(
        "sft",
        description="What is trained: sft (next-token loss on the trained tokens), or preference tuning: "
        "dpo, ipo, simpo, orpo (on `preference` pairs) or kto (on `kto` examples labelled desirable or not), "
        "with their settings in the `preference` section.",
        **FIXED_ON_RESUME,
    )
    seed: int = Field(42, description="Global seed (data order, init, dropout).", **FIXED_ON_RESUME)
    micro_batch_size: int = Field(1, ge=1, description="Rows per device per micro step.", **FIXED_ON_RESUME)
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro steps per optimizer step.", **FIXED_ON_RESUME
    )
    num_train_epochs: float = Field(1, gt=0, description="Passes over the data.", **FIXED_ON_RESUME)
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps; overrides epochs and bounds the LR schedule.",
        **FIXED_ON_RESUME,
    )
    mixed_precision: Literal["bf16", "fp16", "no"] = Field(
        "bf16",
        description="bf16, fp16 (dynamic loss scaling), or no.",
        **FIXED_ON_RESUME,
    )
    gradient_checkpointing: bool = Field(False, description="Activation recomputation (non-reentrant).")
    loss_chunk_size: int | None = Field(
        None,
        ge=0,
        description="Tokens per chunk of the output head and cross-entropy, which then never materialise "
        "the whole [tokens x vocab] logits or their gradient; 0 = off (full logits); null = auto: on (with "
        "a chunk whose fp32 logits fit in 256 MiB) once a micro batch's fp32 logits would reach 1 GB. On CUDA "
        "with liger-kernel installed a plain linear head's chunked loss is Liger's fused linear cross-entropy.",
        **FIXED_ON_RESUME,
    )
    optimizer: Literal[optimizers.OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "adamw", description=optimizers.describe(), **FIXED_ON_RESUME
    )
    optim_args: dict[str, float | int | bool | str] = Field(
        default_factory=dict,
        description="The optimizer's own settings, passed to transformers as its `optim_args` (e.g. GaLore's "
        "and APOLLO's rank, update_proj_gap, scale, proj_type; AdEMAMix's alpha, beta3; sgd's momentum); "
        f"for muon: {', '.join(optimizers.MUON_ARGS)}. Names the optimizer does not read are refused for "
        "muon, and left to transformers (which ignores them) otherwise.",
        **FIXED_ON_RESUME,
    )
    optim_target_modules: list[str] | Literal["all-linear"] | None = Field(
        None,
        description="GaLore and APOLLO optimizers: the linear modules whose gradients are projected to low "
        "rank (names, a regex, or all-linear); transformers' `optim_target_modules`. Required by them, "
        "unused by the others.",
        **FIXED_ON_RESUME,
    )
    neftune_noise_alpha: float | None = Field(
        None,
        gt=0,
        description="NEFTune: uniform noise of magnitude alpha/sqrt(L*d) added to the input embeddings in "
        "training forwards only (not evaluation, generation or GRPO rollouts), through transformers' "
        "neftune_post_forward_hook; the paper uses 5; null = off.",
        **FIXED_ON_RESUME,
    )
    lr: float = Field(5e-5, gt=0, description="Peak learning rate.", **FIXED_ON_RESUME)
    lr_min: float = Field(
        0.0, ge=0, description="Learning-rate floor at the end of the decay.", **FIXED_ON_RESUME
    )
    lr_warmup_ratio: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Fraction of optimizer steps spent warming up.",
        **FIXED_ON_RESUME,
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "cosine",
        description="LR schedule after warmup.",
        **FIXED_ON_RESUME,
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.", **FIXED_ON_RESUME)
    no_decay_params: list[str] = Field(
        default_factory=lambda: ["bias", "norm"],
        description="Parameters whose name contains one of these (case-insensitive) get no weight decay.",
        **FIXED_ON_RESUME,
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.", **FIXED_ON_RESUME)
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.", **FIXED_ON_RESUME)
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.", **FIXED_ON_RESUME)
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clipping threshold; null = off.", **FIXED_ON_RESUME
    )
    save_steps: int = Field(0, ge=0, description="Checkpoint every N optimizer steps (0 or null = off).")
    save_epochs: float = Field(
        1, ge=0, description="Checkpoint every N epochs, fractions allowed (0 or null = off)."
    )
    save_total_limit: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints.")
    save_hf_weights: bool = Field(True, description="Write HF-format weights or adapter at the end.")
    load_checkpoint_path: str | None = Field(
        None, description="A checkpoint to resume from, or `auto` for the latest in output_dir."
    )
    extend_run: bool = Field(
        False,
        description="Resume (train.load_checkpoint_path) with a larger max_steps or num_train_epochs than the "
        "checkpoint's run, which a resume otherwise refuses: the LR schedule is rebuilt for the new total "
        "(warmup and decay placed as for a run started with it) and continues from the checkpoint's step. "
        "Only lengthens; every other setting fixed on resume must stay.",
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
    report_to: list[Literal[tuple(TRACKERS)]] = Field(  # type: ignore[valid-type]
        default_factory=list,
        description=f"Trackers (through Accelerate): {', '.join(TRACKERS)}. Each needs its package "
        "installed (checked at start); tables and images a tracker does not take stay in "
        "progress.jsonl and output_dir/samples (said once at start). Configure them through their "
        "own environment variables (MLFLOW_TRACKING_URI, WANDB_MODE, TRACKIO_DIR, ...).",
    )
    accelerate_config: str | None = Field(
        None, description="Name in accelerate_configs/ or a path, used by `finetune train`."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Tensor parallel: each decoder layer's attention and MLP weights split over this many "
        "processes by the model's own TP plan (transformers' DistributedConfig, DTensor), every process of a "
        "group reading the same batch. Divides the number of processes (DDP launcher: multi_cpu, multi_gpu); "
        "more processes run data parallel across the groups (transformers' FSDP2, full fine-tuning only); "
        "sft; LoRA on the plan's column-wise layers (q/k/v/gate/up for Llama). 1 = off (docs/scale-out.md).",
        **FIXED_ON_RESUME,
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Sequence parallel (DeepSpeed's Ulysses, ALST): each row's tokens split over this many "
        "processes, which trade attention heads for the whole sequence (all-to-all); divides the number of "
        "processes (the rest is data parallel) and the model's heads; sft; sdpa or flash_attention_2; packed "
        "sequences stay apart. 1 = off (docs/scale-out.md).",
        **FIXED_ON_RESUME,
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="Context parallel (ring attention: torch's context_parallel through Accelerate's cp_size): "
        "each row split over this many GPUs, keys and values passed around the ring. CUDA GPUs with an FSDP2 "
        "config; sft; sdpa; rows not packed. 1 = off (docs/scale-out.md).",
        **FIXED_ON_RESUME,
    )
    activation_offloading: bool = Field(
        False,
        description="Move the activations saved for backward to pinned CPU memory during the forward and back "
        "for the backward (torch.autograd.graph.save_on_cpu); with gradient_checkpointing only each layer's "
        "input moves. CUDA only.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Refused above 1: pipeline parallel is not built (the reason and what to use instead are "
        "in docs/scale-out.md).",
        **FIXED_ON_RESUME,
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="Refused above 1: expert parallel is not built (the reason and what to use instead are "
        "in docs/scale-out.md).",
        **FIXED_ON_RESUME,
    )
    exit_duration_in_mins: float | None = Field(
        None, gt=0, description="Checkpoint and exit cleanly after this many minutes."
    )
    iterations_to_skip: list[int] = Field(
        default_factory=list,
        description="Optimizer steps whose batches are consumed without an update.",
        **FIXED_ON_RESUME,
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

    @field_validator("save_steps", "empty_cache_steps", "gc_steps", "save_epochs", mode="before")
    @classmethod
    def _null_is_off(cls, value: Any) -> Any:
        # One way to say "off" for every cadence: 0 and null both mean never.
        return 0 if value is None else value

    @field_validator("pipeline_parallel_size", "expert_parallel_size", mode="before")
    @classmethod
    def _refused_parallel(cls, value: Any, info) -> Any:
        # Accepted only when an existing engine can run them: neither can here (finetune.recipe.parallel).
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            reason = PIPELINE_REFUSAL if info.field_name == "pipeline_parallel_size" else EXPERT_REFUSAL
            raise PydanticCustomError("refused_parallel", "{reason}", {"reason": reason})
        return value

    @field_validator("optimizer", mode="before")
    @classmethod
    def _refused_optimizer(cls, value: Any) -> Any:
        # transformers knows these names, but finetune's loop cannot run them as meant: say why.
        if isinstance(value, str) and value in optimizers.REFUSED:
            raise PydanticCustomError(
                "refused_optimizer",
                "{name} is not supported: it {reason}",
                {"name": value, "reason": optimizers.REFUSED[value]},
            )
        return value

    def _problems(self, ok) -> list[Problem]:
        problems: list[Problem] = []
        name = self.optimizer if ok("optimizer") else None
        if (
            name in optimizers.LOW_RANK_OPTIMIZERS
            and ok("optim_target_modules")
            and not self.optim_target_modules
        ):
            problems.append(
                (
                    "optim_target_modules",
                    None,
                    f"{name} projects the gradients of the modules it names: set optim_target_modules "
                    "(all-linear, or names such as [q_proj, v_proj])",
                )
            )
        if (
            name in optimizers.SCHEDULE_FREE_OPTIMIZERS
            and ok("lr_decay_style")
            and self.lr_decay_style != "constant"
        ):
            problems.append(
                (
                    "lr_decay_style",
                    self.lr_decay_style,
                    f"{name} replaces the LR schedule (its warmup is lr_warmup_ratio): set lr_decay_style: constant",
                )
            )
        if name == "muon" and ok("optim_args"):
            unknown = sorted(set(self.optim_args) - set(optimizers.MUON_ARGS))
            if unknown:
                problems.append(
                    (
                        "optim_args",
                        self.optim_args,
                        f"muon reads {', '.join(optimizers.MUON_ARGS)}, not {', '.join(unknown)}",
                    )
                )
        if ok("optim_args"):
            for key, value in self.optim_args.items():
                if any(c in f"{key}{value}" for c in ",= "):
                    problems.append(
                        (
                            f"optim_args.{key}",
                            value,
                            "names and values cannot hold a comma, `=` or a space (transformers reads "
                            "optim_args as `name=value,...`)",
                        )
                    )
        return problems

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
        if self.extend_run and self.load_checkpoint_path is None:
            found.append(
                (
                    "extend_run",
                    True,
                    "does nothing without train.load_checkpoint_path: it lengthens a resumed run "
                    "(set load_checkpoint_path: auto)",
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
        if self.optim_target_modules is not None and self.optimizer not in optimizers.LOW_RANK_OPTIMIZERS:
            found.append(
                (
                    "optim_target_modules",
                    self.optim_target_modules,
                    f"is read by the GaLore and APOLLO optimizers only; {self.optimizer} ignores it",
                )
            )
        if self.optim_args and self.optimizer == "adamw":
            found.append(
                ("optim_args", self.optim_args, "adamw reads none of them (they are for other optimizers)")
            )
        install = optimizers.missing_package(self.optimizer)
        if install is not None:
            found.append(
                (
                    "optimizer",
                    self.optimizer,
                    f"needs a package that is not installed here ({install}); training will refuse to start without it",
                )
            )
        if self.optimizer == "sgd" and (self.adam_beta1, self.adam_beta2) != (0.9, 0.999):
            found.append(("optimizer", "sgd", "adam_beta1/adam_beta2 are set but sgd ignores them"))
        found += [(path.removeprefix("train."), value, why) for path, value, why in parallel_warnings(self)]
        return found
