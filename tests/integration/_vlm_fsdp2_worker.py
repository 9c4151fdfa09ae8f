"""Run by tests/integration/test_vlm_scale_out.py under torchrun on CPU (gloo): the tiny demo VLM with LoRA
on its language model and its vision tower and projector frozen (every wrapped unit mixes frozen base
weights and trainable adapters), two AdamW steps on the same 16 prepared rows.

With 2 processes the model is sharded by FSDP2 (torch's fully_shard) into the units Accelerate's own
FSDP2 auto-wrap policy picks once finetune.model.vlm.scale_out_settings has named the wrap classes, each rank
taking 8 rows; `steps` with world 1 runs it unsharded, the reference (the test calls it in-process).
Accelerate's FSDP itself does not start on CPU (it enables FSDP only for GPU-like distributed types), so
this drives the same policy and torch's FSDP2 directly. Rank 0 writes the losses and the trained LoRA
weights (gathered) to OUT.

    torchrun --nproc_per_node N tests/integration/_vlm_fsdp2_worker.py PRETRAINED PREPARED_SPLIT OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForImageTextToText, AutoProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from finetune.data.batching.vision import collate_vlm
from finetune.losses.causal_lm import token_loss_sums
from finetune.model import vlm

ROWS, STEPS = 16, 2


def lora_model(pretrained: str):
    net = AutoModelForImageTextToText.from_pretrained(pretrained, dtype=torch.float32)
    vlm.freeze(net, train_vision_tower=False, train_projector=False)
    targets = vlm.lora_settings(net, "all-linear", [], train_vision_tower=False, train_projector=False)
    torch.manual_seed(0)  # the same adapters on every rank
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights="gaussian", **targets)
    return get_peft_model(net, config)


def shard(net) -> list[str]:
    """FSDP2 units as Accelerate picks them (transformer-based wrap) after scale_out_settings; the root
    last. Returns the wrapped classes."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = SimpleNamespace(
        distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin)
    )
    vlm.scale_out_settings(net, accelerator)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, net)
    units = [module for module in net.modules() if module is not net and policy(module)]
    wrapped = sorted({type(module).__name__ for module in units})  # before FSDP renames the classes
    for module in reversed(units):  # inner units first
        fully_shard(module)
    fully_shard(net)
    return wrapped


def steps(pretrained: str, prepared: str, rank: int = 0, world: int = 1) -> dict:
    """The two steps on this rank's share of the rows: losses (global), trained LoRA weights (whole)
    and the wrapped classes. World 1 (no process group needed) is the unsharded reference."""
    net = lora_model(pretrained)
    wrapped = shard(net) if world > 1 else []
    processor = AutoProcessor.from_pretrained(pretrained)
    split = datasets.load_from_disk(prepared)
    per_rank = ROWS // world
    rows = [split[i] for i in range(rank * per_rank, (rank + 1) * per_rank)]
    batch = collate_vlm(rows, pad_token_id=3, pad_to_multiple_of=8, processor=processor)
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(STEPS):
        sums, counts = token_loss_sums(net, batch)
        totals = torch.stack([sums.sum().detach(), counts.sum().float()])
        if world > 1:
            dist.all_reduce(totals)  # the global token count: a sync point
        # FSDP2 averages gradients over ranks: scale so they are those of the global token mean.
        (sums.sum() * world / totals[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(totals[0] / totals[1]))
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in net.named_parameters()
        if p.requires_grad
    }
    return {"losses": losses, "weights": weights, "wrapped": wrapped}


def main(pretrained: str, prepared: str, out: str) -> None:
    dist.init_process_group("gloo")
    result = steps(pretrained, prepared, dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
