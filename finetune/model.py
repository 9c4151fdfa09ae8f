"""Load or build the model and tokenizer; attention backend; LoRA / QLoRA through PEFT; merging.

Functions here take the typed recipe sections (ModelSection, LoraSection), never the whole Recipe.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from finetune import vlm
from finetune.errors import FinetuneError, write_error, write_failure_reason
from finetune.gguf import is_gguf_name, is_package_ref, portable_base, resolve_model_source, resolve_path
from finetune.notices import warn
from finetune.quiet import quiet_third_party
from finetune.recipe import LoraSection, ModelSection
from finetune.recipe.lora import MODIFIES_BASE

logger = logging.getLogger(__name__)

# Library users who import finetune.model directly get the same quiet output as the entry points.
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
):
    """Load pretrained weights (4-bit for QLoRA) or build a random-init model from a config.

    LoRA adapters are added afterwards by `apply_lora`.

    `vocab_size` is the tokenizer's length: the embeddings grow to it when special tokens were added.
    A GGUF model loads from its converted folder; an adapter names the GGUF file as its base
    (`finetune.gguf.portable_base`), from which any machine converts it again.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if model.kind == "vlm" else AutoModelForCausalLM
    check_attention_backend(model.attn_implementation)
    portable = portable_base(model.model_path, model.gguf_file, model.revision)
    model = resolve_model_source(model)
    dtype = weight_dtype(model, lora, mixed_precision)
    common: dict[str, Any] = {"attn_implementation": model.attn_implementation, "dtype": dtype}
    if lora.enable_qlora:
        # A VLM's vision tower and projector stay unquantized (finetune.vlm.unquantized_modules).
        skip = (
            vlm.unquantized_modules(_load_config(model), trust_remote_code=model.trust_remote_code)
            if model.kind == "vlm" and model.model_path is not None
            else None
        )
        common["quantization_config"] = qlora_config(
            lora, compute_dtype=DTYPES.get(mixed_precision, torch.float32), skip_modules=skip
        )
    if model.model_path is not None:
        net = auto.from_pretrained(
            model.model_path,
            config=_load_config(model) if model.config_path is not None else None,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            **common,
        )
    else:
        config = _load_config(model)
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


def apply_lora(
    net,
    lora: LoraSection,
    *,
    gradient_checkpointing: bool,
    base: str | None = None,
    init_data=None,
    **targets,
):
    """Wrap the model with PEFT LoRA adapters (rsLoRA / DoRA / modules_to_save as configured), new or
    lora.init_adapter's (then `base`, the location the model was loaded from, must be its base).
    EVA and CorDA compute their init over `init_data` (finetune.lora_init.InitData). `targets`
    (target_modules, modules_to_save) replace the recipe's (a VLM's: finetune.vlm)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from finetune.lora_init import config_fields, data_driven_peft_model, is_data_driven

    if lora.enable_qlora:
        net = prepare_model_for_kbit_training(
            net,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    if lora.init_adapter:
        return continue_adapter(net, lora, base=base)
    config = LoraConfig(
        r=lora.lora_rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=targets.get("target_modules", lora.lora_target_modules),
        modules_to_save=targets.get("modules_to_save", lora.modules_to_save or None),
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        init_lora_weights=lora.init_lora_weights,
        task_type="CAUSAL_LM",
        **config_fields(lora),
    )
    try:
        if is_data_driven(config):
            return data_driven_peft_model(net, config, init_data)
        return get_peft_model(net, config)
    except ValueError as exc:
        field = "init_lora_weights" if lora.init_lora_weights is not True else "lora_target_modules"
        raise FinetuneError(f"lora.{field}: {exc}") from None


def init_modifies_base(net) -> bool:
    """Whether `net` (a PEFT model) was initialised by PiSSA, OLoRA or CorDA, which subtract the
    adapter's start from the base weights: its adapter must be saved converted (`save_initial_adapter`)."""
    config = getattr(net, "peft_config", {}).get("default")
    init = getattr(config, "init_lora_weights", True)
    return isinstance(init, str) and init.startswith(MODIFIES_BASE)


