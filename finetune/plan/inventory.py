"""The model's inventory for the planner: parameter counts and shapes from its config on the meta
device (`inspect_model`), and what LoRA/QLoRA adds or changes (`adapter_counts`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from finetune.errors import FinetuneError
from finetune.model.families import VisionFamily, family_for
from finetune.recipe import LoraSection, ModelSection

GiB = 2**30
# CUDA context (~0.5 GiB on an H100) plus what the caching allocator loses to fragmentation, NCCL and
# DeepSpeed communication buckets: a flat allowance, not a measurement.
CUDA_ALLOWANCE_BYTES = 1 * GiB
DEFAULT_GPU_MEMORY = 80 * GiB
QLORA_BLOCKSIZE = 64  # bitsandbytes 4-bit: one absmax constant per 64 weights
QLORA_DOUBLE_QUANT_GROUP = 256  # double quant: 8-bit absmax, one fp32 constant per 256 blocks
_MEMORY_UNITS = {
    "b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20,
    "gb": 10**9, "gib": 2**30, "tb": 10**12, "tib": 2**40,
}  # fmt: skip


def gib_text(nbytes: float) -> str:
    """Bytes as GiB for tables; small sizes keep three significant digits.

    >>> gib_text(3 * GiB), gib_text(0.0123 * GiB)
    ('3.00', '0.0123')
    """
    gib = nbytes / GiB
    return f"{gib:.2f}" if gib >= 0.995 or gib == 0 else f"{gib:.3g}"  # tiny models: keep digits


# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class VisionInventory:
    """A vision-language model's vision tower and projector: parameters, linear layers and the
    tower's shape (transformer encoder layers over image patches)."""

    tower_params: int
    projector_params: int
    tower_linears: tuple[Module, ...]
    projector_linears: tuple[Module, ...]
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    image_size: int  # the tower's input side (0 when it takes any size, as Qwen2-VL's)
    model_type: str  # the model's (its config's model_type)
    family: VisionFamily  # what the planner asks about its images (finetune.model.families)
    merge: int  # patches per image token (the family's merge: Idefics3's scale_factor^2, Qwen2-VL's ...)
    # Whether a frozen tower's input requires grad under gradient checkpointing (transformers'
    # enable_input_require_grads hooks every sub-model's input embeddings, the tower's too), which would
    # make it run a backward; training removes that hook (finetune.model.vlm.release_frozen_towers).
    checkpointing_input_grad: bool = True

    def frozen_params(self, train_vision_tower: bool, train_projector: bool) -> int:
        """Parameters full fine-tuning leaves frozen (finetune.model.vlm.freeze)."""
        return (0 if train_vision_tower else self.tower_params) + (
            0 if train_projector else self.projector_params
        )


@dataclass(frozen=True)
class Module:
    """One module of the model: dotted name, type, shape and the parameters under it."""

    name: str
    kind: str  # linear | embedding | other
    num_params: int  # all parameters under it (tied ones once)
    in_features: int = 0  # embedding: num_embeddings
    out_features: int = 0  # embedding: embedding_dim
    layer: int | None = None  # index of the decoder layer it belongs to


@dataclass(frozen=True)
class ModelInventory:
    """Parameter counts and shapes of the base model, from its config built on the meta device."""

    total: int  # unique parameters (tied embeddings counted once)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    layer_params: int  # the largest decoder layer
    embedding_params: int
    output_name: str | None  # lm_head, excluded from `all-linear` as PEFT does
    modules: tuple[Module, ...] = ()  # the language model's (a VLM's vision parts are in `vision`)
    vision: VisionInventory | None = None  # vision-language models (model.kind vlm)

    @property
    def non_layer_params(self) -> int:
        """Embeddings, final norm and lm_head (and a VLM's vision tower and projector, which the planner
        counts in FSDP's root unit): what FSDP's root unit holds."""
        return self.total - sum(m.num_params for m in self.modules if m.kind == "layer")

    @property
    def layer_linear_params(self) -> int:
        """nn.Linear parameters in the first decoder layer (what QLoRA stores in 4 bits)."""
        first = next((m.layer for m in self.modules if m.kind == "layer"), None)
        return sum(m.num_params for m in self.linears() if first is not None and m.layer == first)

    def linears(self, *, include_output: bool = True) -> list[Module]:
        return [
            m for m in self.modules if m.kind == "linear" and (include_output or m.name != self.output_name)
        ]


def load_model_config(model: ModelSection):
    """The transformers config of the recipe's model (config_path mapping or path, else model_path)."""
    from finetune.model.build import _load_config

    try:
        return _load_config(model)
    except FinetuneError as exc:
        raise FinetuneError(
            f"{exc}. The planner needs only the config: point --model.config_path at a local folder with "
            "config.json or give the fields inline, e.g. --model.config_path '{model_type: llama, "
            "hidden_size: 4096, ...}' (then also --model.tokenizer_path)"
        ) from None


