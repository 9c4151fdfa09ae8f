"""Vision-language models (model.kind: vlm): the processor, and which parts of the model train.

A transformers image-text-to-text model (AutoModelForImageTextToText: Qwen2-VL / Qwen2.5-VL, SmolVLM /
Idefics3, Gemma 3, LLaVA, ...) is a vision tower, a projector into the language model's embeddings,
and the language model. By default only the language model trains: with LoRA, ``all-linear`` means
the language model's linear layers (PEFT's own all-linear would also adapt the vision tower's); the
vision tower and the projector are frozen unless model.train_vision_tower / model.train_projector say
otherwise (with LoRA the vision tower then gets adapters too, the projector trains fully as a module
to save). The parts are found by the attribute names its family's row gives them
(finetune.model.families); a model whose parts have other names is an error that names what was
looked for.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.model.families import family_for

logger = logging.getLogger(__name__)


def auto_processor(source: str, revision: str | None = None, trust_remote_code: bool = False):
    """The AutoProcessor at `source` (a folder or Hub id), checked to have an image processor; its
    tokenizer gets the processor's chat template when it has none of its own."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(
            source, revision=revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise FinetuneError(
            f"model.tokenizer_path: could not load a processor from {source!r} for model.kind vlm: {exc}. "
            "Point tokenizer_path (or model_path) at a folder with the processor's files (preprocessor_config.json, "
            "tokenizer, chat template) or a Hub id. Qwen2-VL processors need torchvision installed."
        ) from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise FinetuneError(
            f"model.tokenizer_path: {source!r} holds a {type(processor).__name__}, not a vision-language processor "
            "(an image processor and a tokenizer); model.kind vlm needs one"
        )
    if processor.tokenizer.chat_template is None:
        processor.tokenizer.chat_template = processor.chat_template
    return processor


def parts(net: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(vision tower module names, projector module names) of a VLM, outermost matches only: the
    modules named as its family's row says (finetune.model.families)."""
    family = family_for(net)
    towers, projectors = [], []
    for name, _ in net.named_modules():
        last = name.rsplit(".", 1)[-1]
        inside = any(name.startswith(p + ".") for p in towers + projectors)
        if last in family.towers and not inside:
            towers.append(name)
        elif last in family.projectors and not inside:
            projectors.append(name)
    if not towers:
        raise FinetuneError(
            f"model.kind vlm: no vision tower found in {type(net).__name__} (looked for modules named "
            f"{', '.join(family.towers)}, as the {family.name} row of finetune/model/families.py names "
            "them); is it an image-text-to-text model?"
        )
    return towers, projectors


def unquantized_modules(config: Any, *, trust_remote_code: bool = False) -> list[str]:
    """Module names QLoRA leaves unquantized in the VLM of `config`: the vision tower and the projector,
    plus what transformers leaves by default (the output head, tied weights), which a skip list
    replaces. Only the language model is 4-bit: the tower and projector are a small share of the
    weights, their image features feed every answer, and LoRA (train_vision_tower) or full training
    (train_projector) then works on ordinary weights. The names come from the model built on the meta
    device (no memory, no weights)."""
    from transformers import AutoModelForImageTextToText
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("meta"):
        net = AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)
    towers, projectors = parts(net)
    return sorted(set(towers + projectors + get_keys_to_not_convert(net)))


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def freeze(net: torch.nn.Module, *, train_vision_tower: bool, train_projector: bool) -> None:
    """Freeze the vision tower and the projector unless the recipe trains them (full fine-tuning; PEFT
    freezes the whole base itself)."""
    towers, projectors = parts(net)
    frozen = (towers if not train_vision_tower else []) + (projectors if not train_projector else [])
    for name, param in net.named_parameters():
        if _under(name, frozen):
            param.requires_grad_(False)


