"""Batches of rows with images (model.kind vlm): their pixels processed at collate time, preference
pairs as one row per sequence, and KTO's KL rows, which rotate completions over the prepared split.

Where pixels are processed: at collate time (`collate_vlm`), as TRL does. The prepared rows hold the
image bytes, not pixel values: pixel_values are far larger than the encoded image (about 150 times on
the demo; Qwen2-VL: 1176 floats per 14x14 patch), which would make the cache dominate the disk and the
page cache, and on the demo processing the images per batch was faster than reading cached arrays back
(benchmarks/RESULTS.md, "Vision-language: where pixels are processed"). The processor's output is
deterministic, so the token counts fixed at prepare time (finetune.data.formats.encode.expand) match
the features computed at collate time.

KTO on image-text examples: KTO's reference point z0 is a KL estimate from mismatched completions: each
prompt scored with a completion that is not its own (TRL's KTOTrainer rotates completions by one within
each batch, its vision collator included). Text kto rows are packed, and each packed row's KL row
rotates the completions within the row (finetune.data.batching.pairs.kto_kl_row). Rows with images are
never packed (finetune.recipe.schema.VLM_NO_PACKING), so the rotation is over the prepared split
instead:

    the KL sequence of example i = the prompt of example i (with its own images)
                                   + the completion of example i - 1 in the prepared order
                                   (example 0 takes the last one's)

the labels marking that completion only. It is fixed by the prepared order, not by the shuffled
batches, so training, evaluation and the precomputed reference log-probs (looked up by row) all score
the same KL sequences, and it is TRL's rotation exactly when a batch is the split in order. A split
of one example gets its own completion back (the KL estimate is then its own log-ratio), as a text
row of one example does. A KL sequence is cut to the data's sequence_len from the end of its
borrowed completion (never the prompt: its image tokens stay whole)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.collate import collate_rows
from finetune.data.formats import images
from finetune.model.families import patch_grid_of

# --------------------------------------------------------------------------------------------- collate


def collate_vlm(rows: list[dict], *, pad_token_id: int, pad_to_multiple_of: int = 1, processor: Any) -> dict:
    """Pad unpacked rows (collate.collate_rows) and add the image processor's tensors for their images
    (pixel_values, and image_grid_thw or pixel_attention_mask as the model needs).

    No position_ids: the model derives them from the attention mask (Qwen2-VL's multimodal RoPE needs
    the image positions, which plain 0..n ids would lose). The images are decoded and processed here,
    in the loader's workers (see the module docstring for why not at prepare time).
    """
    batch = collate_rows(rows, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, packed=False)
    del batch["position_ids"]
    per_row = [[images.decode(b) for b in row.get("images") or []] for row in rows]
    return batch | image_inputs(processor, per_row, batch["input_ids"])


def image_inputs(
    processor: Any, per_row: list[list[Any]], input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The processor's tensors for a batch's images (`per_row`: each row's PIL images, in order) beside
    its padded `input_ids`: pixel_values and image_grid_thw or pixel_attention_mask as the model needs,
    and the image-token types the model reads. Training's collate and generation share it, so a
    generation set's prompts reach the model as training rows do."""
    out: dict[str, torch.Tensor] = {}
    per_row = [imgs for imgs in per_row if imgs]  # the models match image features to tokens in order
    if per_row:
        pixels = processor.image_processor(images=per_row, return_tensors="pt")
        out |= {k: v for k, v in pixels.items() if isinstance(v, torch.Tensor)}
    if getattr(processor, "return_mm_token_type_ids", False):
        # Which tokens are image tokens, as the processor marks them: Qwen2-VL's multimodal RoPE needs it
        # (mm_token_type_ids), Gemma 3 attends bidirectionally within an image by it (token_type_ids).
        types = processor.create_mm_token_type_ids(input_ids.tolist())
        name = "token_type_ids" if "token_type_ids" in processor.model_input_names else "mm_token_type_ids"
        out[name] = torch.tensor(types, dtype=torch.long)
    return out


