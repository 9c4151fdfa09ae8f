"""The `data` section: dataset entries (their schemas: finetune.recipe.formats), lengths, packing, cache,
loaders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from finetune.recipe.base import FIXED_ON_RESUME, Problem, _Section
from finetune.recipe.formats import (
    CHAT_RENDERABLE_TYPES,
    IMAGE_DATASET_TYPES,
    PREFERENCE_DATASET_TYPES,
    DatasetEntry,
    DatasetType,
    dataset_entry,
)

# Importable from here as before the entries got a module of their own (finetune.recipe.formats).
__all__ = [
    "CHAT_RENDERABLE_TYPES",
    "IMAGE_DATASET_TYPES",
    "PREFERENCE_DATASET_TYPES",
    "DataSection",
    "DatasetEntry",
    "DatasetType",
    "dataset_entry",
]


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
        description="int = rows, float in (0, 1) = fraction, split off the merged train data with `seed` "
        "(0 or null = no validation split).",
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
    image_max_pixels: int | None = Field(
        None,
        ge=1,
        description="Vision-language data (model.kind: vlm): images with more pixels (width x height) are "
        "resized down to it, aspect kept, at prepare time, before the processor sees them (the processor's "
        "own size policy then applies); null = as they are.",
        **FIXED_ON_RESUME,
    )
    allow_image_paths_outside: bool = Field(
        False,
        description="Let a data row's image paths point outside its data file's folder (absolute paths, ../, "
        "symlinks leading out). Off: such a row is a counted bad row (image_outside_data_folder), so a row cannot "
        "pull any file of the machine into the prepared (and pushed) dataset. Turn it on only for data you "
        "trust.",
        **FIXED_ON_RESUME,
    )
    streaming: bool = Field(
        False,
        description="Read, tokenize and pack the training rows on the fly (datasets' IterableDataset) instead "
        "of preparing them: for corpora too large to prepare. Needs train.max_steps; SFT only; the stream's "
        "position is checkpointed (docs/data.md, Streaming).",
        **FIXED_ON_RESUME,
    )
    stream_buffer_size: int = Field(
        1000,
        ge=1,
        description="With data.streaming: examples held in the packing buffer (best-fit within the buffer, "
        "its pending examples checkpointed); larger packs better and holds more in memory.",
        **FIXED_ON_RESUME,
    )
    dataloader_num_workers: int = Field(
        2,
        ge=0,
        description="DataLoader worker processes (with data.streaming: 0 reads the stream in the training "
        "thread, more in one background thread).",
    )
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
    def _zero_is_none(cls, value: Any) -> Any:
        # Axolotl recipes write 0 for "no validation split": 0, 0.0 and null all mean none, and all
        # resolve to null (one fingerprint). A boolean is refused by _Section (true is not 1 row).
        return None if value == 0 and not isinstance(value, bool) else value

    @field_validator("val_set_size")
    @classmethod
    def _val_set_size(cls, value: int | float | None) -> int | float | None:
        if isinstance(value, float) and not 0.0 < value < 1.0:
            raise ValueError(f"a fraction must be in (0, 1), got {value}; use an int for a number of rows")
        if isinstance(value, int) and value < 1:
            raise ValueError("a number of rows must be >= 1 (or 0 / null for no validation split)")
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
        for i, entry in enumerate(self.test_datasets if ok("test_datasets") else []):
            if entry is not None and entry.weight != 1:
                problems.append(
                    (
                        f"test_datasets.{i}.weight",
                        entry.weight,
                        "evaluation data is not weighted (a weight draws a training mixture): remove it, or "
                        "list the dataset in data.datasets",
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
