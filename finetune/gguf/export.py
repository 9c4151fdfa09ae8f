"""`finetune export-gguf`: a trained model as one GGUF file for llama.cpp, Ollama and LM Studio.

What training wrote (an adapter, merged into its base first; a fully fine-tuned model; a merged
folder) is loaded in its saved dtype (finetune.model.inference.export_gguf: loading is the model's
job, and this package stays in the bottom layer), and `write_gguf` writes it with the `gguf` package's
GGUFWriter the way llama.cpp's own converter (convert_hf_to_gguf.py) lays out a Llama-family model:

* tensors renamed by gguf's TensorNameMap for the architecture; `output.weight` left out when the
  embeddings are tied (llama.cpp then reuses `token_embd.weight`, and transformers reads the absence as
  `tie_word_embeddings`); the llama architecture's Q and K rows permuted as llama.cpp's rotary
  embedding expects them (transformers permutes them back when it loads the file);
* 1-D tensors (norms, biases) in F32, matrices in the outtype (F16, BF16, or Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1 through gguf.quants.quantize; a matrix whose rows are not a multiple of the type's
  32-value block stays F16, as llama.cpp's converter does for Q8_0, and the export says how many did);
  the k-quants (Q4_K_M, Q5_K_M, Q6_K) are refused with the list of what is written: the gguf package
  only reads them, and llama.cpp's quantizer ships on PyPI only as a source build (llama-cpp-python);
* the hyperparameters llama.cpp reads (`<arch>.context_length`, `embedding_length`, `block_count`,
  `feed_forward_length`, `attention.head_count(_kv)`, `attention.layer_norm_rms_epsilon`,
  `rope.freq_base`, `rope.dimension_count`, rope scaling where set, `vocab_size`, `general.file_type`);
* the tokenizer: every token by id (rows the embeddings have beyond the tokenizer as `[PADn]`
  unused tokens), token types (control for special tokens, user-defined for other added tokens,
  byte tokens), the merges of a byte-level BPE vocabulary (`gpt2`) or merge-rank scores of a
  SentencePiece-style one (`llama`), the pre-tokenizer's name, and through gguf's SpecialVocab the
  bos/eos/unk/pad ids, add_bos/add_eos and the chat template.

Mistral is written as `llama` (llama.cpp has no separate Mistral architecture); Qwen2/2.5 as `qwen2`,
Qwen3 as `qwen3`; Gemma 2 as `gemma2`, Gemma 3 (text) as `gemma3`, Phi-3 as `phi3` and Qwen3-MoE as
`qwen3moe`, with what llama.cpp's converter does differently for those in finetune.gguf.arch (Gemma's
norms plus one, soft-capping and sliding-window keys; Phi-3's fused projections and LongRoPE factors;
Qwen3-MoE's experts split and stacked). The file is written to a temporary name beside the target and
renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import FinetuneError, write_error, write_failure_reason
from finetune.gguf import arch as per_arch
from finetune.notices import warn

if TYPE_CHECKING:
    import numpy as np


# transformers model_type -> the GGUF architecture llama.cpp runs it as.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    **per_arch.ARCHITECTURES,
}


# --outtype values the export writes: the matrices' GGML type (gguf.GGMLQuantizationType[name.upper()]).
# The quantized ones are those the gguf package quantizes in Python (gguf.quants: a quantize_blocks).
OUTTYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


# k-quants as Unsloth and llama.cpp's llama-quantize spell them. gguf.quants (0.19) has no quantizer for
# Q4_K/Q5_K/Q6_K (it only dequantizes them), so they are refused with what is written and how to make
# one from an f16 export; the _m/_s mixes (Q6_K/Q5_K for some tensors) are llama-quantize's own.
# tests/unit/gguf/test_gguf_export.py checks that gguf still cannot write them.
K_QUANTS = ("q4_k", "q4_k_s", "q4_k_m", "q5_k", "q5_k_s", "q5_k_m", "q6_k")


def check_outtype(outtype: str) -> None:
    """Refuse an outtype the export does not write, saying what it writes (and for a k-quant, why not).

    >>> check_outtype("q5_1")
    """
    if outtype in OUTTYPES:
        return
    from importlib.metadata import version

    written = ", ".join(OUTTYPES)
    if outtype in K_QUANTS:
        raise FinetuneError(
            f"export-gguf: --outtype {outtype!r} is a k-quant, which the installed gguf package "
            f"({version('gguf')}) reads but cannot write (it has no quantizer for Q4_K, Q5_K, Q6_K), and "
            "llama.cpp's quantizer is not a package dependency (llama-cpp-python on PyPI is a source "
            "build, not a wheel). Written here: "
            f"{written}. For {outtype.upper()}, export f16 and run llama.cpp's "
            f"`llama-quantize RUN-f16.gguf RUN-{outtype}.gguf {outtype.upper()}`"
        )
    raise FinetuneError(f"export-gguf: --outtype {outtype!r} is not one of {written}")


# llama.cpp's rope scaling types the export writes (transformers' rope_type -> GGUF's).
ROPE_SCALING = ("linear", "yarn", "llama3")


def gguf_architecture(model_type: str) -> str:
    """The GGUF architecture a transformers model type is exported as; an error lists the supported ones.

    >>> gguf_architecture("mistral"), gguf_architecture("qwen2")
    ('llama', 'qwen2')
    """
    if model_type not in ARCHITECTURES:
        supported = ", ".join(f"{name} (as {arch})" for name, arch in ARCHITECTURES.items())
        raise FinetuneError(
            f"export-gguf: model type {model_type!r} is not supported; supported: {supported}. Export "
            "another architecture with llama.cpp's convert_hf_to_gguf.py on a merged model folder "
            "(finetune merge-lora)"
        )
    return ARCHITECTURES[model_type]


def default_output(output_dir: str | Path, outtype: str) -> Path:
    """Where the file goes without --output: inside OUTPUT_DIR, named after it and the outtype.

    >>> default_output("runs/tiny-sft", "q8_0").as_posix()
    'runs/tiny-sft/tiny-sft-q8_0.gguf'
    """
    folder = Path(output_dir)
    return folder / f"{folder.resolve().name}-{outtype}.gguf"


def write_gguf(net, tokenizer, path: Path, *, outtype: str, name: str) -> dict[str, int]:
    """Write `net` (a transformers causal LM of a supported architecture, dense weights) with
    `tokenizer` as a GGUF file at `path`, atomically; returns how many tensors went out per GGML type."""
    import gguf

    arch = gguf_architecture(net.config.model_type)
    check_outtype(outtype)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        writer = gguf.GGUFWriter(str(tmp), arch)
        _add_hyperparameters(writer, net.config, name, outtype)
        _add_tokenizer(writer, tokenizer, net)
        counts = _add_tensors(writer, net, arch, outtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        # mkstemp made it 0600; the file gets the modes a plain open gives (0644 under umask 022)
        umask = os.umask(0)  # reading the umask means setting it: put it straight back
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if write_failure_reason(exc) is None:
            raise
        raise write_error(
            exc,
            f"writing the GGUF file {path}",
            path.parent,
            "Nothing was kept; free space or pass --output FILE elsewhere",
        ) from None
    return counts


# -------------------------------------------------------------------------------- hyperparameters


def _add_hyperparameters(writer, config, name: str, outtype: str) -> None:
    import gguf

    kind = ARCHITECTURES[config.model_type]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(per_arch.rope_dimensions(config, kind, head_dim))
    # llama.cpp assumes hidden/heads unless told
    if head_dim != config.hidden_size // heads or per_arch.writes_head_dim(kind):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{outtype.upper()}"])
    if outtype not in ("f16", "bf16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rope = per_arch.rope_parameters(config, kind)
    if "rope_theta" in rope:
        writer.add_rope_freq_base(rope["rope_theta"])
    _add_rope_scaling(writer, rope, config, kind)
    per_arch.add_hyperparameters(writer, config, kind)
    window = getattr(config, "sliding_window", None)
    if (
        kind not in per_arch.SLIDING
        and window is not None
        and getattr(config, "use_sliding_window", True)
        and window < config.max_position_embeddings
    ):
        warn(
            f"the model attends within a sliding window of {window} tokens, which llama.cpp's "
            f"{ARCHITECTURES[config.model_type]} architecture does not apply: its outputs differ from "
            f"transformers' past {window} tokens of context; keep prompts shorter, or run it with transformers"
        )


def _add_rope_scaling(writer, rope: dict[str, Any], config, architecture: str) -> None:
    """Rope scaling as llama.cpp reads it: linear and yarn as keys; llama3 as the `rope_freqs` tensor
    of per-dimension frequency factors, added with the weights (`_rope_freqs`); Phi-3's LongRoPE as
    its factor tensors and attention factor (finetune.gguf.arch)."""
    import gguf

    kind = rope.get("rope_type", "default")
    if kind == "default" or (kind == "longrope" and architecture == "phi3"):
        return
    if kind not in ROPE_SCALING:
        raise FinetuneError(
            f"export-gguf: rope scaling {kind!r} (config.rope_parameters) is not exported; supported: "
            f"none, {', '.join(ROPE_SCALING)} (and longrope for Phi-3)"
        )
    if kind == "llama3":
        return
    writer.add_rope_scaling_type(
        gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN
    )
    writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)


def _rope_freqs(config) -> np.ndarray | None:
    """llama3 rope scaling as llama.cpp takes it: the factor each rotary frequency is divided by,
    computed from transformers' own rope functions (default frequencies over the llama3 ones)."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    base = rope["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    default = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return (default / scaled.float()).numpy()