def hooked_input_embeddings(tower: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embeddings inside a vision tower that transformers' enable_input_require_grads hooks (it
    hooks those of every PreTrainedModel in the model, so a tower that is one gets hooked too)."""
    from transformers import PreTrainedModel

    found: list[torch.nn.Module] = []
    for module in tower.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        try:
            embeddings = module.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(embeddings, torch.nn.Module) and all(e is not embeddings for e in found):
            found.append(embeddings)
    return found


def keeps_input_grad(tower: torch.nn.Module, *, trains: bool) -> bool:
    """Whether training under gradient checkpointing leaves the tower's input embeddings hooked to make
    their output require grad: only a tower that trains (a trainable parameter in it, LoRA's included)
    keeps the hook, for its own gradients. A frozen tower's is removed (`release_frozen_towers`): with
    non-reentrant checkpointing nothing needs it, and it would make the tower keep every layer's input
    and recompute and differentiate itself in the backward for no gradient. The planner asks the same
    question (finetune.plan.inventory)."""
    return trains and bool(hooked_input_embeddings(tower))


# The names of the hooks transformers' enable_input_require_grads and PEFT's fallback register. Removed by
# name, not through the model's `_require_grads_hooks` handles (disable_input_require_grads): those
# handles are the last call's only, and PEFT calls enable_input_require_grads again on a model that has
# it (PeftModel.__init__, prepare_model_for_kbit_training), so earlier hooks have no handle left.
_REQUIRE_GRADS_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def release_frozen_towers(net: torch.nn.Module) -> list[str]:
    """Remove gradient checkpointing's input-require-grads hooks from each vision tower that trains
    nothing (`keeps_input_grad`); call it after checkpointing is enabled and PEFT wraps the model (both
    add the hook). The language model's hook stays. Returns the released towers' module names."""
    towers, _ = parts(net)
    released = []
    for name in towers:
        tower = net.get_submodule(name)
        trains = any(p.requires_grad for p in tower.parameters())
        if keeps_input_grad(tower, trains=trains):
            continue
        removed = 0
        for embeddings in hooked_input_embeddings(tower):
            hooks = embeddings._forward_hooks  # torch keeps no public listing of a module's hooks
            for key in [k for k, h in hooks.items() if getattr(h, "__name__", "") in _REQUIRE_GRADS_HOOKS]:
                del hooks[key]
                embeddings._forward_hooks_with_kwargs.pop(key, None)  # as RemovableHandle.remove does
                embeddings._forward_hooks_always_called.pop(key, None)
                removed += 1
        if removed:
            released.append(name)
    if released:
        logger.info("frozen vision tower(s) %s run no backward under checkpointing", ", ".join(released))
    return released


def lora_settings(
    net: torch.nn.Module,
    targets: Any,
    modules_to_save: list[str],
    *,
    train_vision_tower: bool,
    train_projector: bool,
) -> dict[str, Any]:
    """LoRA's target_modules and modules_to_save for a VLM: ``all-linear`` as the language model's linear
    layers (and the vision tower's with train_vision_tower), never the output head; the projector
    added to modules_to_save with train_projector. Explicit module names are passed through."""
    towers, projectors = parts(net)
    saved = list(modules_to_save or []) + (projectors if train_projector else [])
    if targets != "all-linear":
        return {"target_modules": targets, "modules_to_save": saved or None}
    head = net.get_output_embeddings()
    skipped = projectors + ([] if train_vision_tower else towers)
    names = [
        name
        for name, module in net.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and not _under(name, skipped)
    ]
    return {"target_modules": names, "modules_to_save": saved or None}


def load_processor(model: Any):
    """A vision-language model's processor (model.kind vlm) at model.tokenizer_source, its tokenizer with
    the recipe's chat template and special tokens (`with_recipe_tokens`)."""
    processor = auto_processor(model.tokenizer_source, model.revision, model.trust_remote_code)
    with_recipe_tokens(processor.tokenizer, model)
    return processor


def with_recipe_tokens(tokenizer: Any, model: Any):
    """`tokenizer` with the model section's chat template and special tokens (every tokenizer
    finetune.model loads goes through here)."""
    if model.resolved_chat_template is not None:
        tokenizer.chat_template = model.resolved_chat_template
    tokens = model.special_tokens
    named = {
        k: getattr(tokens, k)
        for k in ("bos_token", "eos_token", "pad_token", "unk_token")
        if getattr(tokens, k)
    }
    if named or tokens.additional_special_tokens:
        extra = (
            {"additional_special_tokens": tokens.additional_special_tokens}
            if tokens.additional_special_tokens
            else {}
        )
        added = tokenizer.add_special_tokens({**named, **extra})
        logger.info("special tokens set; %d new token(s) added to the vocabulary", added)
    return tokenizer


def block_classes(net: torch.nn.Module) -> list[str]:
    """Class names of a VLM's repeated blocks, the vision tower's encoder layers and the language model's
    decoder layers: what FSDP wraps as its units.

    transformers' ``_no_split_modules`` (what Accelerate wraps by default) is a device-map hint, not this
    list: Idefics3's names the vision attention rather than its encoder layer, and Gemma 3's and LLaVA's
    name SigLIP text-tower classes their models do not hold, which Accelerate refuses. The blocks are the
    items of the model's ModuleLists (one class each, with submodules) under the tower and the language
    model.
    """
    towers, projectors = parts(net)
    found: dict[str, set[str]] = {"tower": set(), "language model": set()}
    for name, module in net.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0 or _under(name, projectors):
            continue
        kinds = {type(item) for item in module}
        if len(kinds) == 1 and any(True for _ in module[0].children()):
            found["tower" if _under(name, towers) else "language model"].add(kinds.pop().__name__)
    missing = [where for where, classes in found.items() if not classes]
    if missing:
        raise FinetuneError(
            f"FSDP: no repeated blocks found in the {' and the '.join(missing)} of {type(net).__name__} to wrap; "
            "name them in your accelerate config's fsdp_config.fsdp_transformer_layer_cls_to_wrap"
        )
    return sorted(found["tower"] | found["language model"])


def scale_out_settings(net: torch.nn.Module, accelerator: Any) -> None:
    """Fill what Accelerate derives from a causal LM and gets wrong or cannot find on a VLM, before
    `accelerator.prepare`: FSDP's wrap classes (`block_classes`, unless the accelerate config names
    them) and DeepSpeed's hidden-size based ``auto`` buckets (a VLM's config keeps its hidden sizes in
    text_config and vision_config, where Accelerate does not look). A value the user set is kept."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        if plugin.transformer_cls_names_to_wrap is None and _transformer_policy(plugin.auto_wrap_policy):
            plugin.transformer_cls_names_to_wrap = block_classes(net)
        logger.info(
            "FSDP wraps %s", ", ".join(plugin.transformer_cls_names_to_wrap or ["(its policy's units)"])
        )
    elif kind == DistributedType.DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        hidden = max(
            getattr(getattr(net.config, key, None), "hidden_size", 0) or 0
            for key in ("text_config", "vision_config")
        )
        # The same sizes Accelerate gives a causal LM from its config.hidden_size.
        sizes = {
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        }
        for key, value in sizes.items():
            if zero.get(key) == "auto" and hidden:
                zero[key] = value


def _transformer_policy(policy: Any) -> bool:
    import functools

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = policy.func if isinstance(policy, functools.partial) else policy
    return policy is transformer_auto_wrap_policy
