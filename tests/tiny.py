"""Tiny models and sequences shared by tests (built from configs: nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# The default tiny Llama: 2 layers, grouped-query attention (4 heads, 2 KV heads), ~80k parameters.
TINY_LLAMA = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def tiny_model(attn: str = "sdpa", *, dtype: torch.dtype = torch.float32, **config) -> torch.nn.Module:
    """A tiny random Llama, the same weights on every call (seed 0), from a config: nothing is downloaded.

    `config` overrides or adds LlamaConfig fields of TINY_LLAMA (vocab_size=, hidden_size=,
    tie_word_embeddings=, initializer_range=, token ids ...); `attn` and `dtype` go to from_config.
    """
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        LlamaConfig(**{**TINY_LLAMA, **config}), attn_implementation=attn, dtype=dtype
    )


def sequences() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for length, prompt in ((9, 3), (5, 2), (14, 6), (1, 0)):
        ids = torch.randint(4, 97, (length,), generator=g).tolist()
        labels = [-100] * prompt + ids[prompt:]
        labels[0] = -100  # the first token of a sequence is never predicted
        out.append({"input_ids": ids, "labels": labels})
    return out


def loss_test_model(attn: str = "sdpa") -> torch.nn.Module:
    """The tiny Llama the loss tests compare with TRL and with padded layouts: a 64-token vocabulary,
    hidden 32, and initializer_range 0.2 (larger than the default, so the logits are far from uniform
    and the log-ratios the losses see are not all near zero)."""
    return tiny_model(
        attn,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=256,
        initializer_range=0.2,
    )


def save_tiny_base(folder, tokenizer, **config) -> None:
    """A tiny random Llama (TINY_LLAMA with `config`, its vocabulary the tokenizer's) saved with the
    tokenizer: a pretrained base model folder, as `model.model_path` names one."""
    tiny_model(**{"vocab_size": len(tokenizer), **config}).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_tiny_lora_run(folder, tokenizer, *, base=None, config: dict | None = None, record: bool = True):
    """A folder as a LoRA run's train.output_dir holds it, for `finetune eval`, `chat` and `merge-lora`:
    the adapter (rank 2 on every linear layer, non-zero weights) and the tokenizer; its base is the
    pretrained folder `base`, else a random-init model built from `config` (LlamaConfig fields) saved
    in folder/base_model as training saves it; recipe.resolved.yaml's model section when `record`."""
    from pathlib import Path

    import yaml
    from peft import LoraConfig, get_peft_model

    folder = Path(folder)
    if base is None:
        base = folder / "base_model"
        save_tiny_base(base, tokenizer, **(config or {}))
    net = AutoModelForCausalLM.from_pretrained(Path(base).resolve())
    net = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.05)
    net.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if record:
        model = {"model_path": None, "config_path": {"model_type": "llama", **TINY_LLAMA, **(config or {})}}
        if base != folder / "base_model":
            model = {"model_path": str(base), "config_path": None}
        (folder / "recipe.resolved.yaml").write_text(yaml.safe_dump({"model": model}))
    return folder
