"""Greedy generation from chat prompts: batched (evaluation) and streamed (interactive chat).

A prompt is a string (one user turn) or a list of ``{"role", "content"}`` messages. It is rendered
with the tokenizer's chat template and ``add_generation_prompt=True`` (so the template's default
system prompt applies when the messages have none), then tokenized the way training tokenizes chat
rows: without the tokenizer's special tokens, its own prefix (bos) prepended when the rendered text
does not start with it. ``use_chat_template=False`` tokenizes a string prompt as it is (plus that
prefix), for models trained on alpaca or completion text.

Works on a plain transformers model and on a PEFT model; the model is put in eval mode for the
call and given back in the mode it was in, so the in-training evaluation can call it between steps
(with `accelerator.unwrap_model(model)`: DDP's wrapper has no `generate`). Each process generates
for the prompts it is given; a sharded model (FSDP, ZeRO-3) would need every rank in each step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

Prompt = str | Sequence[dict[str, Any]]
# End-of-turn tokens of common chat templates: generation stops at whichever the tokenizer has.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


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


def generate(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    use_chat_template: bool = True,
    progress: bool = True,
) -> list[str]:
    """Greedy answers to `prompts`, in order: batches of left-padded prompts (longest first, so a
    batch holds prompts of similar length), stopping at eos / end of turn or after max_new_tokens;
    only the new tokens are decoded, special tokens removed."""
    from tqdm.auto import tqdm

    encoded = [prompt_ids(tokenizer, p, use_chat_template=use_chat_template) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda k: -len(encoded[k]))
    kwargs = _generation_kwargs(tokenizer, model, max_new_tokens)
    outputs: list[str] = [""] * len(encoded)
    batches = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    with eval_mode(model):
        for batch in tqdm(batches, desc="generating", unit="batch", disable=not progress):
            new_ids = _generate_batch(model, [encoded[k] for k in batch], kwargs)
            texts = decode_new_tokens(tokenizer, new_ids, stops=kwargs["eos_token_id"] or [])
            for k, text in zip(batch, texts, strict=True):
                outputs[k] = text
    return outputs


def _generate_batch(model, batch: list[list[int]], kwargs: dict[str, Any]) -> torch.Tensor:
    """The generated ids (batch x new tokens) of left-padded prompts."""
    width = max(len(ids) for ids in batch)
    pad = kwargs["pad_token_id"]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    device = _device(model)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
    return out[:, width:].cpu()


def decode_new_tokens(tokenizer, new_ids: torch.Tensor, *, stops: Sequence[int]) -> list[str]:
    """Each row of generated ids cut at its first stop id and decoded without special tokens."""
    texts = []
    for row in new_ids.tolist():
        end = next((k for k, t in enumerate(row) if t in stops), len(row))
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True).strip())
    return texts


def stream_chat(
    model,
    tokenizer,
    prompt: Prompt,
    *,
    max_new_tokens: int = 512,
    use_chat_template: bool = True,
) -> Iterator[str]:
    """Greedy answer to one prompt (a string or the conversation so far), yielded in pieces of text
    as they are generated, for an interactive chat. Errors in generation are raised here."""
    from transformers import TextIteratorStreamer

    ids = torch.tensor([prompt_ids(tokenizer, prompt, use_chat_template=use_chat_template)])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = _generation_kwargs(tokenizer, model, max_new_tokens)
    failure: list[BaseException] = []

    def run() -> None:
        # Grad mode is per thread: eval_mode's no_grad must be entered here.
        try:
            with eval_mode(model):
                device = _device(model)
                model.generate(
                    input_ids=ids.to(device),
                    attention_mask=torch.ones_like(ids).to(device),
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