# ---------------------------------------------------------------------------------------- tensors


def _add_tensors(writer, net, arch: str, outtype: str) -> dict[str, int]:
    """Every weight under its GGUF name, in its GGML type; returns the count per type."""
    import gguf

    config = net.config
    names = gguf.get_tensor_name_map(_arch_enum(arch), config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    counts: dict[str, int] = {}
    fallback = []
    for hf_name, tensor in net.state_dict().items():
        if tied and hf_name == "lm_head.weight":  # llama.cpp reuses token_embd.weight, as its converter
            continue
        data = tensor.detach().float().cpu().numpy()
        if arch == "llama" and hf_name.endswith(_ROTATED):
            kv = ".k_proj." in hf_name
            heads = config.num_attention_heads
            data = permute_for_llama_cpp(data, (config.num_key_value_heads or heads) if kv else heads)
        for gguf_name, part, keep_f32 in per_arch.tensors(hf_name, data, arch, names):
            if gguf_name is None:
                raise FinetuneError(
                    f"export-gguf: the model's tensor {hf_name!r} has no name in GGUF's {arch} architecture "
                    "(a layer that architecture does not have): this model cannot be exported as it is"
                )
            qtype = gguf.GGMLQuantizationType.F32 if keep_f32 else _tensor_type(part, outtype)
            if part.ndim > 1 and not keep_f32 and qtype.name != outtype.upper():
                fallback.append(gguf_name)
            writer.add_tensor(gguf_name, gguf.quants.quantize(part, qtype), raw_dtype=qtype)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
    extra = list(per_arch.extra_tensors(config, arch))
    if (freqs := _rope_freqs(config)) is not None:
        extra.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", freqs.astype("float32")))
    for gguf_name, data in extra:
        writer.add_tensor(gguf_name, data)
        counts["F32"] = counts.get("F32", 0) + 1
    if fallback:
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[outtype.upper()]][0]
        warn(
            f"{len(fallback)} matrices have rows that are not a multiple of {outtype.upper()}'s {block}-value "
            f"block and were written as F16 instead (e.g. {fallback[0]}); as llama.cpp's converter does"
        )
    return counts


