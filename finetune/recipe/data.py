"""The `data` section: dataset entries (sources and formats), lengths, packing, cache, loaders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from finetune.recipe.base import FIXED_ON_RESUME, Problem, _Section

DatasetType = Literal[
    "completion",
    "alpaca",
    "input_output",
    "chat_template",
    "tokenized",
    "preference",
    "kto",
    "images",
    "dreambooth",
]
# Entry types of diffusion recipes (model.kind: diffusion): images with captions (metadata.jsonl /
# metadata.csv / .txt sidecars in a folder, or columns of a Hub image dataset), or a DreamBooth
# instance folder whose images all get diffusion.instance_prompt.
IMAGE_DATASET_TYPES = ("images", "dreambooth")
# Entry types of preference objectives (train.objective): pairs (prompt, chosen, rejected) for dpo,
# ipo, simpo and orpo; single completions labelled desirable or not for kto.
PREFERENCE_DATASET_TYPES = ("preference", "kto")
# Entry types whose prompt and completions may be rendered as a user and an assistant turn.
CHAT_RENDERABLE_TYPES = ("alpaca", "input_output", "preference", "kto")


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
    field_prompt: str = Field(
        "prompt",
        description="input_output / preference / kto: prompt column (a string or a list of messages; "
        "preference may leave it out when chosen and rejected are whole conversations).",
    )
    field_completion: str = Field("completion", description="input_output / kto: completion column.")
    field_chosen: str = Field(
        "chosen", description="preference: the preferred completion (a string or a list of messages)."
    )
    field_rejected: str = Field(
        "rejected", description="preference: the dispreferred completion (a string or a list of messages)."
    )
    field_label: str = Field(
        "label", description="kto: boolean column, true when the completion is desirable."
    )
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
    apply_chat_template: bool = Field(
        False,
        description="alpaca / input_output / preference / kto: render each row as a chat with the model's chat "
        "template (for instruct models): the prompt (alpaca: the instruction, then the input after a blank line) "
        "as a user turn, the completion (preference: chosen and rejected each) as an assistant turn, plus "
        "whatever the template adds (e.g. its default system prompt). Only the completion and its end-of-turn "
        "token (per train_on_eos) are trained. Preference and kto rows whose fields are lists of messages "
        "are always rendered with the template. "
        "E.g. GSM8K: {type: input_output, field_prompt: question, field_completion: answer, "
        "apply_chat_template: true}.",
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
        if (
            ok("type", "apply_chat_template")
            and self.apply_chat_template
            and self.type not in CHAT_RENDERABLE_TYPES
        ):
            problems.append(
                (
                    "apply_chat_template",
                    True,
                    f"works with type {', '.join(CHAT_RENDERABLE_TYPES)} (a prompt and completions to render "
                    f"as turns), not {self.type!r}; remove it",
                )
            )
        if ok("type", "train_on_inputs") and self.train_on_inputs and self.type in PREFERENCE_DATASET_TYPES:
            problems.append(
                (
                    "train_on_inputs",
                    True,
                    f"type {self.type} scores only completions, given their prompt (never trained): remove it",
                )
            )
        if (
            ok("type", "train_on_eos")
            and self.train_on_eos == "all"
            and self.type in PREFERENCE_DATASET_TYPES
        ):
            problems.append(
                (
                    "train_on_eos",
                    "all",
                    f"type {self.type} scores only the completion's turns (prompt turns are not compared): use "
                    "turn, last or none",
                )
            )
        return problems


class DataSection(_Section):
    datasets: list[DatasetEntry] = Field(
        min_length=1, description="Training datasets, merged in order.", **FIXED_ON_RESUME
    )
    test_datasets: list[DatasetEntry] = Field(
        default_factory=list,
        description="Evaluation datasets, same entry format.",
        **FIXED_ON_RESUME,
    )
    val_set_size: int | float | None = Field(
        None,
        description="int = rows, float in (0, 1) = fraction, split off the merged train data with `seed`.",
        **FIXED_ON_RESUME,
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
    sequence_len: int = Field(
        2048, ge=2, description="Longest sample kept (after the length policy).", **FIXED_ON_RESUME
    )
    excess_length_strategy: Literal["drop", "truncate", "raise"] = Field(
        "drop",
        description="What to do with samples longer than sequence_len.",
        **FIXED_ON_RESUME,
    )
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise",
        description="raise (error names dataset, row, field) or skip (counted in the manifest).",
        **FIXED_ON_RESUME,
    )
    sample_packing: bool = Field(
        True, description="Pack samples into rows of sample_packing_sequence_len.", **FIXED_ON_RESUME
    )
    sample_packing_method: Literal["sequential", "multipack"] = Field(
        "multipack",
        description="sequential (order-preserving, fast) or multipack (bin packing, best fill).",
        **FIXED_ON_RESUME,
    )
    sample_packing_sequence_len: int | None = Field(
        None,
        ge=2,
        description="Tokens per packed row; null = sequence_len.",
        **FIXED_ON_RESUME,
    )
    sample_packing_group_size: int = Field(
        100_000,
        ge=1,
        description="Samples bin-packed together in one group.",
        **FIXED_ON_RESUME,
    )
    eval_sample_packing: bool = Field(True, description="Pack eval data too.")
    pad_to_multiple_of: int = Field(
        64, ge=1, description="Pad rows to a multiple of this many tokens.", **FIXED_ON_RESUME
    )
    shuffle_merged_datasets: bool = Field(
        True,
        description="Shuffle after merging, and the training rows every epoch; false keeps the data's "
        "order (with sequential packing: the file order) in training too.",
        **FIXED_ON_RESUME,
    )
    shuffle_before_merging_datasets: bool = Field(
        True, description="Shuffle each dataset before merging.", **FIXED_ON_RESUME
    )
    dataloader_num_workers: int = Field(2, ge=0, description="DataLoader worker processes.")
    dataloader_prefetch_factor: int | None = Field(
        None,
        ge=1,
        description="Batches prefetched per worker; null = torch's default (2) when there are workers "
        "(torch refuses a value without workers).",
    )
    dataloader_pin_memory: bool = Field(True, description="Pin host memory (ignored on CPU).")
    dataloader_drop_last: bool = Field(True, description="Drop the last incomplete batch.", **FIXED_ON_RESUME)

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
