"""``prompt``: prompts alone, for online RL (train.objective grpo), the other columns kept for rewards.

A row ``{"question": "Sam had 24 cards ...", "answer": "... #### 7"}`` with ``field_prompt: question``
becomes the prompt's ids, ending where the model's answer starts: with ``apply_chat_template`` (or a
prompt that is a list of messages) the chat template renders it as a user turn followed by its
generation prompt (``<|im_start|>assistant\\n``), else the text is tokenized as it is. Nothing is
trained from the prompt itself (every label is -100): the model's own completions are, at training
time. The whole row goes along as JSON in the ``row`` column, so a reward reads any column of it
(``field_expected: answer``), whatever its type.

For a vision-language model (model.kind vlm) the prompt may hold images, as chat rows do: image parts in
its messages (``{"type": "image", "image": "images/0007.png"}``), or an ``images`` column
(``field_images``) with one ``<image>`` placeholder per image in its text. The prompt is then rendered
with the chat template (where the images go), the processor expands each image into the model's image
tokens (`finetune.data.formats.encode.expand`), and the image bytes go in the ``images`` column: the
rollout generates and scores the completions given them (finetune.objectives.rollout). A text model's
prompt with images is an error (its images would be lost).

>>> from types import SimpleNamespace as NS
>>> prompt_messages({"q": ["2+2?", [{"role": "user", "content": "3+3?"}], None]}, NS(field_prompt="q"))[:2]
[[{'role': 'user', 'content': '2+2?'}], [{'role': 'user', 'content': '3+3?'}]]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import datasets

from finetune.constants import IGNORE_INDEX
from finetune.data.formats import encode
from finetune.data.formats.chat import conversation
from finetune.data.formats.chat_template import images_need_vlm, with_row_images
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import BadRow, Example, optional_column, text
from finetune.data.sources.damage import BAD_ROW_COLUMN

FEATURES = {"row": datasets.Value("string")}


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read; the images column only when the data has it, unless the
    recipe names it."""
    return {"field_prompt": entry.field_prompt} | optional_column(entry, "field_images", column_names)


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """With ``apply_chat_template``, or when the prompt column holds lists of messages."""
    return entry.apply_chat_template or isinstance(
        features.get(entry.field_prompt), (list, datasets.Sequence)
    )


def prompt_messages(batch: dict[str, list], entry: Any) -> list[list[dict[str, Any]] | str | BadRow]:
    """Each row's prompt: a list of messages (a string prompt as one user turn), or the reason the row
    can't be used."""
    out: list[list[dict[str, Any]] | str | BadRow] = []
    for value in batch[entry.field_prompt]:
        if isinstance(value, list):
            out.append(conversation(value, entry.field_prompt))
            continue
        value = text(value, entry.field_prompt)
        out.append(value if isinstance(value, BadRow) else [{"role": "user", "content": value}])
    return out


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """The prompt ids of each row (rendered up to the generation prompt), no trained label, and the row;
    a prompt with images (`with_images`) also its images' bytes, each expanded into its image tokens."""
    prompts = with_images(prompt_messages(batch, entry), batch, entry, enc)
    texts = []
    for raw, value in zip(batch[entry.field_prompt], prompts, strict=True):
        if isinstance(value, BadRow):
            texts.append("")
        elif entry.apply_chat_template or isinstance(raw, list) or _has_images(value):
            texts.append(enc.render(value, add_generation_prompt=True))
        else:
            texts.append(value[0]["content"])
    encoded = enc.ids(texts)
    names = [c for c in batch if c != BAD_ROW_COLUMN]
    examples: list[Example | BadRow] = []
    for k, (value, ids, rendered) in enumerate(zip(prompts, encoded, texts, strict=True)):
        if isinstance(value, BadRow):
            examples.append(value)
            continue
        prefix = enc.prefix_ids
        if prefix and ids[: len(prefix)] != prefix:
            ids = [*prefix, *ids]
        extra: dict[str, Any] = {}
        if _has_images(value):
            expanded = _with_image_tokens(value, rendered, ids, enc, entry.field_prompt)
            if isinstance(expanded, BadRow):
                examples.append(expanded)
                continue
            ids, extra["images"] = expanded
        row = json.dumps({name: batch[name][k] for name in names}, default=str, ensure_ascii=False)
        examples.append((ids, [IGNORE_INDEX] * len(ids), {"row": row, **extra}))
    return examples


def with_images(prompts: list, batch: dict[str, list], entry: Any, enc: Encoder) -> list:
    """The prompts with the images column (LLaVA style, when the data has it and the model reads images,
    or the recipe names it) put where their ``<image>`` placeholders are; a prompt with images for a text
    model is a bad row (`images_need_vlm`: an error, whatever data.on_bad_row says)."""
    named = "field_images" in getattr(entry, "model_fields_set", set())
    if entry.field_images in batch and (enc.processor is not None or named):
        prompts = [
            with_row_images(p, refs, entry.field_images) if isinstance(p, list) else p
            for p, refs in zip(prompts, batch[entry.field_images], strict=True)
        ]
    if enc.processor is None:
        prompts = [images_need_vlm(p, entry.field_prompt) if isinstance(p, list) else p for p in prompts]
    return prompts


def _has_images(value: Any) -> bool:
    return isinstance(value, list) and any(m.get("images") for m in value)


def _with_image_tokens(
    messages: list[dict[str, Any]], rendered: str, ids: list[int], enc: Encoder, field: str
) -> tuple[list[int], list[bytes]] | BadRow:
    """(ids with each image's markup expanded into its tokens, the images' bytes), or the bad row of an
    image that cannot be read or a row the processor rejects."""
    loaded = encode.load_images(messages, enc, field)
    if isinstance(loaded, BadRow):
        return loaded
    expanded = encode.expand(enc, rendered, loaded, ids, [IGNORE_INDEX] * len(ids), field=field)
    if isinstance(expanded, BadRow):
        return expanded
    return expanded[0], loaded