def save_initial_adapter(net, folder: Path, *, is_main_process: bool) -> None:
    """Save a PiSSA/OLoRA adapter as initialised, before any update, as PEFT's docs prescribe (with
    init_lora_weights recorded as true): the final save converts the trained adapter against it
    (`path_initial_model_for_weight_conversion`) into plain LoRA of twice the rank, which applies to the
    original base instead of the residual one the run trained on."""
    config = net.peft_config["default"]
    init = config.init_lora_weights
    config.init_lora_weights = True
    try:
        net.save_pretrained(folder, is_main_process=is_main_process, safe_serialization=True)
    finally:
        config.init_lora_weights = init


def save_converted_adapter(net, folder: Path, *, initial: Path, is_main_process: bool, **save_kwargs) -> None:
    """Save a PiSSA/OLoRA/CorDA adapter converted to plain LoRA against the original base
    (`path_initial_model_for_weight_conversion=initial`, see `save_initial_adapter`), keeping every
    tensor that is not a LoRA matrix.

    PEFT's conversion (LoraModel.subtract_mutated_init, peft 0.21) returns only the lora_A/lora_B
    tensors, so modules_to_save copies (a trained lm_head, embeddings) and saved embedding layers were
    lost, and the adapter then failed to load (KeyError on their weights). They need no conversion:
    they replace the base's module whole, so the trained tensors are written back as they are.
    """
    from peft import get_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file, save_file

    whole = get_peft_model_state_dict(
        net,
        state_dict=save_kwargs.get("state_dict"),
        save_embedding_layers=save_kwargs.get("save_embedding_layers", "auto"),
    )
    net.save_pretrained(
        folder,
        is_main_process=is_main_process,
        safe_serialization=True,
        path_initial_model_for_weight_conversion=str(initial),
        **save_kwargs,
    )
    kept = {k: v for k, v in whole.items() if "lora_A" not in k and "lora_B" not in k}
    if not is_main_process or not kept:
        return
    path = Path(folder) / SAFETENSORS_WEIGHTS_NAME
    saved = load_file(path)
    missing = {k: v.detach().to("cpu").contiguous() for k, v in kept.items() if k not in saved}
    if missing:
        save_file({**saved, **missing}, path, metadata={"format": "pt"})


def enable_neftune(net, noise_alpha: float):
    """NEFTune: transformers' neftune_post_forward_hook on the input embeddings, with noise of magnitude
    noise_alpha / sqrt(L * d) in training forwards. Returns the hook's handle.

    transformers' hook adds noise whenever the module is in train mode; finetune also runs forwards in
    train mode without gradient (the reference's and the sampling policy's log-probs), which must see the
    model as it is, so the hook here applies it only to forwards that build a graph for backward.
    Evaluation and generation run in eval mode: no noise either.
    """
    from transformers.integrations.neftune import neftune_post_forward_hook

    embeddings = net.get_input_embeddings()
    embeddings.neftune_noise_alpha = noise_alpha

    def hook(module, args, output):
        return neftune_post_forward_hook(module, args, output) if torch.is_grad_enabled() else output

    return embeddings.register_forward_hook(hook)


# The LoRA settings an adapter folder records (adapter_config.json) and the recipe field of each.
_ADAPTER_SETTINGS = {
    "r": "lora_rank",
    "lora_alpha": "lora_alpha",
    "target_modules": "lora_target_modules",
    "modules_to_save": "modules_to_save",
    "use_dora": "use_dora",
    "use_rslora": "use_rslora",
}


