"""The rules of `data.streaming`: what a stream needs (train.max_steps, the SFT objective) and the
settings that mean nothing without a prepared dataset (refused with the fix, never ignored)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from finetune.recipe.base import Problem

# Data settings of the prepare step that a stream has no use for: path -> why and what to do.
_NOT_WITH_STREAMING: dict[str, str] = {
    "data.val_set_size": "a stream is not split; evaluate with eval.generation_sets, or afterwards with "
    "`finetune eval` and a recipe whose data is the held-out file",
    "data.test_datasets": "evaluation on a split during a streaming run is not supported yet; use "
    "eval.generation_sets, or afterwards `finetune eval` with a recipe whose data is the held-out file",
    "data.skip_prepare_dataset": "nothing is prepared; remove it",
    "data.push_dataset_to_hub": "nothing is prepared to push; remove it",
    "data.num_dataset_shards_to_save": "nothing is saved; remove it",
    "train.num_train_epochs": "a stream's length is not known up front: train.max_steps sets the run's "
    "length (the stream starts over when it ends)",
}
# Shuffling fields: a stream is read in its shards' order (datasets' shuffle buffer is not restored
# exactly on resume); with streaming their defaults are false (finetune.recipe.defaults), and true
# is an error.
_SHUFFLES = ("data.shuffle_merged_datasets", "data.shuffle_before_merging_datasets")


def streaming_problems(recipe: Any, ok: Callable[..., bool]) -> list[Problem]:
    """With data.streaming: train.max_steps set, train.objective sft, no prepare-only setting, no
    explicit shuffle, no per-entry shards (each process reads its own part of the stream already).

    >>> from types import SimpleNamespace as NS
    >>> r = NS(data=NS(streaming=False))
    >>> streaming_problems(r, lambda *a: True)
    []
    """
    if not ok("data.streaming") or not recipe.data.streaming:
        return []
    problems: list[Problem] = []
    if ok("train.max_steps") and recipe.train.max_steps is None:
        problems.append(
            ("train.max_steps", None, "data.streaming needs it: a stream's length is not known up front")
        )
    if ok("train.objective") and recipe.train.objective != "sft":
        problems.append(
            (
                "train.objective",
                recipe.train.objective,
                "data.streaming trains the sft objective only (preference pairs, prompts and images are "
                "prepared); set data.streaming: false",
            )
        )
    if ok("model.kind") and recipe.model.kind != "llm":
        problems.append(
            (
                "model.kind",
                recipe.model.kind,
                "data.streaming reads text for a causal LM only (images are prepared); set data.streaming: false",
            )
        )
    for path, reason in _NOT_WITH_STREAMING.items():
        section, name = path.split(".")
        owner = getattr(recipe, section)
        default = type(owner).model_fields[name].get_default(call_default_factory=True)
        if ok(path) and getattr(owner, name) != default:
            problems.append((path, getattr(owner, name), f"not used with data.streaming: {reason}"))
    for path in _SHUFFLES:
        name = path.split(".")[1]
        if ok(path) and getattr(recipe.data, name):
            problems.append(
                (
                    path,
                    True,
                    "a stream is read in its shards' order (shuffle the shards when you write them); "
                    "remove it (with data.streaming it defaults to false)",
                )
            )
    for i, entry in enumerate(recipe.data.datasets if ok("data.datasets") else []):
        if entry is not None and getattr(entry, "shards", None) is not None:
            problems.append(
                (
                    f"data.datasets.{i}.shards",
                    entry.shards,
                    "not used with data.streaming (each process reads its own part); remove shards and shards_idx",
                )
            )
    return problems
