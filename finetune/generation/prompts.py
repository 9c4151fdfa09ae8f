"""Prompts in, texts out: what every generation backend shares (finetune.generation.protocol).

A prompt is a string (one user turn) or a list of ``{"role", "content"}`` messages. It is rendered
with the tokenizer's chat template and ``add_generation_prompt=True`` (so the template's default
system prompt applies when the messages have none), then tokenized the way training tokenizes chat
rows: without the tokenizer's special tokens, its own prefix (bos) prepended when the rendered text
does not start with it. ``use_chat_template=False`` tokenizes a string prompt as it is (plus that
prefix), for models trained on alpaca or completion text.

A vision-language model's prompts carry images: each is rendered as training renders such rows
(`vlm_prompt_inputs`: the chat template with image parts, the processor expanding each image into its
tokens). Generated ids end at a stop token (`stop_token_ids`: eos and the chat templates'
end-of-turn tokens) and are decoded without special tokens (`decode_completion`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Prompt = str | Sequence[dict[str, Any]]
# End-of-turn tokens of common chat templates: generation stops at whichever the tokenizer has
# (<end_of_utterance>: SmolVLM / Idefics3).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<end_of_utterance>",
)  # fmt: skip


def prompt_ids(
    tokenizer, prompt: Prompt, *, use_chat_template: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of one prompt, ending where the model's answer starts; `tools` (JSON schemas of chat
    tools) go to the chat template, which renders them where the model family expects them."""
    if use_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, tools=tools
        )
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise ValueError("use_chat_template=False takes string prompts, not message lists")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prefix = _prefix_ids(tokenizer)
    return ids if ids[: len(prefix)] == prefix else [*prefix, *ids]


def vlm_prompt_inputs(
    processor, messages: Sequence[dict[str, Any]], pictures: Sequence[Any]
) -> dict[str, Any]:
    """A vision-language model's inputs for `messages` (each image a ``finetune.data.formats.images.SENTINEL`` in
    its text, `pictures` the PIL images in order), rendered as training renders such rows: the chat
    template with image parts, then the processor expanding each image into its tokens and pixels."""
    from finetune.data.formats.images import as_parts

    tokenizer = processor.tokenizer
    text = tokenizer.apply_chat_template(as_parts(list(messages)), add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text],
        images=[list(pictures)] if pictures else None,
        add_special_tokens=False,
        return_tensors="pt",
    )
    inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    prefix = _prefix_ids(tokenizer)
    if prefix and inputs["input_ids"][0, : len(prefix)].tolist() != prefix:  # training prepends them too
        ids = torch.tensor([prefix], dtype=inputs["input_ids"].dtype)
        inputs["input_ids"] = torch.cat([ids, inputs["input_ids"]], dim=1)
        inputs["attention_mask"] = torch.cat([torch.ones_like(ids), inputs["attention_mask"]], dim=1)
        for name in ("token_type_ids", "mm_token_type_ids"):  # per-token: the prefix is text
            if name in inputs:
                inputs[name] = torch.cat([torch.zeros_like(ids), inputs[name]], dim=1)
    return inputs


def _prefix_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text (its bos, or nothing), as training prepends them."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    start = next((k for k in range(len(with_special)) if with_special[k : k + len(plain)] == plain), 0)
    return list(with_special[:start])


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Ids that end an answer: the tokenizer's eos, the model's generation-config eos, and the
    end-of-turn tokens of common chat templates that the tokenizer has as special tokens."""
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for candidate in [tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])]:
        if candidate is not None:
            ids.append(int(candidate))
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special
    }
    ids += [tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN_TOKENS if t in special]
    return list(dict.fromkeys(ids))


def vlm_prompt_ids(processor, prompt: Prompt, pictures: Sequence[Any]) -> list[int]:
    """Token ids of one vision-language prompt (a string or messages, an image a SENTINEL in the text),
    each image expanded into the model's image tokens (`vlm_prompt_inputs`)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return vlm_prompt_inputs(processor, messages, pictures)["input_ids"][0].tolist()


def pictures_of(values: Sequence[Any]) -> list[Any]:
    """RGB PIL images of prepared image bytes (PIL images pass through)."""
    from finetune.data.formats.images import decode

    return [decode(v) if isinstance(v, (bytes, bytearray)) else v for v in values]


def decode_completion(tokenizer, ids: Sequence[int], *, stops: Sequence[int]) -> str:
    """Generated ids cut at the first stop id and decoded without special tokens."""
    ids = list(ids)
    end = next((k for k, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=True).strip()


def decode_new_tokens(tokenizer, new_ids: torch.Tensor, *, stops: Sequence[int]) -> list[str]:
    """Each row of generated ids cut at its first stop id and decoded without special tokens."""
    return [decode_completion(tokenizer, row, stops=stops) for row in new_ids.tolist()]


def encode_prompts(
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    use_chat_template: bool = True,
    processor=None,
    images: Sequence[Sequence[Any]] | None = None,
    tools: list[dict] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt (`prompt_ids`, with the chat tools' schemas `tools`); with a
    vision-language model's `processor`, prompt k's images `images[k]` (bytes or PIL images) expanded
    into its image tokens (`vlm_prompt_ids`)."""
    if processor is None:
        return [prompt_ids(tokenizer, p, use_chat_template=use_chat_template, tools=tools) for p in prompts]
    return [
        vlm_prompt_ids(processor, p, pictures_of(images[k] if images else ())) for k, p in enumerate(prompts)
    ]


def chat_inputs(
    tokenizer, prompt: Prompt, *, use_chat_template: bool = True, processor=None, pictures: Sequence[Any] = ()
) -> dict[str, torch.Tensor]:
    """The model inputs (input_ids, attention_mask, and a vision-language model's pixels) of one
    prompt, a batch of one, for an interactive answer."""
    if processor is not None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return vlm_prompt_inputs(processor, messages, pictures)
    ids = torch.tensor([prompt_ids(tokenizer, prompt, use_chat_template=use_chat_template)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
