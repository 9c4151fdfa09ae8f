"""LoRA adapters through PEFT: adding them (new, continued from a saved adapter, or data-driven inits
from finetune.model.lora_init), saving PiSSA/OLoRA/CorDA adapters converted for the original base, the
save arguments of an adapter on a GGUF base, NEFTune noise, fp32 trainable weights, and the adapters
merged for a generate call and taken out again bit for bit (`merged_adapters`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.gguf.convert import resolve_path
from finetune.gguf.names import is_gguf_name
from finetune.quiet import quiet_third_party
from finetune.recipe import LoraSection
from finetune.recipe.lora import MODIFIES_BASE

logger = logging.getLogger(__name__)

# Library users who import finetune.model's modules directly get the same quiet output as the entry points.
quiet_third_party(torch.cuda.is_available())


def apply_lora(
    net,
    lora: LoraSection,
    *,
    gradient_checkpointing: bool,
    base: str | None = None,
    init_data=None,
    task_type: str = "CAUSAL_LM",
    **targets,
):
    """Wrap the model with PEFT LoRA adapters (rsLoRA / DoRA / modules_to_save as configured), new or
    lora.init_adapter's (then `base`, the location the model was loaded from, must be its base).
    EVA and CorDA compute their init over `init_data` (finetune.model.lora_init.InitData). `targets`
    (target_modules, modules_to_save) replace the recipe's (a VLM's: finetune.model.vlm). `task_type` is
    PEFT's: SEQ_CLS for a reward model, whose score head PEFT then trains whole (modules_to_save)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from finetune.model.lora_init import config_fields, data_driven_peft_model, is_data_driven

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
        task_type=task_type,
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


def adapter_save_kwargs(net) -> dict[str, Any]:
    """Extra save_pretrained arguments for `net`: for a PEFT model on a GGUF base, save_embedding_layers
    decided as PEFT's "auto" decides it (embeddings resized since the base: save them).

    PEFT reads the base's config.json at base_model_name_or_path to tell; a GGUF base records the
    file's portable name there (finetune.gguf.names.portable_base), not a folder, so PEFT would warn and
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


def unmergeable(net) -> str | None:
    """Why `merged_adapters` would leave `net` unmerged, or None when it can merge: a model without
    LoRA adapters, adapters already merged, a LoRA variant (DoRA, ...) or a bias adapter, a base weight
    that is not a plain tensor (bitsandbytes 4-bit, DeepSpeed ZeRO-3 partitions, FSDP's DTensor shards)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in net.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        return "no LoRA adapters"
    for layer in layers:
        if not isinstance(layer, LoraLayer):
            return f"a {type(layer).__name__} adapter (LoRA only)"
        if layer.merged:
            return "the adapters are merged already"
        if any(layer.lora_variant.values()) or any(layer.lora_bias.values()):
            return "a LoRA variant (DoRA) or a bias adapter"
        weight = getattr(layer.get_base_layer(), "weight", None)
        if (
            type(weight) is not torch.nn.Parameter
            or hasattr(weight, "ds_id")
            or not weight.is_floating_point()
        ):
            return f"a {type(weight).__name__} base weight (quantized or sharded)"
    return None


@contextlib.contextmanager
def merged_adapters(net, dtype: torch.dtype | None = None) -> Iterator[bool]:
    """Inside, `net`'s LoRA adapters are merged into its base weights, so a forward runs the plain layers
    (PEFT skips a merged adapter): generation decodes token by token, where every adapter's two extra
    matmuls cost as much as the layer's own. On exit the base weights are the very tensors they were,
    bit for bit. Yields whether it merged (`unmergeable` says why not; then nothing changes).

    With `dtype` (grpo.generation_dtype), every floating-point parameter is also replaced by a copy in
    that dtype (the merged weights cast as they are made, so the full-precision merged copy does not
    stay), and put back on exit: the model samples in bfloat16 while training keeps its float32 weights.
    Where the adapters cannot merge (DoRA), the adapters' own weights are cast too (merged, they are
    left as they are: unused).

    Written here because PEFT's merge_adapter / unmerge_adapter pair adds the adapter's product to the
    weight and subtracts it again, which rounds: the base would drift a little at every call, and a
    resumed run, which reloads the base, would no longer match an uninterrupted one. PEFT's safe merge
    writes each merged weight into a new tensor instead; the originals are kept and put back, and PEFT's
    record of what is merged is cleared. The cost: one more copy of the adapted weights while inside
    (in `dtype`, one copy of every weight in it)."""
    from peft.tuners.lora import LoraLayer

    mergeable = unmergeable(net) is None
    layers = [m for m in net.modules() if isinstance(m, LoraLayer)] if mergeable else []
    bases = [layer.get_base_layer().weight for layer in layers]
    # merged, the adapters' own weights are not used: left as they are (no copy)
    adapters = {id(p) for layer in layers for name, p in layer.named_parameters() if "lora_" in name}
    cast = [
        p
        for p in net.parameters()
        if dtype is not None and p.is_floating_point() and p.dtype != dtype and id(p) not in adapters
    ]
    # every parameter whose tensor changes inside, with that tensor: what is put back
    kept = {id(p): (p, p.data) for p in [*bases, *cast]}
    try:
        for layer, weight in zip(layers, bases, strict=True):
            layer.merge(safe_merge=True)
            if dtype is not None:  # cast as it is made: the float32 merged copy is dropped at once
                weight.data = weight.data.to(dtype)
        for p in cast:
            p.data = p.data.to(dtype)  # the merged weights are in dtype already: no copy
        yield mergeable
    finally:
        for p, data in kept.values():
            p.data = data
        for layer in layers:
            layer.merged_adapters.clear()
