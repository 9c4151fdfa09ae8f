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


def tiny_gguf(path, *, metadata: dict[str, str] | None = None, seed: int = 0):
    """Write a tiny Llama GGUF file at `path` (F32 weights, ~240 KB) with the demo's BPE tokenizer and
    ChatML template, as llama.cpp's converter lays one out; `metadata` adds string keys
    (general.source.url ...). Returns `path`. Needs the gguf package."""
    import json
    from pathlib import Path

    import gguf
    import numpy as np

    tokenizer_dir = Path(__file__).resolve().parents[1] / "recipes" / "demo" / "tokenizer"
    model = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    # transformers' GGUF tokenizer adds <|endoftext|> when the file lacks it: ship it, so the tokenizer's
    # length is the embeddings' rows.
    tokens.append("<|endoftext|>")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    vocab, hidden, inner, heads, kv_heads = len(tokens), 32, 64, 4, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(inner)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 1) + [3])
    writer.add_token_merges(merges)
    for add, token_id in (
        (writer.add_unk_token_id, 0),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
    ):
        add(token_id)
    writer.add_pad_token_id(3)
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)
    rng = np.random.default_rng(seed)
    kv = kv_heads * hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    shapes |= {"blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv, hidden)}
    shapes |= {"blk.0.attn_v.weight": (kv, hidden), "blk.0.attn_output.weight": (hidden, hidden)}
    shapes |= {"blk.0.ffn_gate.weight": (inner, hidden), "blk.0.ffn_up.weight": (inner, hidden)}
    shapes |= {"blk.0.ffn_down.weight": (hidden, inner)}
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
