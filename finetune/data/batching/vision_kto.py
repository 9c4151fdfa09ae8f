"""KTO on image-text examples (model.kind vlm): the KL rows of unpacked examples, and their batches.

KTO's reference point z0 is a KL estimate from mismatched completions: each prompt scored with a
completion that is not its own (TRL's KTOTrainer rotates completions by one within each batch, its
vision collator included). Text kto rows are packed, and each packed row's KL row rotates the
completions within the row (finetune.data.batching.pairs.kto_kl_row). Rows with images are never packed
(finetune.recipe.schema.VLM_NO_PACKING), so the rotation is over the prepared split instead:

    the KL sequence of example i = the prompt of example i (with its own images)
                                   + the completion of example i - 1 in the prepared order
                                   (example 0 takes the last one's)

the labels marking that completion only. It is fixed by the prepared order, not by the shuffled
batches, so training, evaluation and the precomputed reference log-probs (looked up by row) all score
the same KL sequences, and it is TRL's rotation exactly when a batch is the split in order. A split
of one example gets its own completion back (the KL estimate is then its own log-ratio), as a text
row of one example does. A KL sequence is cut to the data's sequence_len from the end of its
borrowed completion (never the prompt: its image tokens stay whole).

>>> kl_rows([[1, 5, 6], [1, 7, 8, 9]], [[-100, -100, 6], [-100, -100, 8, 9]], [2, 2])
([[1, 5, 8, 9], [1, 7, 6]], [[-100, -100, 8, 9], [-100, -100, 6]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.collate import collate_rows
from finetune.data.batching.vision import collate_vlm, image_inputs

KL_COLUMNS = ("kl_input_ids", "kl_labels")
"""The columns `with_kl_rows` adds: each example's KL sequence and its labels."""


def kl_rows(
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    *,
    max_len: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, labels) of each example's KL sequence: its prompt (its first `prompt_lens` tokens) then the
    completion of the example before it (the first takes the last one's), cut to `max_len` tokens."""
    n = len(input_ids)
    out_ids, out_labels = [], []
    for i in range(n):
        j = (i - 1) % n
        prompt, start = list(input_ids[i][: prompt_lens[i]]), prompt_lens[j]
        room = None if max_len is None else max(max_len - len(prompt), 0)
        completion = list(input_ids[j][start:])[:room]
        out_ids.append([*prompt, *completion])
        out_labels.append([IGNORE_INDEX] * len(prompt) + list(labels[j][start:])[:room])
    return out_ids, out_labels


def with_kl_rows(rows: Any, *, max_len: int | None = None) -> Any:
    """Prepared unpacked kto rows (one example a row: finetune.data.batching.pairs.pack_examples without
    bins) with their KL sequences added as `kl_input_ids` / `kl_labels` (see the module docstring).

    The whole split is read once to rotate completions across rows (a copy of its token ids: small
    next to the image bytes the rows already hold)."""
    if any(n != 1 for n in rows["num_units"]):
        raise ValueError("kto rows with images hold one example each (they are never packed)")
    table = rows.select_columns(["input_ids", "labels", "seq_lens", "prompt_lens"]).to_dict()
    ends = [lens[0] for lens in table["seq_lens"]]  # drop any padding after the example
    ids = [r[:end] for r, end in zip(table["input_ids"], ends, strict=True)]
    labs = [r[:end] for r, end in zip(table["labels"], ends, strict=True)]
    kl_ids, kl_labels = kl_rows(ids, labs, [p[0] for p in table["prompt_lens"]], max_len=max_len)
    return rows.add_column("kl_input_ids", kl_ids).add_column("kl_labels", kl_labels)


def collate_vlm_kto(
    rows: list[dict], *, pad_token_id: int, pad_to_multiple_of: int = 1, processor: Any
) -> dict:
    """Batch kto rows with images (`with_kl_rows`'s): the examples as padded rows with their pixels
    (`collate_vlm`), their KL sequences as `kl_`-prefixed padded rows beside them (the same pixels:
    each KL sequence keeps its example's prompt and images), `desirable`, `num_units` and `row_index`.

    The pixels are processed once for both (the KL rows' image tokens are the examples', in the same
    order); only the image-token types, read from the ids, are made for the KL rows.
    """
    examples = [
        {
            "input_ids": r["input_ids"][: r["seq_lens"][0]],
            "labels": r["labels"][: r["seq_lens"][0]],
            "images": r.get("images") or [],
        }
        for r in rows
    ]
    batch = collate_vlm(
        examples, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, processor=processor
    )
    kl = collate_rows(
        [{"input_ids": r["kl_input_ids"], "labels": r["kl_labels"]} for r in rows],
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        packed=False,
    )
    del kl["position_ids"]  # the model derives them from the attention mask, as collate_vlm's rows
    types = image_inputs(processor, [[] for _ in rows], kl["input_ids"])  # token types only: no images
    pixels = {k: v for k, v in batch.items() if k not in kl and k not in types and k != "labels"}
    batch |= {f"kl_{k}": v for k, v in (kl | types | pixels).items()}
    batch["num_units"] = torch.ones(len(rows), dtype=torch.long)
    batch["desirable"] = torch.tensor([d for r in rows for d in r["desirable"]], dtype=torch.bool)
    if "row_index" in rows[0]:
        batch["row_index"] = torch.tensor([r["row_index"] for r in rows], dtype=torch.long)
    return batch