def continue_adapter(net, lora: LoraSection, *, base: str | None):
    """lora.init_adapter loaded onto `net` with its weights trainable, after checking that its base is
    the recipe's model and its LoRA settings the recipe's (a mismatch is an error naming both)."""
    from peft import PeftModel

    folder = Path(lora.init_adapter).expanduser()
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise FinetuneError(
            f"lora.init_adapter: {folder} holds no adapter_config.json; point it at a trained adapter folder "
            "(a LoRA run's train.output_dir)"
        )
    saved = json.loads(config_file.read_text())
    problems = []
    recorded = saved.get("base_model_name_or_path")
    if base is not None and recorded and _same_location(recorded) != _same_location(base):
        problems.append(f"its base is {recorded}, this recipe's model is {base}")
    for key, field in _ADAPTER_SETTINGS.items():
        want, have = getattr(lora, field), saved.get(key)
        if key == "modules_to_save":
            want, have = sorted(want or []), sorted(have or [])
        if key == "target_modules":  # names or all-linear: compare the modules they pick in this model
            if _targeted(net, want) != _targeted(net, have):
                problems.append(f"lora.{field} is {want!r} here; the adapter targets {_short(have)}")
        elif want != have:
            problems.append(f"lora.{field} is {want!r} here, {have!r} in the adapter")
    if problems:
        raise FinetuneError(
            f"lora.init_adapter {folder} does not fit this recipe: "
            + "; ".join(problems)
            + ". Set the recipe's "
            "model and lora settings to the adapter's (its adapter_config.json), or start a new adapter"
        )
    try:
        return PeftModel.from_pretrained(net, folder, is_trainable=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise FinetuneError(f"lora.init_adapter: cannot load {folder} onto the model: {exc}") from None


def _targeted(net, targets) -> set[str]:
    """The modules of `net` that LoRA target_modules pick, as PEFT matches them: `all-linear` is every
    linear layer but the output head; a name matches a module that is it or ends with `.name`."""
    head = net.get_output_embeddings()
    names = {
        name
        for name, module in net.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    if targets == "all-linear":
        return names
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    return {n for n in names if any(n == t or n.endswith("." + t) for t in targets)}


def _short(targets) -> str:
    """Target module names for a message: the distinct last parts (q_proj, v_proj, ...)."""
    if isinstance(targets, str):
        return repr(targets)
    return repr(sorted({t.rsplit(".", 1)[-1] for t in targets or []}))


def _same_location(path: str) -> str:
    """A local path resolved (symlinks, relative parts), a Hub id as it is."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def upcast_trainable_to_fp32(net) -> int:
    """Cast trainable 16-bit parameters (e.g. modules_to_save copies of an fp16 base) to fp32; returns
    how many were cast.

    fp16 loss scaling needs fp32 gradients (torch's GradScaler refuses to unscale fp16 ones), and fp32
    master weights keep small updates from rounding away; autocast still computes in 16 bits. PEFT
    already keeps LoRA weights in fp32; this covers the rest.
    """
    cast = 0
    for param in net.parameters():
        if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
            cast += 1
    return cast


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
            folder.mkdir(parents=True, exist_ok=True)
            net.save_pretrained(folder, safe_serialization=True)


def adapter_save_kwargs(net) -> dict[str, Any]:
    """Extra save_pretrained arguments for `net`: for a PEFT model on a GGUF base, save_embedding_layers
    decided as PEFT's "auto" decides it (embeddings resized since the base: save them).

    PEFT reads the base's config.json at base_model_name_or_path to tell; a GGUF base records the
    file's portable name there (finetune.gguf.portable_base), not a folder, so PEFT would warn and
    assume nothing was resized. The converted folder's config answers instead.
    """
    from peft import PeftModel
    from transformers import AutoConfig

    if not isinstance(net, PeftModel):
        return {}
    base = net.peft_config[net.active_adapter].base_model_name_or_path
    if not is_gguf_name(base):
        return {}
    resized = (
        net.get_base_model().config.vocab_size != AutoConfig.from_pretrained(resolve_path(base)).vocab_size
    )
    return {"save_embedding_layers": resized}


def merge_lora(adapter_dir: str, output: str, *, base: str | None = None, dtype: str = "auto") -> None:
    """Merge a LoRA adapter into its base model and save full safetensors weights + tokenizer."""
    from finetune.checkpoint import file_stamps, record_written

    adapter = Path(adapter_dir)
    net, tokenizer = load_adapter(adapter, base=base, dtype=dtype)
    merged = net.merge_and_unload()
    out = Path(output)
    before = file_stamps(out)
    try:
        merged.save_pretrained(out, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        else:
            warn("no tokenizer found next to the adapter or base model; merged weights saved without one")
    except BaseException as exc:
        if write_failure_reason(exc) is None:
            raise
        raise write_error(
            exc,
            f"saving the merged model in {out}",
            out,
            "The files written there are incomplete; free space or choose another output folder, then merge again",
        ) from None
    record_written(out, before)  # verified when finetune loads the merged model
    for extra in ("recipe.resolved.yaml",):
        if (adapter / extra).is_file():
            shutil.copy(adapter / extra, out / extra)


def load_adapter(adapter: Path, *, base: str | None = None, dtype: str = "auto"):
    """(PeftModel, tokenizer or None): the adapter in `adapter` on its base model.

    The base is `base` if given, else the adapter's recorded base_model_name_or_path; a GGUF file (or
    `package://` reference) as base is used through its converted folder. The tokenizer is the
    adapter's own when saved with it (training saves it: its length sizes the embeddings), else the base's.
    """
    from peft import PeftModel

    peft_config = check_adapter_folder(adapter)
    check_saved_files(adapter)
    base_path = base or peft_config.base_model_name_or_path
    if not base_path:
        raise FinetuneError(f"{adapter}: the adapter names no base model; pass --base PATH")
    fix = "Pass --base PATH if it moved (for a GGUF base, the .gguf file: it is converted again)."
    net, base_path = _load_causal_lm(
        base_path, dtype, f"could not load the base model {{}} of {adapter}", fix
    )
    own = (adapter / "tokenizer_config.json").is_file()
    tokenizer = _load_tokenizer_or_none(str(adapter) if own else base_path)
    if base is not None and own and tokenizer is not None:  # a base given by hand: is it the adapter's?
        _check_base_tokenizer(adapter, tokenizer, base_path)
    if tokenizer is not None and len(tokenizer) > net.get_input_embeddings().weight.shape[0]:
        # Training added special tokens and grew the embeddings (trained through modules_to_save, which
        # the adapter holds at the new size): the base must have that size before the adapter loads.
        logger.info("resizing the base embeddings to the adapter's tokenizer (%d tokens)", len(tokenizer))
        net.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    try:
        return PeftModel.from_pretrained(net, adapter), tokenizer
    except (OSError, RuntimeError, ValueError, KeyError) as exc:  # shapes or modules the base lacks
        raise FinetuneError(
            f"{adapter}: PEFT cannot load the adapter onto the base model {base_path}: {_brief(exc)}. Check "
            "its adapter_config.json (as training wrote it) and that the base is the model it was trained "
            "on. " + fix
        ) from None


def load_for_inference(
    path: str, *, base: str | None = None, dtype: str = "auto", merge: bool = False, tokenizer=None
):
    """(model, tokenizer) in eval mode, ready to generate, from what training wrote or any model:
    an adapter folder (its base + the adapter; merged into the base when `merge`, which generates
    faster), a full model folder or Hub id, or a GGUF file / `package://` reference (converted once).

    `base` overrides an adapter's recorded base; `dtype` is auto (the checkpoint's), bf16, fp16 or fp32;
    `tokenizer` replaces the one found next to the model (a recipe's own tokenizer for its base).
    """
    given = tokenizer

    local = Path(path).expanduser()
    _refuse_vision_language(local)
    check_model_location(path)
    if (local / ADAPTER_CONFIG).is_file():
        net, tokenizer = load_adapter(local, base=base, dtype=dtype)
        if merge:
            net = net.merge_and_unload()
    else:
        if base is not None:
            raise FinetuneError(f"{path}: a base model was given, but this is not an adapter folder")
        failure = f"{path}: not an adapter folder (no adapter_config.json) and no model loads from it"
        net, source = _load_causal_lm(
            path, dtype, failure, "Point at a folder training wrote, a Hub id, or a .gguf file."
        )
        tokenizer = _load_tokenizer_or_none(source)
    tokenizer = given if given is not None else tokenizer
    if tokenizer is None:
        raise FinetuneError(f"{path}: no tokenizer saved with the model or its base; cannot generate text")
    return net.eval(), tokenizer


def is_vision_language(local: Path) -> bool:
    """Whether `local` is a vision-language model folder (its config has a vision_config), or an adapter
    folder whose recorded base is one; False for anything that is not a local folder with a config."""
    config = local / "config.json"
    try:
        if (local / ADAPTER_CONFIG).is_file():
            base = json.loads((local / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
            config = Path(base).expanduser() / "config.json"
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError, AttributeError, TypeError):
        return False  # not a local folder with a readable config: the loading says what is wrong


def _refuse_vision_language(local: Path) -> None:
    """A vision-language run (model.kind vlm) cannot be loaded as a causal LM for text generation: say
    so, instead of transformers' "unrecognized configuration class" from deep inside the loading."""
    if is_vision_language(local):
        raise FinetuneError(
            f"{local} is a vision-language model (its config has a vision_config): export-gguf and text "
            "generation take text models only so far (finetune chat DIR --image PATH talks to it, finetune eval "
            "with its recipe scores its held-out loss); it loads with transformers' "
            "AutoModelForImageTextToText and AutoProcessor"
        )


def load_vlm_for_inference(path: str, *, base: str | None = None, dtype: str = "auto"):
    """(model, processor) in eval mode from what a vision-language run wrote: an adapter folder (on its
    recorded base, or `base`) or a full model folder, loaded with AutoModelForImageTextToText; the
    processor is the one saved with it (training saves it next to the weights), else the base's."""
    from transformers import AutoModelForImageTextToText

    local = Path(path).expanduser()
    check_model_location(path)
    adapter = (local / ADAPTER_CONFIG).is_file()
    if adapter:
        peft_config = check_adapter_folder(local)
        source = base or peft_config.base_model_name_or_path
    elif base is not None:
        raise FinetuneError(f"{path}: a base model was given, but this is not an adapter folder")
    else:
        source = str(local)
    check_saved_files(local)
    fix = "Pass --base PATH if the base model moved." if adapter else "Point at a folder training wrote."
    try:
        net = AutoModelForImageTextToText.from_pretrained(source, dtype=_load_dtype(dtype))
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"{path}: could not load the vision-language model {source!r}: {_brief(exc)}. {fix}"
        ) from None
    own = any((local / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))
    processor = vlm.auto_processor(str(local) if own else source)
    if adapter:
        from peft import PeftModel

        try:
            net = PeftModel.from_pretrained(net, local)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise FinetuneError(
                f"{local}: PEFT cannot load the adapter onto the base model {source}: {_brief(exc)}. {fix}"
            ) from None
    return net.eval(), processor


def inference_device() -> torch.device:
    """Where `finetune eval` and `finetune chat` run the model: the first GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def base_model_source(model: ModelSection, *, adapter: str | None = None) -> str:
    """The recipe's base model as a loadable location (a GGUF file's converted folder); for a recipe
    without pretrained weights (a random-init config), the base recorded in `adapter`."""
    if model.model_path is not None:
        return resolve_model_source(model).model_path
    if adapter is not None and (Path(adapter) / "adapter_config.json").is_file():
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
        if config.get("base_model_name_or_path"):
            return config["base_model_name_or_path"]
    raise FinetuneError(
        "the recipe's model has no pretrained weights (model.model_path is null): evaluate a trained "
        "adapter with --adapter DIR (its saved base is used) or a model folder with --model DIR --no-base"
    )


def _load_causal_lm(location: str, dtype: str, failure: str, fix: str):
    """(model, the folder or Hub id it loaded from): AutoModelForCausalLM.from_pretrained on `location`
    made loadable (a GGUF file or package:// reference converted, `resolve_path`); a loading failure
    is said as `failure` (with the resolved location in place of `{}`), the reason, then `fix`."""
    from transformers import AutoModelForCausalLM

    try:
        source = resolve_path(location)  # a GGUF base is converted (again, on a new machine) here
    except FinetuneError as exc:
        raise FinetuneError(f"{failure.format(repr(location))}: {exc}. {fix}") from None
    if Path(source).is_dir():
        check_saved_files(Path(source))
    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=_load_dtype(dtype)), source
    except (OSError, ValueError) as exc:  # no such folder or Hub id; a config without a model_type
        raise FinetuneError(f"{failure.format(repr(source))}: {exc}. {fix}") from None


def check_saved_files(folder: Path) -> None:
    """Refuse a model or adapter folder whose files do not match the checksums.json finetune wrote
    with them (training's final save, merge-lora); a folder without one (an older run, another tool)
    loads as it is."""
    from finetune.checkpoint import verify_checksums

    problem = verify_checksums(folder)
    if problem is not None:
        raise FinetuneError(
            f"{folder} does not load: {problem}. The file was damaged or changed after finetune wrote it: "
            "copy the folder again from where it came from, or write it again (resume the training run "
            "with --train.load_checkpoint_path auto, or run merge-lora again)"
        )


def _load_dtype(dtype: str):
    return "auto" if dtype == "auto" else DTYPES[dtype]


def _load_tokenizer_or_none(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ checking a location before loading

ADAPTER_CONFIG = "adapter_config.json"
# PEFT's weight file names (peft.utils.constants SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_RUN_FOLDER = "a run's train.output_dir"


def check_model_location(path: str, *, flag: str = "", local: bool = False) -> None:
    """Refuse, before anything loads, a location no model loads from: a path that does not exist, a
    file, an empty folder or one with neither a model nor an adapter, a training checkpoint, an adapter
    folder whose files are damaged (check_adapter_folder). `flag` names the option that gave it
    (`--adapter`); `local` refuses what could only be a Hub id. A GGUF file or `package://` reference
    is checked where it is resolved (finetune.gguf)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if is_package_ref(path) or is_gguf_name(path):
        return
    folder = Path(path).expanduser()
    where = f"{flag} {path}".strip()
    if not folder.exists():
        try:
            validate_repo_id(path)
        except HFValidationError:
            local = True
        if local:
            raise FinetuneError(f"{where} does not exist: point at {_RUN_FOLDER} or another model folder")
        return  # a Hub id: _load_causal_lm says why it does not load, if it does not
    if not folder.is_dir():
        raise FinetuneError(
            f"{where} is a file: point at the folder that holds the model or adapter ({_RUN_FOLDER}), "
            "or at a .gguf file"
        )
    _refuse_checkpoint(folder, where)
    if (folder / ADAPTER_CONFIG).is_file():
        check_adapter_folder(folder, flag=flag)
    elif not (folder / "config.json").is_file():
        what = "is an empty folder" if not any(folder.iterdir()) else "holds no model"
        raise FinetuneError(
            f"{where} {what}: neither an adapter ({ADAPTER_CONFIG}) nor a model (config.json). Point at "
            f"{_RUN_FOLDER}, a model folder, a Hub id or a .gguf file"
        )


def check_adapter_folder(folder: Path, *, flag: str = ""):
    """The adapter's PEFT config, after checking what loading it needs: the folder exists and is no
    training checkpoint, adapter_config.json parses and PEFT accepts its fields, and a weights file is
    there with a readable header (a truncated or overwritten safetensors file fails here, not after
    the base model has loaded)."""
    from peft import PeftConfig

    where = f"{flag} {folder}".strip()
    if not folder.is_dir():
        raise FinetuneError(
            f"{where} does not exist: point at a trained adapter folder (a LoRA run's train.output_dir)"
        )
    _refuse_checkpoint(folder, where)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FinetuneError(
            f"{where} holds no {ADAPTER_CONFIG}, so it is no adapter: point at a trained adapter folder "
            "(a LoRA run's train.output_dir)"
        )
    again = "copy the adapter folder again from where it was trained, or train it again"
    try:
        saved = json.loads(config_file.read_text())
        config = PeftConfig.from_pretrained(str(folder))
    except json.JSONDecodeError as exc:
        raise FinetuneError(
            f"{config_file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); {again}"
        ) from None
    except KeyError:  # PEFT's table of config classes, by peft_type
        raise FinetuneError(
            f"{config_file}: peft_type {saved.get('peft_type')!r} is no adapter type PEFT knows; {again}"
        ) from None
    except (TypeError, ValueError, AttributeError) as exc:  # PEFT's config classes on bad fields
        raise FinetuneError(f"{config_file}: PEFT rejects it ({_brief(exc)}); {again}") from None
    wrong = _mistyped_fields(saved, type(config))
    if wrong:
        raise FinetuneError(f"{config_file}: {'; '.join(wrong)}; {again}")
    _check_adapter_weights(folder, again)
    return config


def _mistyped_fields(saved: dict, config_class) -> list[str]:
    """The fields of a saved PEFT config whose values do not have the type its config class declares.

    PEFT's config dataclasses do not check types (a rank of "sixteen" fails deep inside building the
    layers, after the base model has loaded), so the declared types are checked here with pydantic, in
    its lax mode (an int saved as 32.0 passes, as PEFT takes it).
    """
    import typing

    from pydantic import PydanticUserError, TypeAdapter, ValidationError

    hints = typing.get_type_hints(config_class)
    wrong = []
    for name, value in saved.items():
        if name not in hints:  # PEFT warns about fields it does not know, and ignores them
            continue
        try:
            check = TypeAdapter(hints[name])
        except PydanticUserError:  # a type pydantic cannot describe (a class of PEFT's): left to PEFT
            continue
        try:
            check.validate_python(value)
        except ValidationError as exc:
            wrong.append(f"{name} is {value!r}, not {_type_name(hints[name])} ({exc.errors()[0]['msg']})")
    return wrong


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _check_adapter_weights(folder: Path, again: str) -> None:
    from safetensors import SafetensorError, safe_open

    found = [folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()]
    if not found:
        raise FinetuneError(
            f"{folder} holds {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}); {again}"
        )
    if found[0].suffix != ".safetensors":
        return  # a pickled .bin (older PEFT): torch reads it when PEFT loads it
    try:  # reads the header and checks that it covers the file: nothing is loaded
        with safe_open(str(found[0]), framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError) as exc:
        raise FinetuneError(
            f"{found[0]}: not a readable safetensors file ({exc}): it is truncated or damaged; {again}"
        ) from None


def _refuse_checkpoint(folder: Path, where: str) -> None:
    """A training checkpoint (checkpoints/step-N) holds what resuming needs, not a loadable model:
    say so, with the run's output folder when it holds the final adapter or model."""
    from finetune.checkpoint import STATE_FILE, step_of

    folder_is_step = step_of(folder.resolve()) is not None and folder.resolve().parent.name == "checkpoints"
    if not ((folder / STATE_FILE).is_file() or folder_is_step):
        return
    run = folder.resolve().parent.parent
    if (run / ADAPTER_CONFIG).is_file() or (run / "config.json").is_file():
        fix = f"point at the run's output folder {run}, which holds its final adapter or model"
    else:
        fix = (
            f"the run writes its final adapter or model to {run} when training ends; finish the run with "
            f"`finetune train RECIPE --train.load_checkpoint_path {folder}` (the recipe it was trained with)"
        )
    raise FinetuneError(
        f"{where} is a training checkpoint (the trained weights with optimizer, scheduler and RNG state, "
        f"for resuming), not a model that loads for inference: {fix}"
    )


def _check_base_tokenizer(adapter: Path, tokenizer, base_path: str) -> None:
    """A base given by hand must have the adapter's vocabulary: every token of its tokenizer with the
    same id in the adapter's (which may add special tokens)."""
    base_tokenizer = _load_tokenizer_or_none(base_path)
    if base_tokenizer is None:
        return
    adapter_vocab = tokenizer.get_vocab()
    differ = [t for t, i in base_tokenizer.get_vocab().items() if adapter_vocab.get(t) != i]
    if differ:
        raise FinetuneError(
            f"--base {base_path} is not the base of {adapter}: its tokenizer ({len(base_tokenizer)} tokens) "
            f"is not the adapter's ({len(tokenizer)} tokens; {len(differ)} differ, e.g. {differ[0]!r}). "
            "Pass the model the adapter was trained on (its adapter_config.json base_model_name_or_path)"
        )


def _brief(exc: BaseException) -> str:
    """An exception in one line: its first two lines (torch's load_state_dict puts the cause on the
    second), at most 300 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