# The rows llama.cpp's llama architecture rotates in pairs (biases too, where a model has them).
_ROTATED = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


def _arch_enum(arch: str):
    import gguf

    return next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)


def _tensor_type(data: np.ndarray, outtype: str):
    """The GGML type a tensor is written in: 1-D ones (norms, biases) in F32, as llama.cpp's converter
    keeps them; matrices in the outtype, a quantized one only where each row is whole blocks (F16
    otherwise)."""
    import gguf

    types = gguf.GGMLQuantizationType
    if data.ndim <= 1:
        return types.F32
    qtype = types[outtype.upper()]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if data.shape[-1] % block == 0 else types.F16


def permute_for_llama_cpp(weights: np.ndarray, heads: int) -> np.ndarray:
    """Q or K projection rows reordered for llama.cpp's llama architecture: transformers' rotary
    embedding rotates the two halves of each head (rotate_half), llama.cpp's rotates adjacent pairs, so
    each head's rows go from [first half, second half] to interleaved pairs. Written by hand: gguf has
    no such helper (transformers' GGUF loader holds the inverse, `_reverse_permute_weights`).

    >>> import numpy as np
    >>> permute_for_llama_cpp(np.arange(4).reshape(4, 1), 1).ravel().tolist()
    [0, 2, 1, 3]
    """
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# -------------------------------------------------------------------------------------- tokenizer


