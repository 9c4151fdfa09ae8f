"""The packed row of the sequence-parallel tests: 4,096 tokens holding two sequences, the boundary at token
1,500 (inside the first of two 2,048-token shards), position_ids restarting there, each sequence's first
token and a 10-token prompt untrained."""

from __future__ import annotations

import torch

LENGTH, BOUNDARY, PROMPT = 4096, 1500, 10
# The tiny Llama's settings: initial weights larger than the default, so attention is sharp enough that
# attending across the boundary changes the loss (by 0.5%, measured) far beyond the tolerance.
MODEL = {"initializer_range": 0.2}


def packed_row(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 97, (1, LENGTH), generator=g)
    labels = ids.clone()
    for start in (0, BOUNDARY):
        labels[0, start : start + PROMPT] = -100
    positions = torch.cat([torch.arange(BOUNDARY), torch.arange(LENGTH - BOUNDARY)])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
