"""Batch rows from the prepared dataset into tensors.

Packed rows (several sequences per row) are passed to the model with `position_ids` restarting at
0 for every sequence and no attention mask: transformers then builds a block-diagonal causal mask
for sdpa/eager/flex, and flash-attention uses the position_ids for varlen kernels (cu_seqlens), so
attention never crosses a sequence boundary. Unpacked rows are right-padded with an attention mask.
Preference rows always use the packed layout (chosen and rejected are two sequences of one row),
see `collate_preference`.
"""

from __future__ import annotations

import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.pairs import kto_kl_row


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


def collate_preference(rows: list[dict], *, pad_token_id: int, pad_to_multiple_of: int = 1) -> dict:
    """Batch packed rows of preference pairs or kto examples (finetune.data.batching.pairs).

    Besides the packed token tensors: `num_units` (pairs or examples per row) and, when the rows
    carry them, `row_index` (their index in the prepared split: where precomputed reference
    log-probs are looked up) and `margin` (their `margins`, one per pair, row-major); kto rows add
    `desirable` (one flag per example, row-major) and the KL rows (`kl_input_ids`, `kl_labels`,
    `kl_position_ids`, as long as the rows themselves).
    """
    batch = collate_rows(rows, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, packed=True)
    batch["num_units"] = torch.tensor([r["num_units"] for r in rows], dtype=torch.long)
    if "row_index" in rows[0]:
        batch["row_index"] = torch.tensor([r["row_index"] for r in rows], dtype=torch.long)
    if "margins" in rows[0]:  # one per pair, row-major (train.objective reward's margin column)
        batch["margin"] = torch.tensor([m for r in rows for m in r["margins"]], dtype=torch.float32)
    if "prompt_lens" in rows[0]:
        kl_rows = []
        for r in rows:
            ids, labels, positions = kto_kl_row(r["input_ids"], r["labels"], r["seq_lens"], r["prompt_lens"])
            kl_rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
        kl = collate_rows(
            kl_rows, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, packed=True
        )
        batch |= {f"kl_{k}": v for k, v in kl.items()}
        batch["desirable"] = torch.tensor([d for r in rows for d in r["desirable"]], dtype=torch.bool)
    return batch
