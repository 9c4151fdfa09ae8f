"""The transformers generation backend: the model being trained (or evaluated) generates itself.

Left-padded batches with the KV cache (transformers' `generate`), stop tokens, greedy decoding
(temperature 0) or sampling (temperature, top_p, top_k, num_return_sequences), where every returned
sequence draws from its own seeded generator (`SeededSampler`). It runs wherever the model runs (CPU
or GPU), and needs no weight sync: it holds the training model itself, so `sync_weights` only
re-binds the module it was given.

Works on a plain transformers model and on a PEFT model (with `merge_adapters`, its LoRA adapters
merged for each call and taken out again exactly); the model is put in eval mode for the
call and given back in the mode it was in, so the in-training evaluation can call it between steps
(with `accelerator.unwrap_model(model)`: DDP's wrapper has no `generate`). Each process generates
for the prompts it is given; a sharded model (FSDP, ZeRO-3) would need every rank in each step.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor
from transformers.generation import utils as generation_utils

from finetune.generation.prompts import pictures_of, stop_token_ids
from finetune.generation.protocol import Completion, SamplingParams
from finetune.model.forward import base_model, keeps_logits

# generate's name for a cache handed in: `cache` from transformers 5.2x on (past_key_values deprecated)
CACHE_KWARG = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


class TransformersBackend:
    """Generation with `model` (a transformers causal LM or image-text-to-text model, PEFT or not);
    see finetune.generation.protocol for the interface."""

    name = "transformers"
    copies_weights = False  # it generates with the training model's own parameters

    def __init__(
        self,
        model,
        tokenizer,
        *,
        processor=None,
        merge_adapters: bool | None = False,
        dtype: str | None = None,
    ):
        self.model, self.tokenizer, self.processor = model, tokenizer, processor
        # LoRA merged into the weights for each generate call and taken out bit for bit after
        # (finetune.model.adapters.merged_adapters): the plain layers decode faster, for one more copy
        # of the adapted weights while generating. None: merged where the model is on the CPU (measured
        # faster there, benchmarks/RESULTS.md; on a GPU the copy's memory is the scarcer thing).
        self.merge_adapters = merge_adapters
        # grpo.generation_dtype: sample from a merged copy of the weights in this dtype (made for each
        # call), each sampled token's log-prob kept (Completion.logprobs) for the importance-sampling
        # correction of the gap to the trainer's float32 log-probs, as with vLLM.
        self.dtype = getattr(torch, dtype) if dtype else None
        # Every process runs each generate step together (transformers' synced_gpus): set for a model
        # whose layers are gathered one at a time across processes (ZeRO-3 without a whole gather).
        self.synced_processes = False

    @property
    def merges(self) -> bool:
        """Whether a generate call merges the LoRA adapters (`merge_adapters`, None resolved on the model's
        device); a model that cannot merge (no LoRA, QLoRA, DoRA, sharded weights) runs as it is."""
        if self.merge_adapters is None:
            return _device(self.model).type == "cpu"
        return self.merge_adapters

    @property
    def stops(self) -> list[int]:
        return stop_token_ids(self.tokenizer, self.model)

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[Sequence[int]] | None = None,
        batch_size: int = 8,
        images: Sequence[Sequence[Any]] | None = None,
        progress: bool = False,
    ) -> list[list[Completion]]:
        from finetune.model.adapters import merged_adapters

        merge = self.merges or self.dtype is not None
        merging = merged_adapters(self.model, self.dtype) if merge else contextlib.nullcontext()
        with merging:
            return self._generate(prompts, params, seeds, batch_size, images, progress)

    def _generate(self, prompts, params, seeds, batch_size, images, progress) -> list[list[Completion]]:
        return generate_ids(
            self.model,
            self.tokenizer,
            prompts,
            max_new_tokens=params.max_new_tokens,
            batch_size=batch_size,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            num_return_sequences=params.num_return_sequences,
            seeds=seeds,
            progress=progress,
            processor=self.processor,
            images=images,
            synced_processes=self.synced_processes,
            stop_patterns=params.stop_patterns,
            sampling_logprobs=self.dtype is not None,
        )

    def stream(self, inputs: Mapping[str, torch.Tensor], params: SamplingParams) -> Iterator[str]:
        return stream_answer(self.model, self.tokenizer, inputs, max_new_tokens=params.max_new_tokens)

    def sync_weights(self, model) -> None:
        """Nothing to copy: the backend generates with the training model's own parameters."""
        self.model = model


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


