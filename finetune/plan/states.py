"""Model states (weights, gradients, optimizer states, master copies) as this codebase holds them
(`model_states`), and how the engine spreads them over devices and the host (`shard_states`)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.accelerate_config import DistributedSetup
from finetune.plan.inventory import Adapter, ModelInventory, qlora_bytes_per_param
from finetune.recipe import Recipe

# ------------------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class States:
    """Bytes of the model states of one unsharded replica, before the engine shards them."""

    trainable_params: float
    weights: float  # trainable weights
    grads: float
    optimizer: float  # optimizer states plus the fp32 master copy where the engine keeps one
    frozen: float = 0.0  # frozen weights (LoRA base, 4-bit QLoRA base, modules_to_save originals)
    host_grad_bytes: float = 4.0  # per param: the fp32 gradient partition ZeRO-Offload keeps on the CPU
    weight_format: str = ""
    optimizer_format: str = ""


@dataclass(frozen=True)
class Layout:
    """How this codebase holds the model under one engine: state bytes and activation dtypes."""

    states: States
    residual_bytes: int  # hidden states between layers (fp32 when the embedding is fp32)
    compute_bytes: int  # matmul outputs: 2 under bf16/fp16 autocast
    autocast: bool  # accelerate wraps the forward in autocast (not under DeepSpeed)
    gather_bytes: int  # params all-gathered by ZeRO-3 / FSDP
    autocast_copies: float  # bf16 weight copies autocast keeps until the end of the forward
    notes: tuple[str, ...] = ()
    lora_bytes: int = 4  # LoRA weights: fp32 (PEFT upcasts them) unless DeepSpeed casts the model
    linear_out_bytes: int = 0  # Linear outputs when not the compute dtype (bitsandbytes 4-bit: input dtype)
    quant_bytes: float = 0.0  # bytes per 4-bit QLoRA weight (0 without QLoRA)


def _optimizer_bytes(name: str, params: float, weight_bytes: float) -> tuple[float, str]:
    """Optimizer state bytes for `params` trainable parameters stored in `weight_bytes` (total)."""
    if name == "adamw":  # torch AdamW: exp_avg and exp_avg_sq in the param's dtype
        return 2 * weight_bytes, "AdamW m+v in the weights' dtype"
    if name in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"):  # bitsandbytes: two uint8 states
        return 2 * params, "8-bit AdamW m+v, 2 B/param"
    if name == "sgd":
        return 0.0, "SGD without momentum: no state"  # unless optim_args sets momentum
    if name in ("lion_8bit", "paged_lion_8bit"):
        return params, "8-bit Lion momentum, 1 B/param"
    if name in ("lion_32bit", "paged_lion_32bit", "muon", "adagrad", "rmsprop", "schedule_free_sgd"):
        # One state per parameter (muon: Muon's momentum; AdamW's two on the few other weights ignored).
        return weight_bytes, f"{name}: one state in the weights' dtype"
    if name == "adafactor" or name.startswith(("galore_", "apollo_")):
        # Factored or low-rank states: far below AdamW's; counted as one state to stay on the safe side.
        return weight_bytes, f"{name}: factored/low-rank states, at most one state (estimate)"
    # AdamW-like (two moments) for the others: adamw_torch, ademamix (three: counted as two), ...
    return 2 * weight_bytes, f"{name}: two states in the weights' dtype (estimate)"


def model_states(
    inv: ModelInventory, adapter: Adapter, recipe: Recipe, engine: DistributedSetup, *, checkpointing: bool
) -> Layout:
    """The bytes this codebase holds, from finetune/model/, PEFT, accelerate and DeepSpeed:

    - without DeepSpeed, weights load in `weight_dtype` (auto + mixed precision: fp32 for full
      fine-tuning, the 16-bit compute dtype for a frozen LoRA base); autocast computes in bf16/fp16,
      so full fine-tuning holds 4P weights + 4P grads + 8P AdamW = 16P. PEFT keeps LoRA weights in
      fp32; QLoRA's prepare_model_for_kbit_training casts every non-4-bit weight to fp32.
      FSDP2 upcasts trainable weights to fp32 and all-gathers them in bf16 (MixedPrecisionPolicy).
    - DeepSpeed with bf16/fp16 casts the module to 16 bits and keeps an fp32 master copy plus the
      optimizer states in the optimizer: 2P + 2P + 12P for AdamW (the ZeRO paper's figures).
    """
    train, lora = recipe.train, recipe.lora
    mixed = train.mixed_precision != "no"
    quant = qlora_bytes_per_param(lora.double_quant) if lora.enable_qlora else None
    quantized = sum(m.num_params for m in inv.linears(include_output=False)) if quant else 0
    full = not lora.enable_lora
    # A VLM's vision tower and projector stay frozen under full fine-tuning unless the recipe trains them.
    vision_frozen = frozen_vision_params(inv, recipe)
    trainable = inv.total - vision_frozen if full else adapter.trainable
    notes: list[str] = []
    if engine.kind == "deepspeed":
        w = 2 if mixed else 4
        weights = w * trainable
        frozen = w * vision_frozen if full else quantized * (quant or 0) + w * (inv.total - quantized)
        opt, opt_format = _optimizer_bytes(train.optimizer, trainable, 4 * trainable)
        # ZeRO's optimizer keeps an fp32 copy of its partition, the master weights under mixed precision.
        master = 4 * trainable if mixed or engine.zero_stage > 0 else 0.0
        opt_format = ("fp32 master + " if master else "") + opt_format.replace("the weights' dtype", "fp32")
        layout_bytes = (w, w, False, w)
        dtype_name = train.mixed_precision if mixed else "fp32"
        weight_format = f"{dtype_name} weights" if full else f"{dtype_name} base and LoRA"
        weight_format = f"4-bit base (rest {dtype_name}), {dtype_name} LoRA" if quant else weight_format
        if mixed:
            notes.append("DeepSpeed casts the model to 16 bits; the optimizer holds fp32 master weights")
        return Layout(
            States(trainable, weights, w * trainable, opt + master, frozen, 4.0, weight_format, opt_format),
            *layout_bytes,
            autocast_copies=0.0,
            notes=tuple(notes),
            lora_bytes=w,
            quant_bytes=quant or 0.0,
        )
    from finetune.model.build import DTYPES, weight_dtype

    dtype = weight_dtype(recipe.model, lora, train.mixed_precision)
    w, w_name = dtype.itemsize, next(name for name, d in DTYPES.items() if d == dtype)
    fsdp_mixed = engine.kind == "fsdp" and mixed
    if full:
        tw = 4 if fsdp_mixed else w
        weights, frozen = tw * trainable, w * vision_frozen
        weight_format = f"{'fp32' if tw == 4 else w_name} weights"
    else:
        base = 4 if quant else w  # QLoRA: prepare_model_for_kbit_training casts non-4-bit weights to fp32
        saved_w = 4 if fsdp_mixed else base
        weights = 4 * adapter.lora_params + saved_w * adapter.saved_params
        frozen = quantized * (quant or 0) + base * (inv.total - quantized)
        base_name = "4-bit base (rest fp32)" if quant else f"{'fp32' if base == 4 else w_name} base"
        weight_format = f"{base_name} frozen, fp32 LoRA"
    opt, opt_format = _optimizer_bytes(train.optimizer, trainable, weights)
    states = States(trainable, weights, weights, opt, frozen, 4.0, weight_format, opt_format)
    compute = 2 if mixed else w
    residual = 2 if fsdp_mixed else (4 if quant else w)
    copies = 0.0 if fsdp_mixed or not mixed else _autocast_copies(inv, adapter, recipe, w, checkpointing)
    if copies:
        notes.append("autocast keeps a bf16 copy of every fp32 weight a matmul uses until the forward ends")
    gather = 2 if fsdp_mixed else w
    # bitsandbytes' Linear4bit returns its input's dtype: the fp32 residual under QLoRA.
    linear_out = residual if quant else compute
    return Layout(states, residual, compute, mixed, gather, copies, tuple(notes), 4, linear_out, quant or 0.0)


def frozen_vision_params(inv: ModelInventory, recipe: Recipe) -> int:
    """Vision tower and projector parameters full fine-tuning leaves frozen (0 for an LLM)."""
    if inv.vision is None:
        return 0
    return inv.vision.frozen_params(recipe.model.train_vision_tower, recipe.model.train_projector)


def _autocast_copies(
    inv: ModelInventory, adapter: Adapter, recipe: Recipe, w: int, checkpointing: bool
) -> float:
    """Bytes of the 16-bit weight copies autocast makes for fp32 matmul weights. Trainable ones are
    cached until the autocast region ends (the end of the forward, checkpointing or not); frozen ones
    are saved for backward, so checkpointing drops those inside the decoder layers."""
    lora = recipe.lora
    matmul = sum(m.num_params for m in inv.linears())
    head = sum(m.num_params for m in inv.linears() if m.layer is None)
    if not lora.enable_lora:
        vision = inv.vision
        if vision is not None:  # the trained vision tower's and projector's linears are cast too
            model = recipe.model
            matmul += sum(m.num_params for m in vision.tower_linears) if model.train_vision_tower else 0
            matmul += sum(m.num_params for m in vision.projector_linears) if model.train_projector else 0
        return 2.0 * matmul if w == 4 else 0.0
    base = 4 if lora.enable_qlora else w
    trainable = adapter.lora_params + (adapter.saved_matmul_params if base == 4 else 0)
    frozen = 0
    if base == 4:  # frozen fp32 weights (QLoRA: only lm_head stays unquantized)
        frozen = head if lora.enable_qlora or checkpointing else matmul
    return 2.0 * (trainable + frozen)


@dataclass(frozen=True)
class Part:
    """One line of the plan: bytes on each GPU and in host RAM (per GPU process)."""

    name: str
    gpu_bytes: float
    host_bytes: float = 0.0
    note: str = ""
    nvme_bytes: float = 0.0


def shard_states(states: States, engine: DistributedSetup) -> list[Part]:
    """Weights, gradients and optimizer states per device under the engine's sharding and offload.

    ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 and FSDP also weights (frozen ones
    too); DDP and a single device shard nothing. ZeRO-Offload keeps optimizer states and an fp32
    gradient partition on the host (GPU gradients only pass through buckets); offload_param moves
    the weight shards there too. FSDP CPU offload moves weights, gradients and optimizer states.
    """
    n = engine.shard_degree
    stage = engine.zero_stage if engine.kind in ("deepspeed", "fsdp") else 0
    fsdp = engine.kind == "fsdp"
    sharded = {
        "weights": stage == 3 or (fsdp and stage >= 2),
        "gradients": stage >= 2,
        "optimizer states": stage >= 1,
    }
    full = {
        "weights": states.weights + states.frozen,
        "gradients": states.grads,
        "optimizer states": states.optimizer,
    }
    parts = {k: [v / n if sharded[k] else v, 0.0] for k, v in full.items()}
    w, o = parts["weights"][0], parts["optimizer states"][0]
    if fsdp and engine.offloaded:
        parts = {k: [0.0, v[0]] for k, v in parts.items()}
    elif engine.kind == "deepspeed":
        if engine.offload_optimizer != "none":
            parts["optimizer states"] = [0.0, o]
            parts["gradients"] = [0.0, states.host_grad_bytes * states.trainable_params / n]
        if engine.offload_params != "none":
            parts["weights"] = [0.0, w]
    notes = {
        "weights": states.weight_format,
        "gradients": "the trainable weights' dtype"
        if engine.kind != "deepspeed"
        else ("fp32 partition on the host" if engine.offload_optimizer != "none" else "weights' dtype"),
        "optimizer states": states.optimizer_format,
    }
    out = []
    for name, (gpu, host) in parts.items():
        nvme = 0.0
        offload = engine.offload_params if name == "weights" else engine.offload_optimizer
        if host and offload == "nvme":
            host, nvme = 0.0, host
        note = notes[name] + (f", sharded /{n}" if sharded[name] and n > 1 else "")
        out.append(Part(name, gpu, host, note, nvme))
    return out


def gathered_bytes(
    inv: ModelInventory, layout: Layout, engine: DistributedSetup, trainable_fraction: float
) -> Part | None:
    """The unsharded working set of ZeRO-3 / FSDP: one unit in use plus one prefetched, and one
    layer's unsharded gradients before the reduce-scatter. FSDP2's root unit (embeddings, final norm,
    lm_head) stays gathered from forward to backward; FSDP without reshard-after-forward keeps every
    layer gathered."""
    b, q = layout.gather_bytes, layout.quant_bytes
    grads = b * inv.layer_params * trainable_fraction
    # QLoRA's 4-bit linears travel packed (their storage is the 16-bit dtype, q bytes per weight).
    layer_linear = inv.layer_linear_params if q else 0
    layer = q * layer_linear + b * (inv.layer_params - layer_linear)
    if engine.kind == "fsdp" and engine.zero_stage == 2:
        linear = sum(m.num_params for m in inv.linears(include_output=False)) if q else 0
        everything = q * linear + b * (inv.total - linear)
        return Part("gathered params", everything + grads, note="no reshard after forward: all layers")
    if engine.kind == "fsdp" and engine.zero_stage == 3:
        gpu = b * inv.non_layer_params + 2 * layer + grads
        return Part("gathered params", gpu, note="root unit + 2 layers + 1 layer's grads")
    if engine.kind == "deepspeed" and engine.zero_stage == 3:
        unit = max(layer, b * inv.embedding_params)
        return Part("gathered params", 2 * unit + grads, note="2 largest units + 1 layer's grads")
    return None
