"""Context parallel: torch's ring attention (torch.distributed.tensor.experimental.context_parallel)
through Accelerate's ParallelismConfig cp_size, under FSDP2, on CUDA GPUs.

Each group of `context_parallel_size` GPUs reads the same rows; inside a micro-batch's forward and
backward Accelerate shards them along the sequence (2 x size chunks, balanced for the causal mask) and
passes keys and values around the ring. The labels are shifted before the split (`shift_labels`: the
chunks of a shard are not contiguous, so a shard cannot shift its own), and Accelerate replaces every
attention mask with the causal one (so rows are not packed: finetune.recipe.parallel). FSDP2 shards the
weights over the data-parallel and context-parallel processes together and averages the gradients over
both; the engine counts a batch's trained tokens once (finetune.engine.step).
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Any


def parallelism_config(train: Any, num_processes: int):
    """Accelerate's ParallelismConfig for train.context_parallel_size > 1 (the rest of the processes shard
    the weights, replicated across nodes as the accelerate config's parallelism_config says), else None."""
    cp = train.context_parallel_size
    if cp <= 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    replicate = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"))
    return ParallelismConfig(
        dp_replicate_size=replicate, dp_shard_size=max(1, num_processes // (cp * replicate)), cp_size=cp
    )


def context_parallel_step(accelerator, train: Any, batch: dict):
    """The context of one micro-batch's forward and backward: under context parallel, `batch`'s tokens,
    positions and shifted labels are this process's shard inside it (changed in place); otherwise
    nothing."""
    if getattr(train, "context_parallel_size", 1) <= 1:  # (a train section without it: off)
        return nullcontext()
    return _sharded(accelerator, batch)


@contextmanager
def _sharded(accelerator, batch: dict):
    from finetune.losses.chunked_ce import next_token_labels

    if "labels" in batch:
        batch["shift_labels"] = next_token_labels(batch.pop("labels"))
    buffers = [batch[k] for k in ("input_ids", "shift_labels", "position_ids") if k in batch]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        yield
