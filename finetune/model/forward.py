"""What a loaded model's forward takes, read under its wrappers (DDP, DeepSpeed, PEFT): the attention
backend it was built with and whether it projects only some positions on the vocabulary
(transformers' `logits_to_keep`). The rollout's packing (finetune.objectives.rollout) and the
transformers generation backend decide their layouts from these."""

from __future__ import annotations

import functools
import inspect


def base_model(model):
    """The transformers model under DDP's or DeepSpeed's wrapper (`module`) and PEFT's."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def attention_implementation(model) -> str | None:
    """The attention backend the model runs ("sdpa", "eager", "flash_attention_2", ...), None if unknown."""
    config = getattr(base_model(model), "config", None) if model is not None else None
    return getattr(config, "_attn_implementation", None)


def keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do). Read once per
    model class: the rollout asks for every micro-batch and every generate call."""
    return model is not None and _class_keeps_logits(type(base_model(model)))


@functools.cache
def _class_keeps_logits(cls: type) -> bool:
    forward_fn = getattr(cls, "forward", None)
    try:
        return forward_fn is not None and "logits_to_keep" in inspect.signature(forward_fn).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented forward: no signature to read
        return False
