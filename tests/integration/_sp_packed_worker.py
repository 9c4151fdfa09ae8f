"""Worker of test_sequence_parallel.py (torchrun, 2 gloo processes): one packed 4,096-token row holding two
sequences whose boundary falls inside the first shard, trained through finetune's sequence parallel
(DeepSpeed's Ulysses attention and loader adapter, registered by finetune.parallel.sequence) and finetune's
loss, for a tiny Llama and a tiny Qwen2 in turn; per model type, the loss summed over the two shards and
the gradients summed over the processes are written to $OUT (torch.save) for the test to compare with one
process's whole row."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (torchrun runs this file as a script)

from finetune.losses.causal_lm import forward, trainable_tokens
from finetune.parallel.sequence import SequenceShards, register_sequence_parallel
from tests.integration._sp_rows import MODEL_TYPES, packed_row, row_model


def saved_bytes(model, batch: dict, total: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves in this process's forward of its shard (parameters
    excluded), as tests/memory.saved_tensor_bytes counts them: what the planner's activation term
    predicts per rank under sequence parallel (finetune.plan.parallel)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(model, batch, num_items=total).loss
    loss.backward()  # every process runs the same collectives in backward
    return sum(storages.values())


def main(out: str) -> None:
    dist.init_process_group("gloo")
    # DeepSpeed registers Ulysses once per process (its groups are global, its attention replaces SDPA
    # for the head counts given); the tiny Qwen2 has the Llama's heads, so it runs through the same.
    groups = register_sequence_parallel(
        row_model("llama"), size=2, micro_batch_size=1, attn_implementation="sdpa"
    )
    results = {model_type: split_row(model_type, groups) for model_type in MODEL_TYPES}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def split_row(model_type: str, groups) -> dict:
    """The loss, gradients, token counts and saved bytes of the packed row split over the 2 processes."""
    rank = dist.get_rank()
    model = row_model(model_type)
    # Each process reads its own rows; the adapter hands both the shards of process 0's row first.
    rows = [packed_row(), packed_row(seed=1)]
    shards = SequenceShards([rows[rank]], groups, device=torch.device("cpu"))
    batch = next(iter(shards))
    local = trainable_tokens(batch).float()
    total = local.clone()
    dist.all_reduce(total)  # the whole row's trained tokens: the loss is normalised over all of it
    loss = forward(model, batch, num_items=total).loss
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad)
    saved = saved_bytes(model, batch, total)
    return {
        "loss": summed,
        "grads": grads,
        "tokens": int(total),
        "shard": batch["input_ids"].shape[1],
        "saved": saved,
    }


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"])