def _add_tokenizer(writer, tokenizer, net) -> None:
    """The vocabulary, its types and scores or merges, the pre-tokenizer, and (through gguf's
    SpecialVocab, reading the tokenizer as transformers saves it) special ids, add_bos/add_eos and
    the chat template."""
    import gguf

    rows = net.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise FinetuneError(
            f"export-gguf: the tokenizer has {len(tokenizer)} tokens but the model's embeddings only "
            f"{rows} rows; the saved tokenizer is not this model's"
        )
    with tempfile.TemporaryDirectory(prefix="finetune-gguf-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        net.config.save_pretrained(folder)
        if not (Path(folder) / "tokenizer.json").is_file():  # a Python-only tokenizer: nothing to read
            raise FinetuneError(
                f"export-gguf: the tokenizer ({type(tokenizer).__name__}) saves no tokenizer.json; export "
                "needs a tokenizers-backed (fast) tokenizer saved with the model"
            )
        spec = json.loads((Path(folder) / "tokenizer.json").read_text())
        kind = tokenizer_model(spec)
        tokens, types = vocabulary(tokenizer, rows, kind)
        writer.add_tokenizer_model(kind)
        writer.add_tokenizer_pre(pre_tokenizer_name(spec) if kind == "gpt2" else "default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        if kind == "llama":
            writer.add_token_scores(merge_scores(tokens, spec["model"].get("merges") or []))
            writer.add_add_space_prefix(adds_space_prefix(spec))
        # SpecialVocab logs a warning for each template shape it only half reads (a pair template's
        # separator, which a causal LM never uses): quiet, the values it sets are checked on load back.
        vocab_logger = logging.getLogger("gguf.vocab")
        level = vocab_logger.level
        vocab_logger.setLevel(logging.ERROR)
        try:
            special = gguf.SpecialVocab(folder, load_merges=kind == "gpt2", n_vocab=len(tokens))
        finally:
            vocab_logger.setLevel(level)
        special.add_special_token.update(added_specials(tokenizer))
        special.add_to_gguf(writer, quiet=True)
    if kind == "gpt2" and not special.merges:
        raise FinetuneError("export-gguf: the byte-level BPE tokenizer has no merges; llama.cpp needs them")


def added_specials(tokenizer) -> dict[str, bool]:
    """Whether the tokenizer puts its bos / eos token around a text, as it does it (its post-processor),
    not as its config says: a file without the flag gets BOS from llama.cpp and transformers alike."""
    ids = tokenizer("a").input_ids
    return {
        "bos": tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id],
        "eos": tokenizer.eos_token_id is not None and len(ids) > 1 and ids[-1] == tokenizer.eos_token_id,
    }


def tokenizer_model(spec: dict[str, Any]) -> str:
    """llama.cpp's name for a tokenizer.json's model: `gpt2` for byte-level BPE (GPT-2, Llama 3, Qwen,
    SmolLM), `llama` for SentencePiece-style BPE with byte fallback (Llama 2, Mistral).

    >>> tokenizer_model({"model": {"type": "BPE", "byte_fallback": True}, "decoder": {"type": "Sequence"}})
    'llama'
    """
    model = spec.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return "llama"
    if model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        return "gpt2"
    raise FinetuneError(
        f"export-gguf: the tokenizer is a {model.get('type')} model (decoder "
        f"{(spec.get('decoder') or {}).get('type')}); exported are byte-level BPE tokenizers (GPT-2, "
        "Llama 3, Qwen, SmolLM) and SentencePiece-style BPE with byte fallback (Llama 2, Mistral)"
    )


def vocabulary(tokenizer, rows: int, kind: str) -> tuple[list[str], list[int]]:
    """(token text, GGUF token type) for every embedding row: control for special added tokens,
    user-defined for other added tokens, byte for SentencePiece's <0xNN>, unknown for the unk token,
    and `[PADn]` unused tokens for rows no token has (embeddings padded past the vocabulary)."""
    import re

    import gguf

    kinds = gguf.TokenType
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(rows):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(kinds.UNUSED)
        elif index in added:
            tokens.append(token)
            types.append(kinds.CONTROL if added[index].special else kinds.USER_DEFINED)
        else:
            tokens.append(token)
            byte = kind == "llama" and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token)
            types.append(kinds.BYTE if byte else kinds.NORMAL)
        if index == tokenizer.unk_token_id and kind == "llama":
            types[-1] = kinds.UNKNOWN
    return tokens, [int(t) for t in types]