def inspect_model(model: ModelSection) -> ModelInventory:
    """Build the model on the meta device (no weights, no download) and count its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = load_model_config(model)
    vlm = getattr(model, "kind", "llm") == "vlm"
    auto, what = (
        (AutoModelForImageTextToText, "an image-text-to-text model")
        if vlm
        else (AutoModelForCausalLM, "a causal LM")
    )
    try:
        with torch.device("meta"):
            net = auto.from_config(
                config, attn_implementation="eager", trust_remote_code=model.trust_remote_code
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise FinetuneError(f"model config: could not build {what} from it: {exc}") from None
    return inventory_of(net, vision_language=vlm)


def inventory_of(net, *, vision_language: bool = False) -> ModelInventory:
    """Counts and shapes of a built model (any device, meta included); a vision-language model's
    vision tower and projector (finetune.model.vlm.parts) go in `vision`, the rest is the language model."""
    import torch

    config = net.config
    skipped: list[str] = []
    vision = None
    if vision_language:
        vision, skipped = _vision_inventory(net)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [f for f in fields if not getattr(text, f, None)]
    if missing:
        raise FinetuneError(
            f"model config ({type(config).__name__}) lacks {', '.join(missing)}: the planner handles "
            "Llama-style decoder models"
        )
    # A VLM's own list may name only vision classes (Idefics3): its language model's list names the layers.
    layer_classes = {c for m in net.modules() for c in (getattr(type(m), "_no_split_modules", None) or ())}
    output = net.get_output_embeddings()
    modules: list[Module] = []
    layer: Module | None = None  # the decoder layer being walked (named_modules is depth-first)
    output_name = None
    for name, module in net.named_modules():
        if layer is not None and not name.startswith(layer.name + "."):
            layer = None
        if not name or any(name == p or name.startswith(p + ".") for p in skipped):
            continue
        if type(module).__name__ in layer_classes:
            layer = Module(name, "layer", _count(module), layer=sum(m.kind == "layer" for m in modules))
            modules.append(layer)
            continue
        if module is output:
            output_name = name
        if isinstance(module, torch.nn.Linear):
            kind, dims = "linear", (module.in_features, module.out_features)
        elif isinstance(module, torch.nn.Embedding):
            kind, dims = "embedding", (module.num_embeddings, module.embedding_dim)
        else:
            kind, dims = "other", (0, 0)
        modules.append(Module(name, kind, _count(module), *dims, layer=layer.layer if layer else None))
    layers = [m for m in modules if m.kind == "layer"]
    heads = text.num_attention_heads
    return ModelInventory(
        total=_count(net),
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
        tied=output is not None and output.weight is net.get_input_embeddings().weight,
        layer_params=max((m.num_params for m in layers), default=0),
        embedding_params=_count(net.get_input_embeddings()),
        output_name=output_name,
        modules=tuple(modules),
        vision=vision,
    )


def _vision_inventory(net) -> tuple[VisionInventory, list[str]]:
    """The vision tower and projector of a VLM, and their module names (skipped by the LM walk)."""
    import torch

    from finetune.model.vlm import parts

    towers, projectors = parts(net)

    def linears(prefixes: list[str]) -> tuple[Module, ...]:
        return tuple(
            Module(name, "linear", _count(m), m.in_features, m.out_features)
            for name, m in net.named_modules()
            if isinstance(m, torch.nn.Linear) and any(name.startswith(p + ".") for p in prefixes)
        )

    def params(prefixes: list[str]) -> int:
        return sum(_count(net.get_submodule(p)) for p in prefixes)

    vc = net.config.vision_config
    family = family_for(net.config)
    heads = getattr(vc, "num_attention_heads", None) or getattr(vc, "num_heads", None)
    hidden = getattr(vc, "embed_dim", None) or getattr(vc, "hidden_size", None)  # Qwen2-VL: embed_dim
    inter = getattr(vc, "intermediate_size", None) or int(hidden * getattr(vc, "mlp_ratio", 4))
    layers = getattr(vc, "num_hidden_layers", None) or getattr(vc, "depth", None)
    if not (heads and hidden and layers and getattr(vc, "patch_size", None)):
        raise FinetuneError(
            f"model config: vision_config ({type(vc).__name__}) lacks hidden_size, num_hidden_layers/depth, "
            "num_attention_heads/num_heads or patch_size: the planner counts ViT-style vision towers"
        )
    vision = VisionInventory(
        tower_params=params(towers),
        projector_params=params(projectors),
        tower_linears=linears(towers),
        projector_linears=linears(projectors),
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=heads,
        patch_size=vc.patch_size,
        image_size=getattr(vc, "image_size", 0) or 0,
        model_type=getattr(net.config, "model_type", "") or "",
        family=family,
        merge=family.merge(net.config),
        checkpointing_input_grad=_input_embeddings_hooked(net, towers),
    )
    return vision, towers + projectors


def _input_embeddings_hooked(net, towers: list[str]) -> bool:
    """Whether gradient checkpointing leaves a frozen vision tower's output needing a gradient in training:
    transformers' activation_checkpointing_enable (and PEFT's) hooks the input embeddings of every
    PreTrainedModel inside the model, a tower that is one included, and training removes a frozen
    tower's hook again (finetune.model.vlm.release_frozen_towers): the same `keeps_input_grad` decides."""
    from finetune.model.vlm import keeps_input_grad

    return any(keeps_input_grad(net.get_submodule(name), trains=False) for name in towers)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------- LoRA


