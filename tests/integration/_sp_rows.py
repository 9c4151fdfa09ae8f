"""The packed row of the sequence-parallel tests: 4,096 tokens holding two sequences, the boundary at token
1,500 (inside the first of two 2,048-token shards), position_ids restarting there, each sequence's first
token and a 10-token prompt untrained."""

from __future__ import annotations

import torch

LENGTH, BOUNDARY, PROMPT = 4096, 1500, 10
# The tiny Llama's settings: initial weights larger than the default, so attention is sharp enough that
# attending across the boundary changes the loss (by 0.5%, measured) far beyond the tolerance.
MODEL = {"initializer_range": 0.2}
# The architectures the row is split for: Llama, and Qwen2 (biases on q/k/v, the same Ulysses attention).
MODEL_TYPES = ("llama", "qwen2")


def row_model(model_type: str = "llama") -> torch.nn.Module:
    """The tiny model of the packed-row test (tests.tiny's Llama, or a Qwen2 of the same sizes), the same
    weights on every call."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.tiny import TINY_LLAMA, tiny_model

    if model_type == "llama":
        return tiny_model(**MODEL)
    torch.manual_seed(0)
    config = Qwen2Config(**TINY_LLAMA, **MODEL)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def packed_row(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 97, (1, LENGTH), generator=g)
    labels = ids.clone()
    for start in (0, BOUNDARY):
        labels[0, start : start + PROMPT] = -100
    positions = torch.cat([torch.arange(BOUNDARY), torch.arange(LENGTH - BOUNDARY)])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
