"""The rules of the parallelism fields beyond data parallel (train.tensor_parallel_size,
sequence_parallel_size, context_parallel_size, activation_offloading; pipeline and expert parallel,
refused), checked at validate time without torch. What needs the engine (the number of processes, a
GPU) is checked at start (finetune.parallel.sizes), what needs the model (its heads, its TP plan) when
it is built.

>>> PIPELINE_REFUSAL.split(":")[0]
'pipeline parallel is not built'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from finetune.recipe.base import Problem
from finetune.recipe.objectives import OBJECTIVES

# The three ways to split one model or one row over processes, by recipe field.
SPLITS = {
    "train.tensor_parallel_size": "tensor parallel",
    "train.sequence_parallel_size": "sequence parallel",
    "train.context_parallel_size": "context parallel",
}

PIPELINE_REFUSAL = (
    "pipeline parallel is not built: finetune's loop runs one forward and one backward per micro-batch on "
    "the whole model, and a pipeline needs a schedule that interleaves micro-batches across stages "
    "(torch.distributed.pipelining's or DeepSpeed's PipelineEngine, which trains its own PipelineModule, "
    "not a transformers model); transformers' own pp_size runs a naive forward, one stage at a time. "
    "Instead: shard the layers over the GPUs with --accelerate-config zero3 or fsdp2, or split each layer "
    "with train.tensor_parallel_size"
)
EXPERT_REFUSAL = (
    "expert parallel is not built: transformers' expert parallel (DistributedConfig ep_size) lays the "
    "experts over its own FSDP mesh (ep_size must divide its fsdp_size x tp_size) at load, outside the "
    "Accelerate engines finetune's loop drives, and it would also need the router's token exchange "
    "(all-to-all) in backward. An MoE model trains today with every expert on every rank under DDP, or "
    "sharded like any weight by --accelerate-config zero3 or fsdp2, its router auxiliary loss included"
)


def split_sizes(train: Any) -> dict[str, int]:
    """{recipe field: size} of the splits above 1 (tensor, sequence, context parallel).

    >>> from types import SimpleNamespace as NS
    >>> split_sizes(NS(tensor_parallel_size=2, sequence_parallel_size=1, context_parallel_size=1))
    {'train.tensor_parallel_size': 2}
    """
    sizes = {path: getattr(train, path.split(".")[1]) for path in SPLITS}
    return {path: size for path, size in sizes.items() if size > 1}


def parallel_problems(recipe: Any, ok: Callable[..., bool]) -> list[Problem]:
    """What the recipe cannot do with its tensor / sequence / context parallel sizes: one split at a
    time, the sft objective on a causal LM, the attention backends each split works with, rows that
    split into equal shards."""
    if not ok(*SPLITS):
        return []
    splits = split_sizes(recipe.train)
    if not splits:
        return []
    problems: list[Problem] = []
    if len(splits) > 1:
        names = " and ".join(f"{path} {size}" for path, size in splits.items())
        problems.append(
            (
                list(splits)[1],
                list(splits.values())[1],
                f"{names}: one split at a time (Accelerate keeps sequence and context parallel apart, and "
                "tensor parallel here spans every process); keep one of them and set the others to 1",
            )
        )
    path, size = next(iter(splits.items()))
    what = SPLITS[path]
    if ok("train.objective") and OBJECTIVES[recipe.train.objective].kind != "sft":
        problems.append(
            (
                "train.objective",
                recipe.train.objective,
                f"{what} trains the sft objective only: preference and online objectives sum log-probs per "
                f"sequence and build reference models and rollouts that finetune has not split; set {path}: 1",
            )
        )
    if ok("model.kind") and recipe.model.kind != "llm":
        problems.append(
            (
                "model.kind",
                recipe.model.kind,
                f"{what} splits a causal LM's decoder (model.kind llm); set {path}: 1",
            )
        )
    if path == "train.sequence_parallel_size":
        problems += _sequence_problems(recipe, ok, size)
    elif path == "train.context_parallel_size":
        problems += _context_problems(recipe, ok, size)
    else:
        problems += _tensor_problems(recipe, ok)
    return problems


def _shards_problem(recipe: Any, ok: Callable[..., bool], shards: int, what: str) -> list[Problem]:
    """Rows are padded to a multiple of data.pad_to_multiple_of tokens: it must split into `shards`."""
    if not ok("data.pad_to_multiple_of") or recipe.data.pad_to_multiple_of % shards == 0:
        return []
    multiple = recipe.data.pad_to_multiple_of
    return [
        (
            "data.pad_to_multiple_of",
            multiple,
            f"rows are padded to a multiple of {multiple} tokens, which does not split into the {shards} "
            f"equal shards {what} needs; set data.pad_to_multiple_of to a multiple of {shards} "
            f"({math.lcm(multiple, shards)} is one)",
        )
    ]


def _sequence_problems(recipe: Any, ok: Callable[..., bool], size: int) -> list[Problem]:
    problems = _shards_problem(recipe, ok, size, f"sequence_parallel_size {size}")
    attn = recipe.model.attn_implementation if ok("model.attn_implementation") else None
    if attn in ("eager", "flex_attention"):
        why = (
            "eager attention builds an s x s mask for the whole row, which DeepSpeed's Ulysses refuses"
            if attn == "eager"
            else "DeepSpeed's Ulysses rebuilds flex_attention's mask as a plain causal one, so packed "
            "sequences would attend to each other"
        )
        problems.append(
            (
                "model.attn_implementation",
                attn,
                f"{why}; use sdpa or flash_attention_2 with sequence parallel",
            )
        )
    uneven = (
        ok("train.micro_batch_size", "data.dataloader_drop_last") and not recipe.data.dataloader_drop_last
    )
    if uneven and recipe.train.micro_batch_size > 1:
        problems.append(
            (
                "data.dataloader_drop_last",
                False,
                "DeepSpeed's Ulysses attention is built for one batch size, and an epoch's last batch "
                "may be smaller: set it true, or train.micro_batch_size 1",
            )
        )
    if ok("eval.generation_sets") and recipe.eval.generation_sets:
        problems.append(
            (
                "eval.generation_sets",
                [s.name for s in recipe.eval.generation_sets],
                "DeepSpeed's Ulysses drops the attention mask, which batched generation's padding needs, "
                "also in evaluation; score them after training with `finetune eval` on the saved model",
            )
        )
    if ok("data.streaming") and recipe.data.streaming:
        problems.append(
            (
                "data.streaming",
                True,
                "sequence parallel exchanges rows between processes (DeepSpeed's loader adapter), which the "
                "stream's checkpointed per-process position does not cover; prepare the data "
                "(data.streaming: false)",
            )
        )
    return problems


def _context_problems(recipe: Any, ok: Callable[..., bool], size: int) -> list[Problem]:
    # torch's context_parallel shards a row into 2 x cp chunks (load balancing of the causal mask).
    problems = _shards_problem(recipe, ok, 2 * size, f"context_parallel_size {size} (2 x {size} chunks)")
    if ok("model.attn_implementation") and recipe.model.attn_implementation != "sdpa":
        problems.append(
            (
                "model.attn_implementation",
                recipe.model.attn_implementation,
                "context parallel is torch's ring attention over SDPA: set sdpa",
            )
        )
    if ok("data.sample_packing") and recipe.data.sample_packing:
        problems.append(
            (
                "data.sample_packing",
                True,
                "torch's ring attention (context_parallel over SDPA) takes only the causal mask, so packed "
                "sequences would attend to each other; set data.sample_packing: false, or use "
                "train.sequence_parallel_size, which keeps packed sequences apart",
            )
        )
    if ok("data.streaming") and recipe.data.streaming:
        problems.append(("data.streaming", True, "context parallel trains on prepared data; set it false"))
    return problems


def _tensor_problems(recipe: Any, ok: Callable[..., bool]) -> list[Problem]:
    problems: list[Problem] = []
    if ok("lora.enable_qlora") and recipe.lora.enable_qlora:
        problems.append(
            (
                "lora.enable_qlora",
                True,
                "tensor parallel shards weights as DTensors, which bitsandbytes' 4-bit weights are not; use "
                "LoRA on 16-bit weights (lora.enable_qlora: false) or QLoRA without tensor parallel",
            )
        )
    if ok("train.loss_chunk_size") and recipe.train.loss_chunk_size:
        problems.append(
            (
                "train.loss_chunk_size",
                recipe.train.loss_chunk_size,
                "the chunked loss replaces the output head's forward, which the model's TP plan shards "
                "(lm_head: colwise_gather_output); set train.loss_chunk_size: 0",
            )
        )
    return problems


def parallel_warnings(train: Any) -> list[Problem]:
    """Works, but probably not what was meant (the train section's): offloading every saved tensor
    without checkpointing."""
    if train.activation_offloading and not train.gradient_checkpointing:
        return [
            (
                "train.activation_offloading",
                True,
                "without train.gradient_checkpointing every saved activation crosses to the host and back "
                "each step; with it only each layer's input does (set gradient_checkpointing: true)",
            )
        ]
    return []
