"""What export-gguf writes differently per architecture, beyond the Llama-family layout of
finetune.gguf.export: Gemma 2 and Gemma 3 (text), Phi-3 and Qwen3-MoE, as llama.cpp's
convert_hf_to_gguf.py writes them and its runtime reads them.

* **Gemma 2 / Gemma 3** (`gemma2`, `gemma3`): every RMSNorm weight is stored plus one (transformers'
  Gemma norms scale by `1 + weight`, llama.cpp's by `weight`; transformers' GGUF loader subtracts the
  one again), the head size as `attention.key_length`/`value_length`, the sliding window as
  `attention.sliding_window`, Gemma 2's attention and final logit soft-capping as
  `attn_logit_softcapping`/`final_logit_softcapping`. Gemma 3's rope base is its global layers'
  (`rope.freq_base_swa` the local ones'), its linear rope scaling likewise. The embeddings are
  tied (Gemma 2 has no `output` tensor in GGUF).
* **Phi-3** (`phi3`): the fused `qkv_proj` and `gate_up_proj` stay fused (`attn_qkv`, `ffn_up` of
  twice the feed-forward length, which llama.cpp splits), no Q/K permutation (its rope rotates halves
  as transformers' does), the rotary dimensions from `partial_rotary_factor`, the original context
  length, and LongRoPE as llama.cpp takes it: the `rope_factors_long`/`rope_factors_short` tensors
  and `rope.scaling.attn_factor`, computed by transformers' own rope function.
* **Qwen3-MoE** (`qwen3moe`): transformers' stacked experts (`experts.gate_up_proj`,
  `experts.down_proj`, one tensor per layer) become `ffn_gate_exps`, `ffn_up_exps` and
  `ffn_down_exps` (gate and up split apart), the router `ffn_gate_inp` stays F32 as llama.cpp's
  converter keeps it, and `expert_count`, `expert_used_count`, `expert_feed_forward_length` and the
  head size are written; q/k norms as Qwen3's.

Where llama.cpp would run the model differently from transformers (a pattern of sliding-window layers,
an attention scale or a router normalisation its graph fixes), the export says so with a warning.
Names and keys come from gguf's own tables (gguf.TensorNameMap, gguf.TENSOR_NAMES, the GGUFWriter's
add_* methods); only the value transforms above are written here, as llama.cpp's converter does them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from finetune.errors import FinetuneError
from finetune.notices import warn

if TYPE_CHECKING:
    import numpy as np


# transformers model_type -> GGUF architecture, for the architectures this module handles.
ARCHITECTURES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe"}


# Architectures whose llama.cpp graph applies config.sliding_window (the key is written, no warning).
SLIDING = ("gemma2", "gemma3", "phi3")


_GEMMA = ("gemma2", "gemma3")


_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def rope_parameters(config, arch: str) -> dict[str, Any]:
    """The rope parameters llama.cpp's `rope.*` keys describe: Gemma 3's global (full-attention) layers'
    where transformers keeps one set per layer type, else the config's own."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if arch == "gemma3" and "full_attention" in rope:
        return dict(rope["full_attention"])
    return rope


def rope_dimensions(config, arch: str, head_dim: int) -> int:
    """`rope.dimension_count`: Phi-3 rotates `partial_rotary_factor` of each head (Phi-4-mini 0.75)."""
    if arch == "phi3":
        factor = rope_parameters(config, arch).get("partial_rotary_factor")
        factor = factor or getattr(config, "partial_rotary_factor", None) or 1.0
        return int(factor * head_dim)
    return head_dim


def writes_head_dim(arch: str) -> bool:
    """Whether `attention.key_length`/`value_length` are written even when head_dim is hidden/heads:
    llama.cpp's converter writes them for these (and transformers' loader reads Gemma's and
    Qwen3-MoE's head size only from there)."""
    return arch in (*_GEMMA, "qwen3moe")


def add_hyperparameters(writer, config, arch: str) -> None:
    """The keys an architecture adds to the common ones (finetune.gguf.export), and warnings for what
    llama.cpp runs differently from transformers."""
    window = getattr(config, "sliding_window", None)
    if arch == "phi3":  # llama.cpp's converter writes 0 for none (how llama.cpp tells Phi-4 from Phi-3)
        writer.add_sliding_window(window or 0)
    elif arch in SLIDING and window is not None:
        writer.add_sliding_window(window)
    if arch in _GEMMA:
        _gemma(writer, config, arch)
    elif arch == "phi3":
        original = getattr(config, "original_max_position_embeddings", None)
        original = rope_parameters(config, arch).get("original_max_position_embeddings") or original
        writer.add_rope_scaling_orig_ctx_len(original or config.max_position_embeddings)
        if rope_parameters(config, arch).get("rope_type") == "longrope":
            writer.add_rope_scaling_attn_factors(_longrope(config)[1])
    elif arch == "qwen3moe":
        _qwen3moe(writer, config)


