"""Vision-language chat rows: token ids with every image's tokens in place, labels, and image bytes.

A conversation with images (finetune.data.formats.images: a `SENTINEL` per image in the text) is rendered by
the chat template with image parts, so the text holds the template's own image markup (Qwen2-VL's
``<|vision_start|><|image_pad|><|vision_end|>``, Idefics3's ``<image>``, Gemma 3's
``<start_of_image>``); its trained spans are found exactly as for text (finetune.data.formats.chat), and the
text is tokenized with offsets into ids and labels. The model's processor then expands each image's
markup into the tokens the model expects for that image (their number depends on the image's size:
Qwen2-VL's grid, Idefics3's tiles, Gemma 3's fixed 256): `expand` runs the processor on the same text
with the images and carries the labels over by aligning the two id sequences (the processor changes
only the tokens around images). Image tokens are never trained.

Where pixels are processed: at collate time (`collate_vlm`), as TRL does. The prepared rows hold the
image bytes, not pixel values: pixel_values are far larger than the encoded image (about 150 times on
the demo; Qwen2-VL: 1176 floats per 14x14 patch), which would make the cache dominate the disk and the
page cache, and on the demo processing the images per batch was faster than reading cached arrays back
(benchmarks/RESULTS.md, "Vision-language: where pixels are processed"). The processor's output is
deterministic, so the token counts fixed at prepare time match the features computed at collate time.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.collate import collate_rows
from finetune.data.formats import encode, images
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import BadRow, Example
from finetune.model.families import IMAGE_MARKUP_ATTRIBUTES, patch_grid_of

PROCESSOR_REJECTED = "processor_rejected"
"""Bad-row reason: the processor could not turn the row's text and images into model inputs."""

IMAGE_IN_COMPLETION = "image_in_completion"
"""Bad-row reason: a preference pair's chosen or rejected messages hold an image (only prompts may)."""


def chat_examples(
    convs: list[list[dict[str, Any]] | BadRow],
    enc: Encoder,
    entry: Any,
    *,
    field: str,
    tools: list[list[dict[str, Any]] | None] | None = None,
) -> list[Example | BadRow]:
    """Each conversation as (ids, labels, {"images": [bytes]}): rendered, masked (as
    encode.chat_examples) and its images expanded into their tokens; or the row's BadRow."""
    loaded = [c if isinstance(c, BadRow) else _load_images(c, enc, field) for c in convs]
    convs = [img if isinstance(img, BadRow) else c for c, img in zip(convs, loaded, strict=True)]
    texts, found = encode.chat_texts(convs, enc, entry, field=field, tools=tools)
    rows: list[Example | BadRow] = []
    for text, spans, encoding, imgs in zip(
        texts, found, enc.encode(texts, offsets=True), loaded, strict=True
    ):
        if isinstance(spans, BadRow):
            rows.append(spans)
            continue
        ids, labels = enc.labelled(encoding, None if entry.train_on_inputs else spans)
        if imgs:
            expanded = expand(enc, text, imgs, ids, labels, field=field)
            if isinstance(expanded, BadRow):
                rows.append(expanded)
                continue
            ids, labels = expanded
        rows.append((ids, labels, {"images": imgs}))
    return rows


def pair_images(
    shared: list[dict[str, Any]], completions: list[list[dict[str, Any]]], enc: Encoder, field: str
) -> list[bytes] | BadRow:
    """The images of a preference pair's (or kto example's) shared prompt, opened and checked: both
    completions are scored given them. An image inside a completion is a bad row (the pair would compare
    completions that see different pictures), and so is any image when the model reads only text."""
    if not any(m.get("images") for c in (shared, *completions) for m in c):
        return []
    if enc.processor is None:
        detail = (
            "the row has images, but the model reads only text; for a vision-language model set model.kind: "
            "vlm (its processor then reads the images), or remove the image parts"
        )
        return BadRow(field, images.IMAGES_NEED_VLM, detail)
    if any(m.get("images") for c in completions for m in c):
        detail = (
            "an image is in a completion, not in the prompt: completions (a pair's chosen and rejected, a kto "
            "example's completion) are scored given the prompt and its images, so put the images in the prompt's "
            "messages"
        )
        return BadRow(field, IMAGE_IN_COMPLETION, detail)
    return _load_images(shared, enc, field)


def _load_images(conv: list[dict[str, Any]], enc: Encoder, field: str) -> list[bytes] | BadRow:
    """The bytes of a conversation's images in order, each opened and checked (images.load_image)."""
    out = []
    for j, message in enumerate(conv):
        for k, ref in enumerate(message.get("images") or []):
            where = f"{field}[{j}].content (image {k})"
            data = images.load_image(ref, where, enc.image_root, enc.image_max_pixels)
            if isinstance(data, BadRow):
                return data
            out.append(data)
    return out


def expand(
    enc: Encoder, text: str, imgs: list[bytes], ids: list[int], labels: list[int], *, field: str
) -> tuple[list[int], list[int]] | BadRow:
    """(ids, labels) with each image's markup expanded by the processor into the model's image tokens;
    the labels carried over from the unexpanded ids, image tokens masked."""
    try:
        out = enc.processor(text=[text], images=[[images.decode(b) for b in imgs]], add_special_tokens=False)
    except Exception as exc:  # the processor's own checks (too small an image, token count mismatch ...)
        return BadRow(field, PROCESSOR_REJECTED, f"the processor rejected the row's text and images: {exc}")
    full = [int(t) for t in out["input_ids"][0]]
    prefix = enc.prefix_ids
    if prefix and full[: len(prefix)] != prefix:
        full = [*prefix, *full]
    return full, align(ids, labels, full, image_token_ids(enc.processor))


def align(ids: list[int], labels: list[int], full: list[int], masked: set[int]) -> list[int]:
    """Labels for `full` (the processor's ids): those of `ids` where the two sequences match (difflib's
    matching blocks), -100 on what the processor inserted or changed and on the `masked` ids.

    >>> align([5, 9, 7, 8], [-100, -100, 7, 8], [5, 3, 9, 9, 9, 3, 7, 8], {9})
    [-100, -100, -100, -100, -100, -100, 7, 8]
    """
    out = [IGNORE_INDEX] * len(full)
    matcher = difflib.SequenceMatcher(None, ids, full, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        out[b : b + size] = labels[a : a + size]
    return [IGNORE_INDEX if t in masked else label for t, label in zip(full, out, strict=True)]


def image_token_ids(processor: Any) -> set[int]:
    """The ids of the image markup tokens a processor and its tokenizer name (never trained): the
    attributes the vision families table lists (finetune.model.families.IMAGE_MARKUP_ATTRIBUTES)."""
    tokenizer = processor.tokenizer
    ids = set()
    for owner in (processor, tokenizer):
        if isinstance(getattr(owner, "image_token_id", None), int):
            ids.add(owner.image_token_id)
        for name in IMAGE_MARKUP_ATTRIBUTES:
            token = getattr(owner, name, None)
            token = getattr(token, "content", token)  # an AddedToken
            if isinstance(token, str) and token:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                    ids.add(token_id)
    return ids


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