def collate_vlm_pairs(
    rows: list[dict], *, pad_token_id: int, pad_to_multiple_of: int = 1, processor: Any
) -> dict:
    """Batch prepared preference rows with images (one pair per row, chosen then rejected, and the
    prompt's images) as unpacked rows chosen_0, rejected_0, chosen_1, ...: each sequence its own padded
    row with its pixels (`collate_vlm`), so the model places image features and positions per sequence.

    The images of a pair are processed once and their tensors repeated for its two rows (`_pixels_twice`,
    by the layout of the family's pixels: finetune.model.families). `num_units`
    (one per pair) and `row_index` come along as for packed preference batches.
    """
    sequences = []
    for row in rows:
        if row["num_units"] != 1:
            raise ValueError("rows with images hold one pair each (they are never packed)")
        chosen_len, total = row["seq_lens"][0], sum(row["seq_lens"][:2])
        for part in (slice(0, chosen_len), slice(chosen_len, total)):
            sequences.append({"input_ids": row["input_ids"][part], "labels": row["labels"][part]})
    batch = collate_vlm(
        sequences, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, processor=processor
    )
    per_pair = [[images.decode(b) for b in row.get("images") or []] for row in rows]
    per_pair = [imgs for imgs in per_pair if imgs]
    if per_pair:
        pixels = {
            k: v
            for k, v in processor.image_processor(images=per_pair, return_tensors="pt").items()
            if isinstance(v, torch.Tensor)
        }
        batch |= _pixels_twice(pixels, per_pair, processor)
    batch["num_units"] = torch.tensor([row["num_units"] for row in rows], dtype=torch.long)
    if "row_index" in rows[0]:
        batch["row_index"] = torch.tensor([row["row_index"] for row in rows], dtype=torch.long)
    return batch


def _pixels_twice(pixels: dict[str, torch.Tensor], per_pair: list[list], processor: Any) -> dict:
    """The image processor's tensors of each pair's images, repeated for its chosen and rejected rows.

    Tensors with one entry per pair repeat as they are: a `per_row` layout always (Idefics3), a
    `per_image` one when each pair has one image (Gemma 3, LLaVA). A `flat_patches` layout (Qwen2-VL)
    holds the patches of every image flat, one row of its `patch_grid` tensor per image (its t*h*w
    patches), so its tensors are split per pair and each pair's slices repeated; any other layout is
    processed again for the second row of each pair (correct, twice the work).
    """
    if all(v.shape[0] == len(per_pair) for v in pixels.values()):
        return {k: v.repeat_interleave(2, dim=0) for k, v in pixels.items()}
    counts = [len(imgs) for imgs in per_pair]
    key = patch_grid_of(pixels)
    if key and set(pixels) == {"pixel_values", key} and pixels[key].shape[0] == sum(counts):
        patches = pixels[key].prod(dim=-1).tolist()
        if sum(patches) == pixels["pixel_values"].shape[0]:
            ends = [sum(counts[: i + 1]) for i in range(len(counts))]
            out = {}
            for name, per_image in (("pixel_values", patches), (key, [1] * len(patches))):
                of_image = pixels[name].split(per_image)
                of_pair = [torch.cat(of_image[end - n : end]) for n, end in zip(counts, ends, strict=True)]
                out[name] = torch.cat([part for part in of_pair for _ in range(2)])
            return out
    twice = [imgs for imgs in per_pair for _ in range(2)]
    again = processor.image_processor(images=twice, return_tensors="pt")
    return {k: v for k, v in again.items() if isinstance(v, torch.Tensor)}


# ------------------------------------------------------------------------------------------- kto rows


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
    completion of the example before it (the first takes the last one's), cut to `max_len` tokens.

    >>> kl_rows([[1, 5, 6], [1, 7, 8, 9]], [[-100, -100, 6], [-100, -100, 8, 9]], [2, 2])
    ([[1, 5, 8, 9], [1, 7, 6]], [[-100, -100, 8, 9], [-100, -100, 6]])
    """
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
