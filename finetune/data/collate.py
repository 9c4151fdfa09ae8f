"""Batch rows from the prepared dataset into tensors.

Packed rows (several sequences per row) are passed to the model with `position_ids` restarting at
0 for every sequence and no attention mask: transformers then builds a block-diagonal causal mask
for sdpa/eager/flex, and flash-attention uses the position_ids for varlen kernels (cu_seqlens), so
attention never crosses a sequence boundary. Unpacked rows are right-padded with an attention mask.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate_rows(rows: list[dict], *, pad_token_id: int, pad_to_multiple_of: int = 1, packed: bool) -> dict:
    """Pad rows to one length (a multiple of pad_to_multiple_of) and stack them.

    Padding gets label -100 and, in packed batches, position_ids restarting at 0 so it forms its
    own attention segment.
    """
    length = _round_up(max(len(r["input_ids"]) for r in rows), pad_to_multiple_of)
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((batch, length), dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.as_tensor(row["input_ids"])
        labels[i, :n] = torch.as_tensor(row["labels"])
        if "position_ids" in row and row["position_ids"] is not None:
            position_ids[i, :n] = torch.as_tensor(row["position_ids"])
        else:
            position_ids[i, :n] = torch.arange(n)
        position_ids[i, n:] = torch.arange(length - n)
        attention_mask[i, :n] = 1
    out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if not packed:
        out["attention_mask"] = attention_mask
    return out
