"""Run by tests/integration/test_sharded_generation.py under torchrun on CPU (gloo): a tiny Llama with LoRA
(the online objectives' usual model) sharded by torch's FSDP2 (fully_shard on every decoder layer, then
the root), then sampled through the transformers backend inside finetune.distributed.whole_weights: with
the weights gathered whole (`gather`) and with each layer gathered for its forward (`layerwise`, the
processes' generate steps kept in step). Each rank samples its own prompts with their seeds; rank 0
writes every rank's completions and whether the weights were sharded again afterwards to OUT.

Accelerate's FSDP does not start on CPU (it enables FSDP only for GPU-like distributed types), so the
accelerator is a stand-in that says FSDP, as the engine would see it.

    torchrun --nproc_per_node 2 tests/integration/_sharded_generation_worker.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from finetune.distributed import whole_weights
from finetune.generation.prompts import prompt_ids
from finetune.generation.protocol import SamplingParams
from finetune.generation.transformers_backend import TransformersBackend
from finetune.objectives.rollout import completion_seed
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is 2 + 3?", "Hi", "Count to three.", "Sort: pear, fig."]


def lora_model(tokenizer):
    net = tiny_model(
        vocab_size=len(tokenizer), max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)  # the same adapters on every rank (and in the one-process reference)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules="all-linear")
    return get_peft_model(net, config)


def sample(backend, tokenizer, questions: list[str], rows: list[int]) -> list[list[list[int]]]:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, num_return_sequences=2)
    seeds = [[completion_seed(7, 1, row, j) for j in range(2)] for row in rows]
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    return [[c.ids for c in row] for row in backend.generate(prompts, params, seeds=seeds, batch_size=2)]


def _q_proj(net):
    return next(p for n, p in net.named_parameters() if "layers.0.self_attn.q_proj.base_layer" in n)


def _full_rows(net) -> int:
    return _q_proj(net).shape[0]


def _shard_rows(net) -> int:
    """Rows of the first layer's q_proj on this rank (a DTensor's local shard, or the whole tensor)."""
    param = _q_proj(net)
    return param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    net = lora_model(tokenizer)
    for layer in net.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(net)
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP)
    mine = list(range(rank, len(QUESTIONS), world))  # this rank's prompt rows
    backend = TransformersBackend(net, tokenizer)
    results, whole = {}, {}
    for mode in ("gather", "layerwise"):
        backend.synced_processes = mode == "layerwise"
        with whole_weights(net, accelerator, gather=mode == "gather"):
            results[mode] = sample(backend, tokenizer, [QUESTIONS[k] for k in mine], mine)
            whole[mode] = _shard_rows(net) == _full_rows(net)
    gathered = [None] * world
    report = {"rows": mine, **results, "whole": whole, "resharded": _shard_rows(net) < _full_rows(net)}
    dist.all_gather_object(gathered, report)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