@contextlib.contextmanager
def onednn_linears(model):
    """Inside (no autograd), `model`'s float32 `torch.nn.Linear` layers on the CPU compute with oneDNN's
    linear (torch.ops.mkldnn._linear_pointwise, what torch.compile's CPU backend calls) instead of
    torch's default MKL sgemm; on exit they are the plain layers again.

    Written here because torch picks oneDNN for 16-bit CPU matmuls only: a decode step multiplies a few
    rows (the sequences of the batch) by every weight, where MKL's sgemm ran SmolLM2's 30 layers and head
    at 16 rows in 70 ms a step against oneDNN's 52 (the weights streamed from memory, 2 cores;
    benchmarks/RESULTS.md). The products agree to float32 rounding, not bit for bit: the sampled tokens
    can differ from an MKL decode's where two candidates tie to the last bit, as between any two kernels,
    and every generate call takes the same path (the training forward is torch's own). Layers whose
    forward someone else replaced (Accelerate's offload hooks), other dtypes and devices are left as
    they are, and a call under autocast (mixed precision: Accelerate's bf16 casts) or with autograd is
    torch's own linear; without oneDNN in the build nothing changes."""
    op = (
        getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    )
    layers = [
        m
        for m in model.modules()
        if op is not None
        and type(m) is torch.nn.Linear
        and "forward" not in vars(m)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]

    def onednn(layer, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return torch.nn.functional.linear(x, layer.weight, layer.bias)
        return op(x, layer.weight, layer.bias, "none", [], "")

    for layer in layers:
        layer.forward = functools.partial(onednn, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _on(tensor: torch.Tensor, device: torch.device, model) -> torch.Tensor:
    """`tensor` on `device`; pixel values (floating point) in the model's dtype, as its vision tower wants."""
    if tensor.is_floating_point():
        return tensor.to(device, dtype=getattr(model, "dtype", tensor.dtype))
    return tensor.to(device)


def generation_kwargs(tokenizer, model, max_new_tokens: int) -> dict[str, Any]:
    """transformers `generate` arguments for greedy decoding up to max_new_tokens, stopping at the
    stop tokens."""
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


class SeededSampler(LogitsProcessor):
    """Sampling inside `generate` with one torch.Generator per sequence of the batch.

    transformers' own sampling draws every row from the global RNG, so a completion would depend on
    the other rows of its batch. Here the logits are tempered and filtered with transformers' own
    warpers, each row draws its token from its generator (`draw`), and every other token gets -inf:
    greedy decoding then picks exactly the drawn token. Rows that already stopped keep drawing (their draws
    are discarded), which changes nothing for the rows still running. With `record`, the drawn tokens'
    log-probs under the distribution they were drawn from (tempered and filtered) are kept in `logprobs`
    (one tensor per step).
    """

    def __init__(
        self,
        generators: list[torch.Generator],
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        record: bool = False,
    ):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = generators
        self.logprobs: list[torch.Tensor] | None = [] if record else None
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
        picked = draw(probs, self.generators)
        rows = torch.arange(len(picked), device=scores.device)
        if self.logprobs is not None:
            # from the probabilities at hand (a drawn token has p > 0), on device: no sync
            self.logprobs.append(torch.log(probs[rows, picked]))
        out = torch.full_like(scores, float("-inf"))
        out[rows, picked] = 0.0
        return out


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` (rows x vocabulary, each row summing to 1), row i drawn with
    `generators[i]` alone: exactly P(token) = probs[i, token], in two exponential races.

    Written here because torch.multinomial (the same race: argmax of p / E with E ~ Exp(1)) draws one
    exponential per vocabulary entry, and it takes a call per row for the rows to have generators of their
    own: at SmolLM2's 49152 entries that was 1 ms a row, a tenth of a CPU decode step of 16 rows
    (benchmarks/RESULTS.md). Here the vocabulary is cut into about sqrt(V) blocks of about sqrt(V) tokens:
    the race over the blocks' sums picks block b with probability S_b, the race inside it picks the token
    with probability p / S_b, so about 2 sqrt(V) draws a row (444 at 49152) and one vectorised pass over the
    probabilities for every row. Races, not a cumulative sum: a rounding difference in the logits (another
    matmul order) moves the outcome only where two candidates nearly tie, as it does for torch.multinomial,
    not wherever a running total crosses the draw. The uniforms are float64 (E = -log U), as torch's own
    exponentials are; a zero probability never wins."""
    rows, vocab = probs.shape
    width = math.isqrt(vocab - 1) + 1  # ceil(sqrt(V)): blocks of `width` tokens, the last one shorter
    full, blocks = vocab // width, -(-vocab // width)
    uniforms = torch.stack(
        [
            torch.rand(blocks + width, generator=g, dtype=torch.float64, device=probs.device)
            for g in generators
        ]
    )
    races = -torch.log(uniforms)
    sums = probs[:, : full * width].reshape(rows, full, width).sum(-1)  # a view: no copy of the rows
    if blocks > full:
        sums = torch.cat([sums, probs[:, full * width :].sum(-1, keepdim=True)], -1)
    block = (sums / races[:, :blocks]).argmax(-1)
    tokens = block[:, None] * width + torch.arange(width, device=probs.device)
    inside = probs.gather(1, tokens.clamp(max=vocab - 1)).masked_fill(tokens >= vocab, 0.0)
    return tokens.gather(1, (inside / races[:, blocks:]).argmax(-1, keepdim=True)).squeeze(1)


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
    synced_processes: bool = False,
    stop_patterns: Sequence[str] = (),
    sampling_logprobs: bool = False,
) -> list[list[Completion]]:
    """For each prompt (token ids, e.g. from `prompt_ids`), its `num_return_sequences` completions.

    temperature 0 is greedy (one distinct answer; `seeds` unused); above 0 each completion j of
    prompt k is sampled with the generator seeded `seeds[k][j]` (required). Prompts go in
    left-padded batches of `batch_size` prompts (longest first, so a batch holds prompts of similar
    length), each expanded to its completions; the model is in eval mode without autograd inside and
    given back in its mode. A vision-language model's prompts (ids with their image tokens expanded,
    `vlm_prompt_ids`) come with `images[k]`, prompt k's images (bytes or PIL images, in order), which
    its `processor` turns into the batch's pixels as training's collate does. `synced_processes`: every
    process calls this with as many prompts and runs each generate step together until all are done.
    `stop_patterns` (inline tool triggers): a row also stops, unfinished, where its text ends with a match
    (finetune.generation.pattern_stop). `sampling_logprobs` (sampling only): each completion carries the
    log-prob each of its tokens was drawn with (Completion.logprobs).
    """
    from tqdm.auto import tqdm

    sampling = temperature > 0
    if sampling and (seeds is None or any(len(s) != num_return_sequences for s in seeds)):
        raise ValueError("sampling needs one seed per completion: seeds[k] holds num_return_sequences seeds")
    order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))
    kwargs = generation_kwargs(tokenizer, model, max_new_tokens)
    if synced_processes:
        kwargs["synced_gpus"] = True
    if processor is not None:
        # A vision-language model never writes image markup: an <image> token in a completion would be one
        # more image token than the row has pixels for, when the rollout scores it (transformers' own
        # suppress_tokens, applied before the seeded sampler draws).
        from finetune.data.formats.encode import image_token_ids

        kwargs["suppress_tokens"] = sorted(image_token_ids(processor))
    stops = set(kwargs["eos_token_id"] or [])
    outputs: list[list[Completion]] = [[] for _ in prompts]
    batches = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    device = _device(model)
    with eval_mode(model), onednn_linears(model):
        for batch in tqdm(batches, desc="generating", unit="batch", disable=not progress):
            rows = [prompts[k] for k in batch for _ in range(num_return_sequences)]
            # Each prompt's KV cache computed once for its completions where nothing else differs per row
            # (a vision-language prompt's pixels go through generate's own first step).
            repeats = num_return_sequences if processor is None and not synced_processes else 1
            extra, sampler = {}, None
            if sampling:
                generators = [
                    torch.Generator(device=device).manual_seed(int(seed)) for k in batch for seed in seeds[k]
                ]
                sampler = SeededSampler(
                    generators, temperature=temperature, top_p=top_p, top_k=top_k, record=sampling_logprobs
                )
                extra["logits_processor"] = [sampler]
            pictures = None
            if processor is not None:
                pictures = [
                    pictures_of(images[k] if images else ())
                    for k in batch
                    for _ in range(num_return_sequences)
                ]
            if stop_patterns:  # inline tools: a row pauses where its text ends with a trigger's match
                extra["stopping_criteria"] = [pattern_stop(tokenizer, stop_patterns, rows, stops)]
            new_ids = generate_batch(
                model,
                rows[::repeats],
                {**kwargs, **extra},
                processor=processor,
                pictures=pictures,
                repeats=repeats,
            )
            paused = extra["stopping_criteria"][0].stopped_at if stop_patterns else {}
            drawn = torch.stack(sampler.logprobs, 1).cpu().tolist() if sampler and sampler.logprobs else None
            for r, row in enumerate(new_ids.tolist()):
                end = next((t for t, token in enumerate(row) if token in stops), None)
                length = len(row) if end is None else end + 1
                if r in paused:  # its trigger matched: cut there, not finished (the tool loop continues it)
                    length = paused[r]
                logprobs = drawn[r][:length] if drawn is not None else None
                completion = Completion(row[:length], end is not None and r not in paused, logprobs)
                outputs[batch[r // num_return_sequences]].append(completion)
    return outputs


def pattern_stop(tokenizer, patterns: Sequence[str], rows: list[list[int]], stops):
    """The stopping criterion of a batch of `rows` (left-padded to the longest) for inline tool triggers."""
    from finetune.generation.pattern_stop import PatternStop
    from finetune.generation.triggers import compile_triggers

    width = max(len(ids) for ids in rows)
    return PatternStop(tokenizer, compile_triggers(patterns), start=width, stops=stops)


def generate_batch(
    model, batch: list[list[int]], kwargs: dict[str, Any], *, processor=None, pictures=None, repeats: int = 1
) -> torch.Tensor:
    """The generated ids ((batch x repeats) x new tokens) of left-padded prompts, each row repeated `repeats`
    times in place (a prompt's completions); with a vision-language model's `processor`, `pictures` holds
    each row's PIL images (finetune.data.batching.vision.image_inputs).

    With repeats > 1 the prompts' KV cache is computed once per distinct prompt, then repeated for its
    completions and handed to `generate`, which runs only the prompts' last token and the new ones: the
    prompt's tokens go through the model once instead of once per completion. generate's positions for
    left-padded rows (transformers: the attention mask's running count) are the ones the cache was
    made with, so the completions are the ones of a full prefill (tested equal, greedy and sampled)."""
    width = max(len(ids) for ids in batch)
    pad = kwargs["pad_token_id"]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if processor is not None:
        from finetune.data.batching.vision import image_inputs

        inputs |= image_inputs(processor, pictures, input_ids)
    device = _device(model)
    inputs = {k: _on(v, device, model) for k, v in inputs.items()}
    if repeats > 1 and width > 1 and keeps_logits(model):
        inputs[CACHE_KWARG] = _prompt_cache(model, inputs["input_ids"], inputs["attention_mask"], repeats)
    if repeats > 1:
        inputs["input_ids"] = inputs["input_ids"].repeat_interleave(repeats, dim=0)
        inputs["attention_mask"] = inputs["attention_mask"].repeat_interleave(repeats, dim=0)
    out = model.generate(**inputs, **kwargs)
    return out[:, width:].cpu()


def _prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, repeats: int):
    """The KV cache of every prompt token but the last (left-padded rows, positions counted over the
    attention mask as generate counts them), each row's repeated `repeats` times in place."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    # The forward generate runs: PEFT's generate calls the transformers model under it (adapters
    # injected), not the PEFT model's forward (which Accelerate may have wrapped in autocast).
    out = base_model(model)(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=positions[:, :-1],
        use_cache=True,
        logits_to_keep=1,
    )
    # transformers >= 5.2x names it cache (reading past_key_values there warns)
    cache = out["cache"] if "cache" in out else out.past_key_values  # noqa: SIM401
    cache.batch_repeat_interleave(repeats)
    return cache


def stream_answer(
    model, tokenizer, inputs: Mapping[str, torch.Tensor], *, max_new_tokens: int = 512
) -> Iterator[str]:
    """Greedy answer to `inputs` (a batch of one: finetune.generation.prompts.chat_inputs), yielded in
    pieces of text as they are generated, for an interactive chat. Errors in generation are raised here."""
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = generation_kwargs(tokenizer, model, max_new_tokens)
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
