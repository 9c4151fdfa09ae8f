"""Long context: the recipe's model.rope_scaling and model.max_position_embeddings written into the model
config (`apply_context_settings`), and the warning when the rows are longer than the model's trained
context with no scaling (`context_warning`)."""

from __future__ import annotations

import math
from typing import Any

from finetune.errors import FinetuneError

# Rope parameters that belong to the model, not to a scaling: kept when model.rope_scaling replaces one.
_MODEL_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def trained_context(config) -> int | None:
    """The context the model was trained on: a scaled model's original_max_position_embeddings, else its
    max_position_embeddings (None when the config has neither)."""
    text = config.get_text_config()
    params = getattr(text, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    return original or getattr(text, "max_position_embeddings", None)


def apply_context_settings(config, model) -> Any:
    """`config` (a transformers config, changed in place and returned) with the recipe's
    model.rope_scaling (the model's rope_theta kept; original_max_position_embeddings defaults to the
    trained context) and model.max_position_embeddings. transformers validates the rope keys; a bad one
    is an error naming model.rope_scaling."""
    scaling, positions = getattr(model, "rope_scaling", None), getattr(model, "max_position_embeddings", None)
    if scaling is None and positions is None:
        return config
    text = config.get_text_config()
    trained = trained_context(config)
    if scaling is not None:
        current = getattr(text, "rope_parameters", None) or {}
        kept = (
            {k: v for k, v in current.items() if k in _MODEL_ROPE_KEYS} if isinstance(current, dict) else {}
        )
        if "rope_theta" not in kept and getattr(text, "rope_theta", None) is not None:
            kept["rope_theta"] = text.rope_theta
        params = {**kept, **{k: v for k, v in scaling.items() if k != "type"}}
        params.setdefault("rope_type", scaling.get("type"))
        if params["rope_type"] in ("yarn", "llama3") and trained is not None:
            params.setdefault("original_max_position_embeddings", trained)
        text.rope_parameters = params
        try:
            text.validate_rope()
        except (KeyError, ValueError, TypeError) as exc:
            raise FinetuneError(
                f"model.rope_scaling {scaling}: transformers refuses it for {text.model_type} ({exc}); see "
                "the keys each rope_type takes in transformers' modeling_rope_utils"
            ) from None
    if positions is not None:
        text.max_position_embeddings = positions
    return config


def context_warning(config, model, sequence_len: int) -> str | None:
    """A warning when rows of `sequence_len` tokens reach positions the model was not trained on and
    model.rope_scaling does not stretch it that far (None when they fit)."""
    trained = trained_context(config)
    if trained is None or sequence_len <= trained:
        return None
    scaling = getattr(model, "rope_scaling", None)
    factor = float(scaling.get("factor", 1.0)) if scaling else 1.0
    if sequence_len <= trained * factor:
        return None
    needed = math.ceil(sequence_len / trained)
    if scaling:
        return (
            f"data.sequence_len {sequence_len} is longer than model.rope_scaling stretches the trained context "
            f"({trained} positions x factor {factor:g}); raise its factor to {needed} or more"
        )
    return (
        f"data.sequence_len {sequence_len} is longer than the model's trained context ({trained} positions) "
        "and model.rope_scaling is not set: positions past it were never trained; set it, e.g. "
        f"--model.rope_scaling '{{rope_type: yarn, factor: {needed}}}' with --model.max_position_embeddings "
        f"{sequence_len}"
    )
