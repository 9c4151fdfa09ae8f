"""Generation from chat prompts: batched (evaluation, online RL) and streamed (interactive chat).

The one sampling primitive is `generate_ids`: left-padded batches with the KV cache (transformers'
`generate`), stop tokens, greedy decoding (temperature 0) or sampling (temperature, top_p, top_k,
num_return_sequences), where every returned sequence draws from its own seeded generator
(`SeededSampler`): what a prompt's completions are depends on its seeds only, not on which other
prompts share its batch, so a resumed run samples the same completions. `generate` (texts, greedy)
and `stream_chat` build on the same prompt rendering and stop tokens.

A prompt is a string (one user turn) or a list of ``{"role", "content"}`` messages. It is rendered
with the tokenizer's chat template and ``add_generation_prompt=True`` (so the template's default
system prompt applies when the messages have none), then tokenized the way training tokenizes chat
rows: without the tokenizer's special tokens, its own prefix (bos) prepended when the rendered text
does not start with it. ``use_chat_template=False`` tokenizes a string prompt as it is (plus that
prefix), for models trained on alpaca or completion text.

A vision-language model's prompts (its `processor` given) carry images: each is rendered as training
renders such rows (`vlm_prompt_inputs`: the chat template with image parts, the processor expanding each
image into its tokens), and a batch's pixels are made as training's collate makes them
(finetune.data.vision.image_inputs).

Works on a plain transformers model and on a PEFT model; the model is put in eval mode for the
call and given back in the mode it was in, so the in-training evaluation can call it between steps
(with `accelerator.unwrap_model(model)`: DDP's wrapper has no `generate`). Each process generates
for the prompts it is given; a sharded model (FSDP, ZeRO-3) would need every rank in each step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor

Prompt = str | Sequence[dict[str, Any]]
# End-of-turn tokens of common chat templates: generation stops at whichever the tokenizer has
# (<end_of_utterance>: SmolVLM / Idefics3).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<end_of_utterance>",
)  # fmt: skip


def prompt_ids(tokenizer, prompt: Prompt, *, use_chat_template: bool = True) -> list[int]:
    """Token ids of one prompt, ending where the model's answer starts."""
    if use_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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
    """A vision-language model's inputs for `messages` (each image a ``finetune.data.images.SENTINEL`` in
    its text, `pictures` the PIL images in order), rendered as training renders such rows: the chat
    template with image parts, then the processor expanding each image into its tokens and pixels."""
    from finetune.data.images import as_parts

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


def _pad_id(tokenizer, stops: list[int]) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return stops[0] if stops else 0


@contextlib.contextmanager
def eval_mode(model):
    """Eval mode and no autograd inside; the model's training mode is given back on exit."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _on(tensor: torch.Tensor, device: torch.device, model) -> torch.Tensor:
    """`tensor` on `device`; pixel values (floating point) in the model's dtype, as its vision tower wants."""
    if tensor.is_floating_point():
        return tensor.to(device, dtype=getattr(model, "dtype", tensor.dtype))
    return tensor.to(device)


def _generation_kwargs(tokenizer, model, max_new_tokens: int) -> dict[str, Any]:
    stops = stop_token_ids(tokenizer, model)
    # Greedy, whatever sampling the model's generation_config asks for; the cache is on even where
    # training turned it off for gradient checkpointing.
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "eos_token_id": stops or None,
        "pad_token_id": _pad_id(tokenizer, stops),
        "use_cache": True,
    }


@dataclass(frozen=True)
class Completion:
    """One generated sequence: its new token ids (cut after the stop token, which is kept) and
    whether it ended at a stop token (False: cut at max_new_tokens)."""

    ids: list[int]
    finished: bool


class SeededSampler(LogitsProcessor):
    """Sampling inside `generate` with one torch.Generator per sequence of the batch.

    transformers' own sampling draws every row from the global RNG, so a completion would depend on
    the other rows of its batch. Here the logits are tempered and filtered with transformers' own
    warpers, each row draws its token from its generator, and every other token gets -inf: greedy
    decoding then picks exactly the drawn token. Rows that already stopped keep drawing (their draws
    are discarded), which changes nothing for the rows still running.
    """

    def __init__(self, generators: list[torch.Generator], *, temperature: float, top_p: float, top_k: int):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = generators
        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float()
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores, dim=-1)
        picked = torch.cat(
            [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)]
        )
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(picked), device=out.device), picked] = 0.0
        return out