def _gemma(writer, config, arch: str) -> None:
    head_dim = config.head_dim
    if arch == "gemma2":
        for key, value in (
            ("attn_logit_softcapping", config.attn_logit_softcapping),
            ("final_logit_softcapping", config.final_logit_softcapping),
        ):
            if value is not None:
                getattr(writer, f"add_{key}")(value)
            else:  # llama.cpp reads a missing key as Gemma 2's own cap (50, 30)
                warn(
                    f"export-gguf: {key} is off, but llama.cpp's gemma2 then applies its default cap: its "
                    "outputs may differ from transformers'"
                )
    else:
        if getattr(config, "final_logit_softcapping", None) is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        # llama.cpp's converter refuses attention soft-capping for Gemma 3 too.
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise FinetuneError(
                "export-gguf: this Gemma 3 model soft-caps attention logits (attn_logit_softcapping "
                f"{config.attn_logit_softcapping}), which llama.cpp's gemma3 architecture does not do; set it to "
                "null in config.json only if the model was trained without it"
            )
        # The local (sliding-window) layers' rope base, as llama.cpp's converter writes it.
        local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
        if "rope_theta" in local:
            writer.add_rope_freq_base_swa(local["rope_theta"])
    # llama.cpp's graph scales queries by 1/sqrt(head size), or 1/sqrt(hidden / heads) for the 27B
    # models (whose query_pre_attn_scalar is that); it reads no key for it.
    scalar = getattr(config, "query_pre_attn_scalar", head_dim)
    if scalar not in (head_dim, config.hidden_size // config.num_attention_heads):
        warn(
            f"export-gguf: query_pre_attn_scalar is {scalar}, neither the head size {head_dim} nor hidden size "
            f"/ heads; llama.cpp's {arch} scales attention by one of those, so its outputs will differ"
        )
    layers = getattr(config, "layer_types", None)
    every = 2 if arch == "gemma2" else 6  # llama.cpp's fixed patterns: gemma2 alternates, gemma3 5:1
    expected = [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(config.num_hidden_layers)
    ]
    if layers is not None and list(layers) != expected:
        warn(
            f"export-gguf: the model's sliding-window layers ({', '.join(layers)}) are not llama.cpp's fixed "
            f"{arch} pattern; llama.cpp will attend differently in some layers past the window"
        )


def _qwen3moe(writer, config) -> None:
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense += [i for i in range(config.num_hidden_layers) if (i + 1) % step and i not in dense]
    if dense:
        raise FinetuneError(
            f"export-gguf: layers {sorted(dense)} of this Qwen3-MoE model are dense (mlp_only_layers, "
            "decoder_sparse_step), which llama.cpp's qwen3moe architecture does not have: every layer "
            "must be a mixture of experts"
        )
    if not getattr(config, "norm_topk_prob", True):
        warn(
            "export-gguf: norm_topk_prob is False, but llama.cpp's qwen3moe always renormalises the chosen "
            "experts' weights: its outputs will differ from transformers'"
        )


def _longrope(config):
    """(inverse frequencies, attention factor) of LongRoPE, from transformers' own rope function."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))


def extra_tensors(config, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors llama.cpp reads that are no weight of the model: Phi-3's LongRoPE factors (F32)."""
    import gguf
    import numpy as np

    rope = rope_parameters(config, arch)
    if arch != "phi3" or rope.get("rope_type") != "longrope":
        return
    # transformers' config checks that each list has one factor per rotary frequency.
    for kind, tensor in (
        ("long", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
        ("short", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT),
    ):
        factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
        yield gguf.TENSOR_NAMES[tensor] + ".weight", factors


def tensors(hf_name: str, data: np.ndarray, arch: str, names) -> Iterator[tuple[str, np.ndarray, bool]]:
    """(GGUF name, data, keep in F32) for one of the model's tensors: its name from gguf's TensorNameMap
    (`names`) and the value transforms llama.cpp's converter applies for `arch`. None for the name
    where the map has none (the caller says so)."""
    import gguf

    experts = _EXPERTS.fullmatch(hf_name) if arch == "qwen3moe" else None
    if experts:
        # transformers stacks each layer's experts: gate_up_proj [experts, 2 * ffn, hidden] (gate rows
        # first, as its GGUF loader puts them back), down_proj [experts, hidden, ffn]. llama.cpp keeps
        # gate, up and down apart, each stacked over the experts.
        bid, which = int(experts[1]), experts[2]
        kinds = gguf.MODEL_TENSOR
        if which == "down_proj":
            yield gguf.TENSOR_NAMES[kinds.FFN_DOWN_EXP].format(bid=bid) + ".weight", data, False
            return
        half = data.shape[1] // 2
        yield gguf.TENSOR_NAMES[kinds.FFN_GATE_EXP].format(bid=bid) + ".weight", data[:, :half], False
        yield gguf.TENSOR_NAMES[kinds.FFN_UP_EXP].format(bid=bid) + ".weight", data[:, half:], False
        return
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if arch in _GEMMA and hf_name.endswith("norm.weight"):
        data = data + 1  # transformers' Gemma RMSNorm multiplies by (1 + weight), llama.cpp's by weight
    # The router llama.cpp's converter keeps in F32 (top-k choices are sensitive to its rounding).
    router = name is not None and arch == "qwen3moe" and ".ffn_gate_inp." in name
    yield name, data, router
