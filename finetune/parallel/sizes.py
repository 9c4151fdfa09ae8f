"""The sizes of tensor, sequence and context parallel: which processes read the same rows, and every check
that needs the engine (`engine_problems`, before launch and in the launched process) or the model
(`check_model_splits`, before its weights load).

Ranks are laid out as Accelerate's and DeepSpeed's meshes lay them: the split is the innermost
dimension, so processes r and r + 1 share a split group and data parallel runs across the groups.

>>> from types import SimpleNamespace as NS
>>> train = NS(tensor_parallel_size=2, sequence_parallel_size=1, context_parallel_size=1)
>>> ranks_sharing_rows(train), data_parallel_rank(train, process_index=3)
(2, 1)
"""

from __future__ import annotations

import math
from typing import Any

from finetune.errors import FinetuneError


def size_of(train: Any, name: str) -> int:
    """train.<name>_parallel_size, 1 for a train section without it (the engine's tests build their own)."""
    return getattr(train, f"{name}_parallel_size", 1)


def ranks_sharing_rows(train: Any) -> int:
    """Processes that read the same rows: a tensor-parallel group computes one batch together, a
    context-parallel group splits one batch inside the forward. A sequence-parallel group reads
    different rows and exchanges them (DeepSpeed's loader adapter), so it counts as data parallel here."""
    return size_of(train, "tensor") * size_of(train, "context")


def data_parallel_size(train: Any, num_processes: int) -> int:
    """How many different shares of the data the processes read."""
    return max(1, num_processes // ranks_sharing_rows(train))


def data_parallel_rank(train: Any, *, process_index: int) -> int:
    """Which share of the data this process reads."""
    return process_index // ranks_sharing_rows(train)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def engine_problems(engine: Any, train: Any, *, cuda_available: bool, lora: bool = False) -> list[str]:
    """Why the recipe's splits cannot run on this engine here, one sentence each (empty when they can).
    `engine` is the DistributedSetup of the accelerate config (or the launched process), `lora`
    lora.enable_lora."""
    problems: list[str] = []
    world, where = engine.num_processes, engine.source
    tp, sp, cp = train.tensor_parallel_size, train.sequence_parallel_size, train.context_parallel_size
    if tp > 1:
        if world % tp:
            problems.append(
                f"train.tensor_parallel_size {tp} does not divide the {world} processes of {where}: each group "
                f"of {tp} processes splits the weights and the groups run data parallel; use a divisor of "
                f"{world} ({_divisors(world)}) or --num-processes a multiple of {tp}"
            )
        elif lora and world > tp:
            # transformers wraps the TP model in FSDP2 as it loads it (DistributedConfig fsdp_size), and PEFT
            # adds the adapters afterwards, outside that wrapping (measured with PEFT 0.21: the first
            # forward fails in the sharded attention, "shape '[2, 504, 64]' is invalid for input of size
            # 32256"); transformers marks PEFT under its FSDP as not done yet.
            problems.append(
                f"train.tensor_parallel_size {tp} on {world} processes runs data parallel across "
                f"{world // tp} tensor-parallel groups (transformers' FSDP2 around the TP model), which "
                f"PEFT's adapters cannot join: train LoRA with tensor parallel over every process "
                f"(--num-processes {tp}), or fine-tune fully (lora.enable_lora: false) on {world} processes"
            )
        if engine.kind in ("deepspeed", "fsdp"):
            problems.append(
                f"{where}: tensor parallel runs on the DDP launcher (multi_cpu, multi_gpu), not {engine.label}, "
                "which would shard the DTensor weights a second time; use multi_gpu (multi_cpu on CPU), with more "
                "processes than the size for data parallel beside it (transformers' FSDP2 across the TP groups)"
            )
        if train.mixed_precision == "fp16":
            problems.append(
                "train.mixed_precision fp16: tensor parallel's optimizer steps outside Accelerate's loss "
                "scaler; use bf16 (or no)"
            )
    if sp > 1 and world % sp:
        problems.append(
            f"train.sequence_parallel_size {sp} does not divide the {world} processes of {where}: each group of "
            f"{sp} processes splits one row; use a divisor of {world} ({_divisors(world)}) or "
            f"--num-processes a multiple of {sp}"
        )
    if cp > 1:
        problems += _context_problems(engine, cp, cuda_available=cuda_available)
    if train.activation_offloading and not cuda_available:
        problems.append(
            "train.activation_offloading moves a CUDA device's activations to pinned host memory and back; "
            "this machine has no GPU (on CPU they are in host memory already): set it false"
        )
    return problems


def _context_problems(engine: Any, cp: int, *, cuda_available: bool) -> list[str]:
    if not cuda_available:
        return [
            f"train.context_parallel_size {cp}: context parallel is CUDA only (torch has no sharding rule for "
            "SDPA's CPU kernel, _scaled_dot_product_flash_attention_for_cpu); on CPU split rows with "
            f"train.sequence_parallel_size {cp} (DeepSpeed's Ulysses over gloo) instead"
        ]
    problems = []
    if engine.kind != "fsdp":
        problems.append(
            f"{engine.source}: context parallel runs under FSDP2 (Accelerate composes cp_size with it only); "
            "use --accelerate-config fsdp2"
        )
    if engine.num_processes % cp:
        problems.append(
            f"train.context_parallel_size {cp} does not divide the {engine.num_processes} processes: use a "
            f"divisor of {engine.num_processes} ({_divisors(engine.num_processes)})"
        )
    return problems


def check_model_splits(config, train: Any) -> None:
    """Refuse splits the model cannot take, before its weights load: tensor parallel needs a TP plan and
    head counts it divides; sequence parallel gives each process heads / size query heads (DeepSpeed's
    Ulysses), its key/value heads divided or replicated."""
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    tp, sp = train.tensor_parallel_size, train.sequence_parallel_size
    problems = []
    if tp > 1:
        if not getattr(text, "base_model_tp_plan", None):
            problems.append(
                f"train.tensor_parallel_size {tp}: transformers has no TP plan for {text.model_type} "
                "(base_model_tp_plan), so tensor parallel cannot split it; split rows with "
                "train.sequence_parallel_size, or shard weights with --accelerate-config zero3 or fsdp2"
            )
        elif heads and (heads % tp or kv % tp):
            common = math.gcd(heads, kv)
            problems.append(
                f"train.tensor_parallel_size {tp}: the model has {heads} attention heads and {kv} key/value "
                f"heads, which {tp} processes cannot share out whole; use a divisor of both ({_divisors(common)})"
            )
    if sp > 1 and heads and (heads % sp or (kv % sp and sp % kv)):
        problems.append(
            f"train.sequence_parallel_size {sp}: DeepSpeed's Ulysses gives each process {heads}/{sp} of the "
            f"model's {heads} attention heads and divides (or replicates) its {kv} key/value heads; use a "
            f"divisor of {heads} ({_divisors(heads)}) that {kv} divides or is divisible by"
        )
    if problems:
        raise FinetuneError("cannot split this model:\n  - " + "\n  - ".join(problems))