@dataclass(frozen=True)
class Adapter:
    """What PEFT adds and trains for a LoraSection (all zero without LoRA)."""

    lora_params: int = 0  # A and B matrices, r * (in + out) per adapted module (+ DoRA magnitudes)
    saved_params: int = 0  # modules_to_save: PEFT trains a full copy, the original stays frozen
    saved_matmul_params: int = 0  # of which nn.Linear weights (autocast casts them)
    targets: tuple[Module, ...] = ()  # adapted modules
    rank: int = 0

    @property
    def trainable(self) -> int:
        return self.lora_params + self.saved_params


def adapter_counts(inv: ModelInventory, lora: LoraSection, model: ModelSection | None = None) -> Adapter:
    """LoRA parameters PEFT would add: `all-linear` = every nn.Linear but the output layer, a list =
    modules named so or ending in `.name`; modules inside modules_to_save are not adapted. A VLM
    (finetune.model.vlm.lora_settings): `all-linear` is the language model's linears, plus the vision tower's
    with model.train_vision_tower; the projector is a module to save with model.train_projector."""
    if not lora.enable_lora:
        return Adapter()
    vision = inv.vision
    tower = vision is not None and model is not None and model.train_vision_tower
    projector = vision is not None and model is not None and model.train_projector
    saved = _modules_to_save(inv, lora.modules_to_save)
    in_saved = [re.compile(rf"(^|.*\.){re.escape(m)}($|\..*)") for m in lora.modules_to_save]
    if lora.lora_target_modules == "all-linear":
        chosen = inv.linears(include_output=False) + (list(vision.tower_linears) if tower else [])
    else:
        wanted = lora.lora_target_modules
        every = list(inv.modules) + (list(vision.tower_linears + vision.projector_linears) if vision else [])
        chosen = [m for m in every if any(m.name == t or m.name.endswith("." + t) for t in wanted)]
        if not chosen:
            raise FinetuneError(f"lora.lora_target_modules: no module of the model is named {wanted}")
        bad = sorted({m.name for m in chosen if m.kind not in ("linear", "embedding")})
        if bad:
            raise FinetuneError(
                f"lora.lora_target_modules: {', '.join(bad[:3])} are not Linear or Embedding layers, "
                "which is what LoRA adapts"
            )
    targets = tuple(m for m in chosen if not any(p.match(m.name) for p in in_saved))
    rank = lora.lora_rank
    params = sum(rank * (m.in_features + m.out_features) for m in targets)
    if lora.use_dora:  # one magnitude per output feature
        params += sum(m.out_features for m in targets)
    return Adapter(
        lora_params=params,
        saved_params=sum(m.num_params for m in saved) + (vision.projector_params if projector else 0),
        saved_matmul_params=sum(
            sub.num_params
            for m in saved
            for sub in inv.modules
            if sub.kind == "linear" and (sub.name == m.name or sub.name.startswith(m.name + "."))
        )
        + (sum(m.num_params for m in vision.projector_linears) if projector else 0),
        targets=targets,
        rank=rank,
    )


def _modules_to_save(inv: ModelInventory, names: list[str]) -> list[Module]:
    """Outermost modules whose name ends with one of `names` (PEFT's match)."""
    found: list[Module] = []
    for m in inv.modules:
        inside = any(m.name.startswith(f.name + ".") for f in found)
        if m.name and not inside and any(m.name.endswith(n) for n in names):
            found.append(m)
    return found


def qlora_bytes_per_param(double_quant: bool) -> float:
    """Bytes per 4-bit weight: 0.5 for the packed nibble plus the block constants. Blocks of 64 weights
    carry an fp32 absmax (4/64 B/param); with double quant the absmax is 8-bit (1/64) plus one fp32
    second-level constant per 256 blocks (4/(64*256))."""
    if double_quant:
        return 0.5 + 1 / QLORA_BLOCKSIZE + 4 / (QLORA_BLOCKSIZE * QLORA_DOUBLE_QUANT_GROUP)
    return 0.5 + 4 / QLORA_BLOCKSIZE
