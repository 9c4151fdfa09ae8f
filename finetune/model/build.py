"""The model and tokenizer a run trains: config, tokenizer, weight dtype, attention backend check, the
model built (pretrained, 4-bit for QLoRA, or random-init from a config) and its parameter counts.

Functions here take the typed recipe sections (ModelSection, LoraSection), never the whole Recipe.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

import torch

from finetune.errors import FinetuneError, write_error, write_failure_reason
from finetune.gguf.convert import resolve_model_source
from finetune.gguf.names import portable_base
from finetune.model import vlm
from finetune.quiet import quiet_third_party
from finetune.recipe import LoraSection, ModelSection

logger = logging.getLogger(__name__)

# Library users who import finetune.model's modules directly get the same quiet output as the entry points.
quiet_third_party(torch.cuda.is_available())


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_tokenizer(model: ModelSection):
    """The tokenizer at model.tokenizer_source, with the recipe's chat template and special tokens.

    A GGUF model's tokenizer comes from its converted folder (see finetune.gguf).
    """
    from transformers import AutoTokenizer

    if model.kind == "vlm":
        return vlm.load_processor(model).tokenizer
    model = resolve_model_source(model)
    source = model.tokenizer_source
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"model.tokenizer_path: could not load a tokenizer from {source!r}: {exc}. "
            "Point tokenizer_path at a folder with tokenizer files or a Hub id."
        ) from None
    return vlm.with_recipe_tokens(tokenizer, model)


def pad_token_id(tokenizer) -> int:
    """The id used to pad batches. Padded positions carry label -100 and their own attention segment,
    so any id is correct; we prefer pad, then eos."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def _load_config(model: ModelSection):
    from transformers import AutoConfig

    model = resolve_model_source(model)
    source = model.config_source
    if isinstance(source, dict):
        cfg = dict(source)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    try:
        return AutoConfig.from_pretrained(
            source, revision=model.revision, trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise FinetuneError(f"model.config_path: could not load a config from {source!r}: {exc}") from None


def check_attention_backend(name: str) -> None:
    """Fail early, with a fix, when the attention backend cannot run here."""
    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise FinetuneError(
                "model.attn_implementation: flash_attention_2 needs the flash-attn package "
                "(pip install -e '.[flash-attn]') and a CUDA GPU; use sdpa otherwise"
            )
        if not torch.cuda.is_available():
            raise FinetuneError(
                "model.attn_implementation: flash_attention_2 needs a CUDA GPU; use sdpa on CPU"
            )
    if name == "flex_attention" and not torch.cuda.is_available():
        raise FinetuneError(
            f"model.attn_implementation: flex_attention has no backward pass on CPU in torch {torch.__version__}; "
            "use sdpa (or eager) on CPU"
        )


def weight_dtype(model: ModelSection, lora: LoraSection, mixed_precision: str) -> torch.dtype:
    """dtype of the loaded weights. `auto`: trained weights stay fp32 (the optimizer's master copy,
    with autocast doing 16-bit compute); frozen LoRA base weights load in the 16-bit compute dtype."""
    if model.torch_dtype != "auto":
        return DTYPES[model.torch_dtype]
    if lora.enable_lora and mixed_precision in DTYPES:
        return DTYPES[mixed_precision]
    return torch.float32


def build_model(
    model: ModelSection,
    lora: LoraSection,
    *,
    mixed_precision: str,
    vocab_size: int,
    gradient_checkpointing: bool,
    head: Literal["lm", "score"] = "lm",
    pad_token_id: int | None = None,
    seed: int = 0,
):
    """Load pretrained weights (4-bit for QLoRA) or build a random-init model from a config.

    LoRA adapters are added afterwards by `apply_lora`.

    `head` is the output head: the language-model head (`lm`), or one score per token (`score`: a reward
    model, transformers' AutoModelForSequenceClassification with num_labels 1, whose config records
    `pad_token_id`, where its pooling stops). A score head the weights do not hold (a causal LM's
    checkpoint) is new: `init_score_head` draws it from `seed`, so `finetune eval` rebuilds the same one.

    `vocab_size` is the tokenizer's length: the embeddings grow to it when special tokens were added.
    A GGUF model loads from its converted folder; an adapter names the GGUF file as its base
    (`finetune.gguf.names.portable_base`), from which any machine converts it again.
    """
    check_attention_backend(model.attn_implementation)
    portable = portable_base(model.model_path, model.gguf_file, model.revision)
    model = resolve_model_source(model)
    net, new_head = _load_weights(model, lora, mixed_precision, head=head)
    if head == "score":
        net.config.pad_token_id = pad_token_id
        if new_head:
            logger.info("the weights hold no score head: a new one, drawn from seed %d", seed)
            init_score_head(net, seed)
    if portable is not None:
        # PEFT records the model's name_or_path as the adapter's base: the GGUF file's portable name,
        # not the conversion cache's folder, which exists on this machine only (finetune.gguf).
        net.name_or_path = portable
    if vocab_size > full_shape(net.get_input_embeddings().weight)[0]:
        logger.info("resizing embeddings to %d tokens for the added special tokens", vocab_size)
        net.resize_token_embeddings(vocab_size, mean_resizing=True)
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and torch.compile. (transformers 5
        # renamed gradient_checkpointing_enable, which warns now and goes in v6.)
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        net.config.use_cache = False
    if model.enable_liger_kernel:
        apply_liger(net)
    if model.kind == "vlm":
        vlm.freeze(net, train_vision_tower=model.train_vision_tower, train_projector=model.train_projector)
    return net


def _load_weights(model: ModelSection, lora: LoraSection, mixed_precision: str, *, head: str = "lm"):
    """The model of a resolved section: its pretrained weights (4-bit for QLoRA, a VLM's vision tower
    and projector left unquantized: finetune.model.vlm.unquantized_modules), or a random init from
    its config; with `head` score, a one-output sequence-classification model. Returns (the model,
    whether its score head is new: not in the weights)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    auto = AutoModelForImageTextToText if model.kind == "vlm" else AutoModelForCausalLM
    dtype = weight_dtype(model, lora, mixed_precision)
    common: dict[str, Any] = {"attn_implementation": model.attn_implementation, "dtype": dtype}
    config = _load_config(model) if model.config_path is not None or head == "score" else None
    if head == "score":  # one output; set on the config, which from_pretrained then takes as it is
        auto, config.num_labels = AutoModelForSequenceClassification, 1
    if lora.enable_qlora:
        skip = (
            vlm.unquantized_modules(_load_config(model), trust_remote_code=model.trust_remote_code)
            if model.kind == "vlm" and model.model_path is not None
            else None
        )
        common["quantization_config"] = qlora_config(
            lora, compute_dtype=DTYPES.get(mixed_precision, torch.float32), skip_modules=skip
        )
    if model.model_path is not None:
        try:
            loaded = auto.from_pretrained(
                model.model_path,
                config=config,
                revision=model.revision,
                trust_remote_code=model.trust_remote_code,
                output_loading_info=head == "score",
                **common,
            )
        except OSError as exc:  # transformers' word for a location without loadable weights
            if not Path(str(model.model_path)).is_dir():
                raise
            raise FinetuneError(
                f"model.model_path {model.model_path}: the folder holds no weights transformers can load "
                f"({str(exc).strip().splitlines()[0]}); point it at a folder with model.safetensors (or "
                "pytorch_model.bin and its shards), or leave it unset and give model.config_path to train from "
                "a random init"
            ) from None
        if head != "score":
            return loaded, False
        net, info = loaded
        return net, any(key.startswith("score.") for key in info["missing_keys"])
    config = config or _load_config(model)
    if lora.enable_qlora:
        raise FinetuneError(
            "lora.enable_qlora quantizes pretrained weights: set model.model_path "
            "(for a random-init model, save it with save_pretrained first)"
        )
    net = auto.from_config(
        config,
        attn_implementation=model.attn_implementation,
        dtype=dtype,
        trust_remote_code=model.trust_remote_code,
    )
    return net, head == "score"


def init_score_head(net, seed: int) -> None:
    """A new score head's weights drawn from their own generator seeded by `seed` (transformers' init:
    normal, std initializer_range, zero bias), whatever the global RNG has drawn before: the head a
    reward run starts from, and the one `finetune eval` gives the base model, are the same."""
    head = net.score
    generator = torch.Generator().manual_seed(seed)
    std = getattr(net.config.get_text_config(), "initializer_range", 0.02)
    with torch.no_grad():
        weight = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        head.weight.copy_(weight.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.zero_()


def qlora_config(lora: LoraSection, *, compute_dtype: torch.dtype, skip_modules: list[str] | None = None):
    """bitsandbytes 4-bit config for QLoRA; `skip_modules` (module names) stay unquantized (None:
    transformers' default, the output head and tied weights)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise FinetuneError("lora.enable_qlora needs bitsandbytes: pip install -e '.[qlora]'")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=lora.quant_type,
        bnb_4bit_use_double_quant=lora.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
        llm_int8_skip_modules=skip_modules,
    )


def apply_liger(net) -> None:
    """Patch the model with Liger kernels (fused RMSNorm, RoPE, SwiGLU, cross-entropy)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise FinetuneError(
            "model.enable_liger_kernel needs liger-kernel (pip install liger-kernel) and a GPU"
        )
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=net)


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's whole shape, also under DeepSpeed ZeRO-3, whose partitioned parameters are empty
    on each process and keep their shape in `ds_shape` (reading `.shape` there gave 0 rows: the
    embeddings were "resized" to their own size, which drew from the RNG and shifted every later
    dropout mask and LoRA init away from the same run without ZeRO-3).

    >>> full_shape(torch.nn.Embedding(704, 8).weight)
    torch.Size([704, 8])
    """
    return getattr(param, "ds_shape", param.shape)


def count_parameters(net) -> tuple[int, int]:
    """(trainable, total) parameter counts."""

    # Under DeepSpeed ZeRO-3 a parameter's local tensor is empty; ds_numel is its full size.
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    trainable = sum(numel(p) for p in net.parameters() if p.requires_grad)
    total = sum(numel(p) for p in net.parameters())
    return trainable, total


def save_base_model(net, folder: Path, *, is_main_process: bool = True) -> None:
    """Save a randomly initialised base model (before LoRA wraps it) so its adapter can be loaded or
    merged later: there is no pretrained checkpoint to point at.

    Every process must call it: under DeepSpeed ZeRO-3 the weights are partitioned across processes
    and are gathered (DeepSpeed's GatheredParameters) for the main process to write.
    """
    from transformers.integrations import is_deepspeed_zero3_enabled

    gather = contextlib.nullcontext()
    if is_deepspeed_zero3_enabled():
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=None)
    with gather:
        if is_main_process:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                net.save_pretrained(folder, safe_serialization=True)
            except BaseException as exc:
                if write_failure_reason(exc) is None:
                    raise
                shutil.rmtree(folder, ignore_errors=True)  # half a model would be loaded as the base later
                raise write_error(
                    exc,
                    f"writing the randomly initialised base model to {folder}",
                    folder.parent,
                    "Nothing was trained yet; free space (or fix the folder's permissions) and run again, or "
                    "choose another train.output_dir",
                ) from None