def generate_ids(
    model,
    tokenizer,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_return_sequences: int = 1,
    seeds: Sequence[Sequence[int]] | None = None,
    progress: bool = False,
    processor=None,
    images: Sequence[Sequence[Any]] | None = None,
) -> list[list[Completion]]:
    """For each prompt (token ids, e.g. from `prompt_ids`), its `num_return_sequences` completions.

    temperature 0 is greedy (one distinct answer; `seeds` unused); above 0 each completion j of
    prompt k is sampled with the generator seeded `seeds[k][j]` (required). Prompts go in
    left-padded batches of `batch_size` prompts (longest first, so a batch holds prompts of similar
    length), each expanded to its completions; the model is in eval mode without autograd inside and
    given back in its mode. A vision-language model's prompts (ids with their image tokens expanded,
    `vlm_prompt_ids`) come with `images[k]`, prompt k's images (bytes or PIL images, in order), which
    its `processor` turns into the batch's pixels as training's collate does.
    """
    from tqdm.auto import tqdm

    sampling = temperature > 0
    if sampling and (seeds is None or any(len(s) != num_return_sequences for s in seeds)):
        raise ValueError("sampling needs one seed per completion: seeds[k] holds num_return_sequences seeds")
    order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))
    kwargs = _generation_kwargs(tokenizer, model, max_new_tokens)
    stops = set(kwargs["eos_token_id"] or [])
    outputs: list[list[Completion]] = [[] for _ in prompts]
    batches = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    device = _device(model)
    with eval_mode(model):
        for batch in tqdm(batches, desc="generating", unit="batch", disable=not progress):
            rows = [prompts[k] for k in batch for _ in range(num_return_sequences)]
            extra = {}
            if sampling:
                generators = [
                    torch.Generator(device=device).manual_seed(int(seed)) for k in batch for seed in seeds[k]
                ]
                sampler = SeededSampler(generators, temperature=temperature, top_p=top_p, top_k=top_k)
                extra["logits_processor"] = [sampler]
            pictures = None
            if processor is not None:
                pictures = [
                    _pictures(images[k] if images else ()) for k in batch for _ in range(num_return_sequences)
                ]
            new_ids = _generate_batch(
                model, rows, {**kwargs, **extra}, processor=processor, pictures=pictures
            )
            for r, row in enumerate(new_ids.tolist()):
                end = next((t for t, token in enumerate(row) if token in stops), None)
                completion = Completion(row if end is None else row[: end + 1], end is not None)
                outputs[batch[r // num_return_sequences]].append(completion)
    return outputs


def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    use_chat_template: bool = True,
    progress: bool = True,
    processor=None,
    images: Sequence[Sequence[Any]] | None = None,
) -> list[str]:
    """Greedy answers to `prompts`, in order (see `generate_ids`), stopping at eos / end of turn or
    after max_new_tokens; only the new tokens are decoded, special tokens removed. With a
    vision-language model's `processor`, prompt k's images are `images[k]` (bytes or PIL images, one
    per ``finetune.data.images.SENTINEL`` in its text)."""
    if processor is not None:
        encoded = [
            vlm_prompt_ids(processor, p, _pictures(images[k] if images else ()))
            for k, p in enumerate(prompts)
        ]
    else:
        encoded = [prompt_ids(tokenizer, p, use_chat_template=use_chat_template) for p in prompts]
    completions = generate_ids(
        model,
        tokenizer,
        encoded,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
        processor=processor,
        images=images,
    )
    stops = stop_token_ids(tokenizer, model)
    return [decode_completion(tokenizer, c[0].ids, stops=stops) for c in completions]


def vlm_prompt_ids(processor, prompt: Prompt, pictures: Sequence[Any]) -> list[int]:
    """Token ids of one vision-language prompt (a string or messages, an image a SENTINEL in the text),
    each image expanded into the model's image tokens (`vlm_prompt_inputs`)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return vlm_prompt_inputs(processor, messages, pictures)["input_ids"][0].tolist()


def _pictures(values: Sequence[Any]) -> list[Any]:
    """RGB PIL images of prepared image bytes (PIL images pass through)."""
    from finetune.data.images import decode

    return [decode(v) if isinstance(v, (bytes, bytearray)) else v for v in values]


def _generate_batch(
    model, batch: list[list[int]], kwargs: dict[str, Any], *, processor=None, pictures=None
) -> torch.Tensor:
    """The generated ids (batch x new tokens) of left-padded prompts; with a vision-language model's
    `processor`, `pictures` holds each row's PIL images (finetune.data.vision.image_inputs)."""
    width = max(len(ids) for ids in batch)
    pad = kwargs["pad_token_id"]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if processor is not None:
        from finetune.data.vision import image_inputs

        inputs |= image_inputs(processor, pictures, input_ids)
    device = _device(model)
    out = model.generate(**{k: _on(v, device, model) for k, v in inputs.items()}, **kwargs)
    return out[:, width:].cpu()


def decode_completion(tokenizer, ids: Sequence[int], *, stops: Sequence[int]) -> str:
    """Generated ids cut at the first stop id and decoded without special tokens."""
    ids = list(ids)
    end = next((k for k, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=True).strip()


def decode_new_tokens(tokenizer, new_ids: torch.Tensor, *, stops: Sequence[int]) -> list[str]:
    """Each row of generated ids cut at its first stop id and decoded without special tokens."""
    return [decode_completion(tokenizer, row, stops=stops) for row in new_ids.tolist()]


def stream_chat(
    model,
    tokenizer,
    prompt: Prompt,
    *,
    max_new_tokens: int = 512,
    use_chat_template: bool = True,
    processor=None,
    pictures: Sequence[Any] = (),
) -> Iterator[str]:
    """Greedy answer to one prompt (a string or the conversation so far), yielded in pieces of text
    as they are generated, for an interactive chat. Errors in generation are raised here. With a
    vision-language model's `processor`, the prompt's images (SENTINELs in its text) are `pictures`
    (`vlm_prompt_inputs`)."""
    from transformers import TextIteratorStreamer

    if processor is not None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        inputs = vlm_prompt_inputs(processor, messages, pictures)
    else:
        ids = torch.tensor([prompt_ids(tokenizer, prompt, use_chat_template=use_chat_template)])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = _generation_kwargs(tokenizer, model, max_new_tokens)
    failure: list[BaseException] = []

    def run() -> None:
        # Grad mode is per thread: eval_mode's no_grad must be entered here.
        try:
            with eval_mode(model):
                device = _device(model)
                model.generate(
                    **{k: _on(v, device, model) for k, v in inputs.items()},
                    streamer=streamer,
                    **kwargs,
                )
        except BaseException as exc:
            failure.append(exc)
            streamer.end()  # else the loop below would wait forever for text

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if failure:
        raise failure[0]