def adds_space_prefix(spec: dict[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts "▁" before the text (llama.cpp's
    `add_space_prefix`, which it assumes when the key is missing): a Metaspace pre-tokenizer that
    prepends, or a normalizer that does (older Llama tokenizer.json files).

    >>> adds_space_prefix({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "never"}})
    False
    """
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if any(p.get("type") == "Metaspace" for p in parts):
        return any(
            p.get("prepend_scheme", "always") != "never" for p in parts if p.get("type") == "Metaspace"
        )
    norm = spec.get("normalizer") or {}
    steps = norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
    return any(step.get("type") == "Prepend" for step in steps)


def merge_scores(tokens: list[str], merges: list) -> list[float]:
    """SentencePiece scores for a BPE vocabulary given as merges: llama.cpp's `llama` tokenizer merges
    the pair whose result scores highest, so a token made by merge rank r scores -r (the first merge
    ranks highest) and a token no merge makes scores below all of them. The inverse of how transformers
    turns SentencePiece scores into merges (and rebuilds them from these scores on load).

    >>> merge_scores(["a", "b", "ab", "abb"], [["a", "b"], ["ab", "b"]])
    [-2.0, -2.0, 0.0, -1.0]
    """
    rank: dict[str, int] = {}
    for index, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, index)
    return [float(-rank.get(token, len(merges))) for token in tokens]


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for how a byte-level BPE tokenizer splits text before
    merging, read from its tokenizer.json: `gpt-2` (GPT-2's regex), `smollm` (digits one by one, then
    GPT-2's), or the name transformers' GGUF loader gives the split regex (Llama 3's `llama-bpe`,
    Qwen's `qwen2` ...). Another splitter is written `default` with a warning: llama.cpp would split
    some text differently.

    >>> pre_tokenizer_name({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}})
    'gpt-2'
    """
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    shape = [p.get("type") for p in parts]
    if shape == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if shape == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex"):
        return "smollm"
    if shape == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = (parts[0].get("pattern") or {}).get("Regex")
        if regex in _split_names():
            return _split_names()[regex]
    warn(
        f"export-gguf: the tokenizer's pre-tokenizer ({' + '.join(map(str, shape)) or 'none'}) has no name in "
        "llama.cpp; written as 'default', so llama.cpp may split some text differently from transformers"
    )
    return "default"


# Where transformers' table gives one regex several names, the one llama.cpp's converter writes.
_PREFERRED_SPLIT_NAMES = ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35")


def _split_names() -> dict[str, str]:
    """Split regex -> llama.cpp pre-tokenizer name, from transformers' GGUF tokenizer table."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    names: dict[str, str] = {}
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        if regex not in names or name in _PREFERRED_SPLIT_NAMES:
            names[regex] = name
    return names
