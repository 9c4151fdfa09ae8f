"""The generation backends by name, and greedy answers to prompts through any of them.

`BACKENDS` is the one table of backends (the recipe's `grpo.generation_backend` names one); each
entry imports its module on use, so choosing one never imports another's engine. A backend
implements finetune.generation.protocol.GenerationBackend; docs/CONTRIBUTING.md ("Add a generation
backend") walks through adding one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from finetune.errors import FinetuneError
from finetune.generation.prompts import Prompt, decode_completion, encode_prompts
from finetune.generation.protocol import GenerationBackend, SamplingParams


def _transformers():
    from finetune.generation.transformers_backend import TransformersBackend

    return TransformersBackend


def _vllm():
    from finetune.generation.vllm_backend import VLLMBackend

    return VLLMBackend


BACKENDS: dict[str, Callable[[], Any]] = {
    "transformers": _transformers,
    "vllm": _vllm,
}


def backend_for(name: str, model, tokenizer, *, processor=None, **options: Any) -> GenerationBackend:
    """The backend `name` generating with `model`'s weights (the training model, unwrapped from DDP),
    its `tokenizer`, and a vision-language model's `processor`; `options` are the backend's own
    settings (vLLM's memory share and context length: the recipe section's `backend_options`)."""
    if name not in BACKENDS:
        raise FinetuneError(f"generation backend {name!r} is not one of: {', '.join(BACKENDS)}")
    return BACKENDS[name]()(model, tokenizer, processor=processor, **options)


def answers(
    backend: GenerationBackend,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    use_chat_template: bool = True,
    progress: bool = True,
    images: Sequence[Sequence[Any]] | None = None,
) -> list[str]:
    """Greedy answers to `prompts`, in order, stopping at eos / end of turn or after max_new_tokens;
    only the new tokens are decoded, special tokens removed. With a vision-language model's backend
    (it has a processor), prompt k's images are `images[k]` (bytes or PIL images, one per
    ``finetune.data.formats.images.SENTINEL`` in its text)."""
    encoded = encode_prompts(
        backend.tokenizer,
        prompts,
        use_chat_template=use_chat_template,
        processor=backend.processor,
        images=images,
    )
    completions = backend.generate(
        encoded,
        SamplingParams(max_new_tokens=max_new_tokens),
        batch_size=batch_size,
        images=images,
        progress=progress,
    )
    return [decode_completion(backend.tokenizer, c[0].ids, stops=backend.stops) for c in completions]
