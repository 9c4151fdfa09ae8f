"""`finetune plan`: per-GPU memory of a recipe by part, whether it fits, and a micro-batch suggestion.

Nothing is loaded or downloaded: the model is built on the meta device from its config, and every
figure comes from parameter counts and the model's shapes.

Model states follow what this codebase holds (`model_states`), sharded as the engine of the
accelerate config does (`shard_states`). Under DeepSpeed they reproduce the ZeRO paper
(Rajbhandari et al. 2020, section 3) for mixed-precision Adam with P parameters and N devices:
baseline 16P bytes, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N.
Activations count what autograd saves for a Llama-style decoder layer (`activation_bytes`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from finetune.distributed import resolve_ds_config_file
from finetune.errors import FinetuneError
from finetune.recipe import LoraSection, ModelSection, Recipe

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


# -------------------------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class Engine:
    """How the model states are spread over devices, read from an accelerate config.

    `zero_stage` is DeepSpeed's stage; for FSDP 3 = full shard (params resharded after forward),
    2 = params kept unsharded between forward and backward (SHARD_GRAD_OP / reshard_after_forward
    false), 0 = NO_SHARD. Offload devices are "none", "cpu" or "nvme".
    """

    kind: str = "single"  # single | ddp | deepspeed | fsdp
    num_gpus: int = 1  # processes over all nodes (accelerate's num_processes)
    num_nodes: int = 1
    zero_stage: int = 0
    hybrid: bool = False  # FSDP: shard within a node, replicate across nodes
    shard_size: int | None = None  # FSDP: explicit shard group (parallelism_config dp_shard_size)
    offload_optimizer: str = "none"
    offload_params: str = "none"
    fsdp_version: int = 2
    on_cpu: bool = False
    config: str | None = None

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.num_gpus // self.num_nodes)

    @property
    def shard_degree(self) -> int:
        """N: how many devices share one copy of the sharded states."""
        if self.kind == "deepspeed" and self.zero_stage > 0:
            return self.num_gpus
        if self.kind == "fsdp" and self.zero_stage > 0:
            if self.shard_size:
                return min(self.shard_size, self.num_gpus)
            return self.gpus_per_node if self.hybrid else self.num_gpus
        return 1

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @property
    def name(self) -> str:
        """Short name, the one the shipped configs use where one exists (zero3_offload, fsdp2_hybrid)."""
        if self.kind == "deepspeed":
            return f"zero{self.zero_stage}" + ("_offload" if self.offloaded else "")
        if self.kind == "fsdp":
            shard = {0: "_no_shard", 2: "_no_reshard", 3: ""}[self.zero_stage]
            hybrid = "_hybrid" if self.hybrid or (self.shard_size or self.num_gpus) < self.num_gpus else ""
            return f"fsdp{self.fsdp_version}{shard}{hybrid}" + ("_offload" if self.offloaded else "")
        return self.kind

    def describe(self) -> str:
        """One line: the name, what is sharded how many ways, offload, and where it runs."""
        n, stage = self.shard_degree, self.zero_stage
        what = {"single": "one device, nothing sharded", "ddp": "DDP: every state replicated"}.get(
            self.kind, ""
        )
        if self.kind == "deepspeed":
            sharded = ("", "optimizer states", "gradients and optimizer states", "all states")[stage]
            what = f"DeepSpeed ZeRO-{stage}: {sharded} sharded {n} ways" if stage else "DeepSpeed, no ZeRO"
        elif self.kind == "fsdp":
            hybrid = " within each node, replicated across nodes" if n < self.num_gpus else ""
            what = f"FSDP{self.fsdp_version}: all states sharded {n} ways{hybrid}"
            what = what if stage else f"FSDP{self.fsdp_version} NO_SHARD: every state replicated"
        for part, device in (("optimizer", self.offload_optimizer), ("params", self.offload_params)):
            what += f"; {part} offloaded to {device}" if device != "none" else ""
        device = "CPU process" if self.on_cpu else "GPU"
        return f"{self.name} ({what}) on {_plural(self.num_gpus, device)}, {_plural(self.num_nodes, 'node')}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "es" if word.endswith("s") else "s")


def read_engine(config: Path | None, *, num_gpus: int | None = None, num_nodes: int | None = None) -> Engine:
    """The engine an accelerate config file selects (None = one device); --num-gpus/--num-nodes win.

    distributed_type NO / MULTI_GPU / MULTI_CPU -> single or DDP, FSDP -> `fsdp_config`,
    DEEPSPEED -> `deepspeed_config` (zero_stage, offload_*_device) or the DeepSpeed JSON its
    `deepspeed_config_file` names (zero_optimization.stage, offload_optimizer/offload_param.device).
    """
    data = _read_mapping(config) if config is not None else {}
    kind = str(data.get("distributed_type", "NO")).upper()
    processes = int(num_gpus or data.get("num_processes") or 1)
    nodes = int(num_nodes or data.get("num_machines") or 1)
    if processes < 1 or nodes < 1 or processes % nodes:
        raise FinetuneError(
            f"{processes} processes cannot be spread evenly over {nodes} nodes: "
            "--num-gpus counts GPUs over all nodes and must be a multiple of --num-nodes"
        )
    common: dict[str, Any] = {
        "num_gpus": processes,
        "num_nodes": nodes,
        "on_cpu": kind == "MULTI_CPU" or _truthy(data.get("use_cpu")),
        "config": str(config) if config is not None else None,
    }
    if kind == "DEEPSPEED":
        return Engine(kind="deepspeed", **common, **_deepspeed_settings(data, config))
    if kind == "FSDP":
        settings = _fsdp_settings(data, processes)
        if settings["hybrid"] and (num_gpus or num_nodes):  # the config's group sizes no longer apply
            settings["shard_size"] = None
        return Engine(kind="fsdp", **common, **settings)
    if kind in ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU"):
        return Engine(kind="ddp" if processes > 1 else "single", **common)
    raise FinetuneError(
        f"{config}: distributed_type {kind} is not one the planner knows (NO, MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED)"
    )


def _read_mapping(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))  # JSON is YAML too
    except (OSError, yaml.YAMLError) as exc:
        raise FinetuneError(f"could not read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise FinetuneError(f"{path}: expected a mapping of settings")
    return data


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "yes", "1")


def _offload_device(value: Any, where: str) -> str:
    device = "none" if value in (None, False) else str(value).lower()
    if device not in ("none", "cpu", "nvme"):
        raise FinetuneError(f"{where}: offload device {value!r} is not one of none, cpu, nvme")
    return device


def _deepspeed_settings(data: dict, config: Path | None) -> dict[str, Any]:
    ds = data.get("deepspeed_config") or {}
    file = ds.get("deepspeed_config_file")
    if file:
        json_path = resolve_ds_config_file(str(file), relative_to=Path(config).parent if config else None)
        zero = _read_mapping(json_path).get("zero_optimization") or {}
        stage = zero.get("stage", 0)
        optimizer = (zero.get("offload_optimizer") or {}).get("device")
        params = (zero.get("offload_param") or {}).get("device")
        where = str(json_path)
    else:
        stage, where = ds.get("zero_stage", 0), str(config)
        optimizer, params = ds.get("offload_optimizer_device"), ds.get("offload_param_device")
    if str(stage) not in ("0", "1", "2", "3"):
        raise FinetuneError(f"{where}: ZeRO stage {stage!r} is not 0, 1, 2 or 3")
    settings = {
        "zero_stage": int(stage),
        "offload_optimizer": _offload_device(optimizer, where),
        "offload_params": _offload_device(params, where),
    }
    if settings["offload_params"] != "none" and settings["zero_stage"] != 3:
        raise FinetuneError(f"{where}: offload_param needs ZeRO stage 3 (got stage {stage})")
    if settings["offload_optimizer"] != "none" and settings["zero_stage"] == 0:
        raise FinetuneError(f"{where}: offload_optimizer needs ZeRO stage 1, 2 or 3")
    return settings


# FSDP1 sharding strategies (names or accelerate's 1-based numbers) -> (zero-like stage, hybrid).
_FSDP_STRATEGIES = {
    "FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False),
    "HYBRID_SHARD": (3, True), "HYBRID_SHARD_ZERO2": (2, True),
    "1": (3, False), "2": (2, False), "3": (0, False), "4": (3, True), "5": (2, True),
    "TRUE": (3, False), "FALSE": (2, False),
}  # fmt: skip


def _fsdp_settings(data: dict, processes: int) -> dict[str, Any]:
    fsdp = data.get("fsdp_config") or {}
    version = int(fsdp.get("fsdp_version", 1))
    # FSDP2 reads fsdp_reshard_after_forward; FSDP1 (and old FSDP2 configs) fsdp_sharding_strategy.
    raw = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"))
    strategy = _FSDP_STRATEGIES.get(str(raw).upper())
    if strategy is None:
        raise FinetuneError(f"fsdp_config: unknown sharding setting {raw!r} (e.g. FULL_SHARD, HYBRID_SHARD)")
    stage, hybrid = strategy
    parallel = {
        k.removeprefix("parallelism_config_"): v for k, v in (data.get("parallelism_config") or {}).items()
    }
    replicate = int(parallel.get("dp_replicate_size") or 1)
    shard_size = int(parallel["dp_shard_size"]) if parallel.get("dp_shard_size") else None
    if replicate > 1:
        hybrid, shard_size = True, shard_size or max(1, processes // replicate)
    offload = "cpu" if _truthy(fsdp.get("fsdp_offload_params")) else "none"
    return {
        "zero_stage": stage,
        "hybrid": hybrid,
        "shard_size": shard_size,
        "fsdp_version": version,
        "offload_optimizer": offload,
        "offload_params": offload,
    }


# --------------------------------------------------------------------------------------------- model


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
    modules: tuple[Module, ...] = ()

    @property
    def non_layer_params(self) -> int:
        """Embeddings, final norm and lm_head: what FSDP's root unit holds."""
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
    from finetune.model import _load_config

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
    from transformers import AutoModelForCausalLM

    config = load_model_config(model)
    try:
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(
                config, attn_implementation="eager", trust_remote_code=model.trust_remote_code
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise FinetuneError(f"model config: could not build a causal LM from it: {exc}") from None
    return inventory_of(net)


def inventory_of(net) -> ModelInventory:
    """Counts and shapes of a built model (any device, meta included)."""
    import torch

    config = net.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [f for f in fields if not getattr(text, f, None)]
    if missing:
        raise FinetuneError(
            f"model config ({type(config).__name__}) lacks {', '.join(missing)}: the planner handles "
            "Llama-style decoder models"
        )
    layer_classes = set(getattr(net, "_no_split_modules", None) or ())
    output = net.get_output_embeddings()
    modules: list[Module] = []
    layer: Module | None = None  # the decoder layer being walked (named_modules is depth-first)
    output_name = None
    for name, module in net.named_modules():
        if layer is not None and not name.startswith(layer.name + "."):
            layer = None
        if not name:
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
    )


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


def adapter_counts(inv: ModelInventory, lora: LoraSection) -> Adapter:
    """LoRA parameters PEFT would add: `all-linear` = every nn.Linear but the output layer, a list =
    modules named so or ending in `.name`; modules inside modules_to_save are not adapted."""
    if not lora.enable_lora:
        return Adapter()
    saved = _modules_to_save(inv, lora.modules_to_save)
    in_saved = [re.compile(rf"(^|.*\.){re.escape(m)}($|\..*)") for m in lora.modules_to_save]
    if lora.lora_target_modules == "all-linear":
        chosen = inv.linears(include_output=False)
    else:
        wanted = lora.lora_target_modules
        chosen = [m for m in inv.modules if any(m.name == t or m.name.endswith("." + t) for t in wanted)]
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
        saved_params=sum(m.num_params for m in saved),
        saved_matmul_params=sum(
            sub.num_params
            for m in saved
            for sub in inv.modules
            if sub.kind == "linear" and (sub.name == m.name or sub.name.startswith(m.name + "."))
        ),
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
    logits_bytes: int  # logits held by the model output through backward
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
    if name == "adamw_8bit":  # bitsandbytes: two uint8 states (block constants ignored)
        return 2 * params, "8-bit AdamW m+v, 2 B/param"
    return 0.0, "SGD without momentum: no state"  # finetune/optim.py builds SGD(lr) only


def model_states(
    inv: ModelInventory, adapter: Adapter, recipe: Recipe, engine: Engine, *, checkpointing: bool
) -> Layout:
    """The bytes this codebase holds, from finetune/model.py, PEFT, accelerate and DeepSpeed:

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
    trainable = inv.total if full else adapter.trainable
    notes: list[str] = []
    if engine.kind == "deepspeed":
        w = 2 if mixed else 4
        weights = w * trainable
        frozen = 0.0 if full else quantized * (quant or 0) + w * (inv.total - quantized)
        opt, opt_format = _optimizer_bytes(train.optimizer, trainable, 4 * trainable)
        # ZeRO's optimizer keeps an fp32 copy of its partition, the master weights under mixed precision.
        master = 4 * trainable if mixed or engine.zero_stage > 0 else 0.0
        opt_format = ("fp32 master + " if master else "") + opt_format.replace("the weights' dtype", "fp32")
        layout_bytes = (w, w, False, w, w)
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
    from finetune.model import DTYPES, weight_dtype

    dtype = weight_dtype(recipe.model, lora, train.mixed_precision)
    w, w_name = dtype.itemsize, next(name for name, d in DTYPES.items() if d == dtype)
    fsdp_mixed = engine.kind == "fsdp" and mixed
    if full:
        tw = 4 if fsdp_mixed else w
        weights, frozen = tw * trainable, 0.0
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
    logits = 4 if mixed else w  # accelerate's convert_outputs_to_fp32 upcasts autocast outputs
    gather = 2 if fsdp_mixed else w
    # bitsandbytes' Linear4bit returns its input's dtype: the fp32 residual under QLoRA.
    linear_out = residual if quant else compute
    return Layout(
        states, residual, compute, mixed, logits, gather, copies, tuple(notes), 4, linear_out, quant or 0.0
    )


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


def shard_states(states: States, engine: Engine) -> list[Part]:
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
    inv: ModelInventory, layout: Layout, engine: Engine, trainable_fraction: float
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


# -------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch (see `activation_bytes` for the formula)."""

    num_layers: int
    per_layer: float  # saved by autograd in one decoder layer
    layer_input: float  # one layer's input: all a checkpointed layer keeps
    head: float  # final norm, lm_head input, ids/labels, rotary tables
    mask: float  # transformers' mask (bool for sdpa, float for eager), alive through the forward
    loss_saved: float  # fp32 log-softmax the cross entropy saves
    logits: float  # logits the model output holds through backward
    loss_transient: float  # two fp32 b*s*V gradient buffers at the cross-entropy backward

    @property
    def saved(self) -> float:
        """What autograd saves without checkpointing (what saved_tensors_hooks sees)."""
        return self.num_layers * self.per_layer + self.head + self.loss_saved

    @property
    def logits_and_loss(self) -> float:
        return self.logits + self.loss_saved + self.loss_transient

    def peak(self, checkpointing: bool) -> float:
        """Peak bytes: the end of the forward / start of the backward, or with checkpointing the
        larger of the loss backward and one layer's recomputation."""
        if not checkpointing:
            return self.saved + self.mask + self.logits + self.loss_transient
        loss_step = self.head + self.loss_saved + self.loss_transient
        kept = self.num_layers * self.layer_input + self.mask + self.logits
        return kept + max(loss_step, self.per_layer)


def activation_bytes(
    inv: ModelInventory,
    *,
    micro_batch_size: int,
    seq_len: int,
    attn_implementation: str,
    residual_bytes: int,
    compute_bytes: int,
    autocast: bool,
    logits_bytes: int,
    adapter: Adapter | None = None,
    lora_dropout: float = 0.0,
    lora_bytes: int = 4,
    linear_out_bytes: int | None = None,
    lm_head_trainable: bool = True,
    embedding_trainable: bool = True,
) -> Activations:
    """Bytes autograd saves in a Llama-style decoder layer for b rows of s tokens.

    With r = residual bytes, c = compute bytes, h hidden, q = heads*head_dim, k = kv_heads*head_dim,
    i intermediate, a heads, bs = b*s; "copies" = autocast with an fp32 residual (each Linear casts
    its input separately). Full fine-tuning, per layer:
      2 RMSNorms        2*((4 + r)*bs*h + 4*bs)        fp32 input, normalized input (for the weight
                                                       grad; not with frozen norms), rsqrt
      Linear inputs     bs*h*(3c or r) + bs*h*(2c or r) + c*bs*i   q/k/v, gate/up, down; o_proj
                                                       reads sdpa's saved output
      attention sdpa    c*bs*(2q + 2k') + 4*b*a*s      q, k, v, out, logsumexp, plus a c*b*s^2 mask;
                        + c*b*s^2                      k' = q when a mask makes transformers repeat
                                                       k/v to every head (packed or padded rows);
                                                       flash/flex: k' = k, no mask
      attention eager   4c*bs*q + (4 + c)*b*a*s^2      q, k, v (repeated), o_proj's contiguous input;
                                                       fp32 softmax and its c-dtype copy
      MLP               3c*bs*i                        gate output, silu output, up output (in the
                                                       input dtype r for 4-bit QLoRA linears)
    LoRA (frozen base): Linear layers save no input, norms only the fp32 input; each adapted Linear
    saves lora_A's input (its own c copy under autocast, else PEFT's cast to the LoRA dtype, shared
    by q/k/v and gate/up when no cast is needed; dropout: its output + a bool mask) and lora_A's
    output (bs*rank).
    Head: final norm, lm_head input (c*bs*h if trained), fp32 log-softmax 4*bs*V, ids and labels,
    rotary cos/sin; minus the first norm when the embeddings are frozen (its input needs no grad). The model output holds logits_bytes*bs*V logits through backward, and the
    cross-entropy backward adds two fp32 bs*V gradients. Transformers' mask (bool b*s^2 for sdpa,
    r*b*s^2 float for eager) is shared by all layers.
    Gradient checkpointing keeps r*bs*h per layer and recomputes one layer at a time.
    """
    b, s = micro_batch_size, seq_len
    bs = b * s
    h, i, a, vocab = inv.hidden_size, inv.intermediate_size, inv.num_heads, inv.vocab_size
    q, kv = inv.num_heads * inv.head_dim, inv.num_kv_heads * inv.head_dim
    r, c = residual_bytes, compute_bytes
    eager = attn_implementation == "eager"
    full = adapter is None or not adapter.targets
    norm = (4 + (r if full else 0)) * bs * h + 4 * bs
    if eager:
        attention = 3 * c * bs * q + (4 + (c if c != 4 else 0)) * b * a * s * s
    else:
        k_saved = q if attn_implementation == "sdpa" else kv
        attention = c * bs * (2 * q + 2 * k_saved) + 4 * b * a * s
        attention += c * b * s * s if attn_implementation == "sdpa" else 0
    if full:
        copies = autocast and r != c
        inputs = bs * h * ((3 * c if copies else r) + (2 * c if copies else r)) + c * bs * i
        inputs += c * bs * q if eager else 0  # the contiguous o_proj input
    else:
        inputs = _lora_inputs(
            adapter, lora_dropout, lora_bytes, autocast=autocast, eager=eager, c=c, r=r, bs=bs
        )
    head = norm + (c * bs * h if lm_head_trainable else 0) + 16 * bs + 2 * r * bs * inv.head_dim
    if not embedding_trainable:  # the first norm's input needs no grad: nothing saved there
        head -= norm
    return Activations(
        num_layers=inv.num_layers,
        per_layer=2 * norm + attention + 3 * (linear_out_bytes or c) * bs * i + inputs,
        layer_input=r * bs * h,
        head=head,
        mask=(1 if attn_implementation == "sdpa" else r if eager else 0) * b * s * s,
        loss_saved=4 * bs * vocab,
        logits=logits_bytes * bs * vocab,
        loss_transient=8 * bs * vocab,
    )


def _lora_inputs(
    adapter: Adapter, dropout: float, lora_bytes: int, *, autocast: bool, eager: bool, c: int, r: int, bs: int
) -> float:
    """What LoRA saves in one decoder layer: lora_A's input and output per adapted Linear."""
    targets = [m for m in adapter.targets if m.layer is not None and m.kind == "linear"]
    layer = [m for m in targets if m.layer == targets[0].layer] if targets else []
    saved_input = c if autocast else lora_bytes  # the dtype lora_A sees and saves
    saved = sum(bs * adapter.rank * saved_input for _ in layer)  # lora_A output, saved by lora_B
    shared: set[str] = set()
    for m in layer:
        group = _input_group(m.name)
        x_bytes = r if group in ("attn_in", "mlp_in") else c  # dtype of the tensor the Linear reads
        if dropout > 0:  # each adapter: its dropout output and a bool mask
            saved += (saved_input + 1) * bs * m.in_features
        elif autocast or x_bytes != lora_bytes:  # PEFT's / autocast's cast: one copy per adapter
            saved += saved_input * bs * m.in_features
        elif group not in shared:  # same tensor for q/k/v and gate/up; sdpa already saved o's input
            shared.add(group)
            saved += 0 if group == "attn_out" and not eager else x_bytes * bs * m.in_features
    return saved


def _input_group(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    return {
        "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
        "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_out",
    }.get(leaf, name)  # fmt: skip


# ---------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Estimate:
    """Every part on one device for one (recipe, engine, micro batch, checkpointing)."""

    parts: tuple[Part, ...]
    activations: Activations
    layout: Layout

    @property
    def total_gpu(self) -> float:
        return sum(p.gpu_bytes for p in self.parts)

    @property
    def total_host(self) -> float:
        return sum(p.host_bytes for p in self.parts)


def estimate(
    inv: ModelInventory,
    recipe: Recipe,
    engine: Engine,
    *,
    micro_batch_size: int,
    checkpointing: bool,
    adapter: Adapter | None = None,
) -> Estimate:
    """Per-device bytes by part: model states, engine extras, activations, the fixed allowance."""
    adapter = adapter if adapter is not None else adapter_counts(inv, recipe.lora)
    layout = model_states(inv, adapter, recipe, engine, checkpointing=checkpointing)
    parts = shard_states(layout.states, engine)
    if engine.kind == "ddp" and engine.num_gpus > 1:
        note = "gradient_as_bucket_view=False (accelerate's default): a second gradient copy"
        parts.append(Part("DDP gradient buckets", layout.states.grads, note=note))
    if layout.autocast_copies:
        parts.append(
            Part("autocast weight copies", layout.autocast_copies, note="bf16 casts of fp32 matmul weights")
        )
    gathered = gathered_bytes(inv, layout, engine, min(1.0, layout.states.trainable_params / inv.total))
    if gathered is not None:
        parts.append(gathered)
    data = recipe.data
    trained = {m.name for m in _modules_to_save(inv, recipe.lora.modules_to_save)}
    full = not recipe.lora.enable_lora
    embedding = next((m.name for m in inv.modules if m.kind == "embedding"), None)
    acts = activation_bytes(
        inv,
        micro_batch_size=micro_batch_size,
        seq_len=data.packing_len if data.sample_packing else data.sequence_len,
        attn_implementation=recipe.model.attn_implementation,
        residual_bytes=layout.residual_bytes,
        compute_bytes=layout.compute_bytes,
        autocast=layout.autocast,
        logits_bytes=layout.logits_bytes,
        adapter=adapter,
        lora_dropout=recipe.lora.lora_dropout,
        lora_bytes=layout.lora_bytes,
        linear_out_bytes=layout.linear_out_bytes,
        lm_head_trainable=full or inv.output_name in trained,
        embedding_trainable=full or embedding in trained,
    )
    label = "activations, " + ("gradient checkpointing" if checkpointing else "no checkpointing")
    parts.append(Part(label, acts.peak(checkpointing) - acts.logits_and_loss, note="<- recipe"))
    parts.append(Part("logits + loss", acts.logits_and_loss, note="held logits, fp32 log-softmax and grads"))
    parts.append(Part("CUDA context + fragmentation", CUDA_ALLOWANCE_BYTES, note="fixed allowance"))
    return Estimate(tuple(parts), acts, layout)


@dataclass(frozen=True)
class Suggestion:
    """A micro batch that fits with the global batch kept, or what would fit instead."""

    global_batch: int
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool = False
    alternatives: tuple[dict, ...] = ()
    lines: tuple[str, ...] = ()


def suggest(inv: ModelInventory, recipe: Recipe, engine: Engine, gpu_memory: float) -> Suggestion:
    """Largest micro_batch_size dividing the per-device rows (micro x accumulation) that fits, so
    micro x accumulation x GPUs stays the recipe's global batch; checkpointing is turned on only
    when nothing fits without it; if micro 1 does not fit either, other engines and QLoRA are tried."""
    train = recipe.train
    rows = train.micro_batch_size * train.gradient_accumulation_steps
    global_batch = rows * engine.num_gpus
    adapter = adapter_counts(inv, recipe.lora)

    def fits(micro: int, ckpt: bool, eng: Engine = engine, rec: Recipe = recipe) -> bool:
        ad = adapter if rec is recipe else adapter_counts(inv, rec.lora)
        est = estimate(inv, rec, eng, micro_batch_size=micro, checkpointing=ckpt, adapter=ad)
        return est.total_gpu <= gpu_memory

    micros = [m for m in range(rows, 0, -1) if rows % m == 0]
    for ckpt in dict.fromkeys((train.gradient_checkpointing, True)):
        micro = next((m for m in micros if fits(m, ckpt)), None)
        if micro is not None:
            return _batch_suggestion(recipe, engine, global_batch, micro, ckpt, fits(micro, False))
    alternatives = []
    for name, eng, rec, change in _alternatives(recipe, engine):
        if fits(1, True, eng, rec):
            est = estimate(inv, rec, eng, micro_batch_size=1, checkpointing=True)
            alternatives.append({"name": name, "change": change, "total_gpu_bytes": est.total_gpu})
    lines = [f"does not fit even at micro_batch_size 1 with gradient checkpointing ({_gib(gpu_memory)} GiB)"]
    lines += [
        f"would fit at micro_batch_size 1 with checkpointing: {a['change']} ({_gib(a['total_gpu_bytes'])} GiB)"
        for a in alternatives[:3]
    ]
    if not alternatives:
        lines.append(
            "nothing tried fits: more GPUs, a shorter data.sample_packing_sequence_len, or LoRA/QLoRA"
        )
    return Suggestion(
        global_batch, gradient_checkpointing=True, alternatives=tuple(alternatives), lines=tuple(lines)
    )


def _batch_suggestion(
    recipe: Recipe, engine: Engine, global_batch: int, micro: int, ckpt: bool, fits_without_ckpt: bool
) -> Suggestion:
    train = recipe.train
    accumulation = global_batch // (micro * engine.num_gpus)
    same = (micro, accumulation, ckpt) == (
        train.micro_batch_size,
        train.gradient_accumulation_steps,
        train.gradient_checkpointing,
    )
    head = (
        f"micro_batch_size {micro} x gradient_accumulation_steps {accumulation} x {engine.num_gpus} "
        f"device{'s' if engine.num_gpus > 1 else ''} = global batch {global_batch}"
    )
    lines = [head + (" (the recipe's; the largest micro batch that fits)" if same else "")]
    if not same:
        flags = f"--train.micro_batch_size {micro} --train.gradient_accumulation_steps {accumulation}"
        if ckpt and not train.gradient_checkpointing:
            flags += " --train.gradient_checkpointing true"
            lines.append("nothing fits without gradient checkpointing: turn it on")
        lines.append(f"use: {flags}")
    if ckpt and fits_without_ckpt:
        lines.append(
            "fits without gradient checkpointing too (no recompute, faster): --train.gradient_checkpointing false"
        )
    return Suggestion(global_batch, micro, accumulation, ckpt, lines=tuple(lines))


def _alternatives(recipe: Recipe, engine: Engine) -> list[tuple[str, Engine, Recipe, str]]:
    """Other engines (named as the shipped configs) and QLoRA, in order of how much they change."""
    from finetune.cli import ACCELERATE_CONFIGS

    common = {"num_gpus": engine.num_gpus, "num_nodes": engine.num_nodes}
    cpu = {"offload_optimizer": "cpu", "offload_params": "cpu"}
    engines = [
        ("zero2", Engine("deepspeed", zero_stage=2, **common)),
        ("zero3", Engine("deepspeed", zero_stage=3, **common)),
        ("fsdp2", Engine("fsdp", zero_stage=3, **common)),
        ("zero2_offload", Engine("deepspeed", zero_stage=2, offload_optimizer="cpu", **common)),
        ("zero3_offload", Engine("deepspeed", zero_stage=3, **cpu, **common)),
        ("fsdp2_offload", Engine("fsdp", zero_stage=3, **cpu, **common)),
    ]
    out = []
    for name, eng in engines:
        if name == engine.name:
            continue
        path = ACCELERATE_CONFIGS / f"{name}.yaml"
        where = f"accelerate_configs/{name}.yaml" if path.is_file() else f"no {name}.yaml shipped: write one"
        out.append((name, eng, recipe, f"--accelerate-config {name} ({where})"))
    if not recipe.lora.enable_qlora:
        lora = recipe.lora.model_copy(update={"enable_lora": True, "enable_qlora": True})
        model = recipe.model
        if model.torch_dtype == "fp32":
            model = model.model_copy(update={"torch_dtype": "bf16"})
        qlora = recipe.model_copy(update={"lora": lora, "model": model})
        out.append(("qlora", engine, qlora, "QLoRA: --lora.enable_qlora true (4-bit base + LoRA)"))
    return out


@dataclass(frozen=True)
class Plan:
    """The whole answer of `finetune plan`."""

    recipe_path: str
    engine: Engine
    inventory: ModelInventory
    adapter: Adapter
    micro_batch_size: int
    seq_len: int
    checkpointing: bool
    estimate: Estimate
    other_activations: float  # peak activations with the other checkpointing setting
    gpu_memory: float
    gpu_memory_source: str
    suggestion: Suggestion
    assumptions: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return self.estimate.total_gpu <= self.gpu_memory

    @property
    def headroom(self) -> float:
        return self.gpu_memory - self.estimate.total_gpu


def make_plan(
    recipe: Recipe,
    *,
    recipe_path: str = "",
    accelerate_config: str | None = None,
    num_gpus: int | None = None,
    num_nodes: int | None = None,
    gpu_memory: str | None = None,
    inventory: ModelInventory | None = None,
) -> Plan:
    """Plan the recipe under an accelerate config (name or path; default train.accelerate_config)."""
    from finetune.cli import resolve_accelerate_config

    if getattr(recipe.model, "kind", "llm") != "llm":
        raise FinetuneError("finetune plan handles LLM recipes (model.kind: llm), not diffusion pipelines")
    config = resolve_accelerate_config(accelerate_config or recipe.train.accelerate_config)
    engine = read_engine(config, num_gpus=num_gpus, num_nodes=num_nodes)
    memory, source = gpu_memory_bytes(gpu_memory)
    inv = inventory if inventory is not None else inspect_model(recipe.model)
    adapter = adapter_counts(inv, recipe.lora)
    train, data = recipe.train, recipe.data
    ckpt = train.gradient_checkpointing
    est = estimate(
        inv, recipe, engine, micro_batch_size=train.micro_batch_size, checkpointing=ckpt, adapter=adapter
    )
    return Plan(
        recipe_path=recipe_path,
        engine=engine,
        inventory=inv,
        adapter=adapter,
        micro_batch_size=train.micro_batch_size,
        seq_len=data.packing_len if data.sample_packing else data.sequence_len,
        checkpointing=ckpt,
        estimate=est,
        other_activations=est.activations.peak(not ckpt) - est.activations.logits_and_loss,
        gpu_memory=memory,
        gpu_memory_source=source,
        suggestion=suggest(inv, recipe, engine, memory),
        assumptions=_assumptions(recipe, engine, est, source),
    )


def gpu_memory_bytes(text: str | None) -> tuple[int, str]:
    """(bytes, where it came from): --gpu-memory (80GiB, 80GB, 81920MiB), else the first visible CUDA
    device, else 80 GiB."""
    if text is not None:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", text)
        if not match or match.group(2).lower() not in _MEMORY_UNITS:
            raise FinetuneError(
                f"--gpu-memory {text!r}: expected a size with a unit, e.g. 80GiB, 80GB, 24GiB or 81920MiB"
            )
        return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()]), f"--gpu-memory {text}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"GPU 0 ({props.name})"
    return DEFAULT_GPU_MEMORY, "default 80 GiB: no CUDA device visible (set --gpu-memory)"


def _assumptions(recipe: Recipe, engine: Engine, est: Estimate, memory_source: str) -> tuple[str, ...]:
    attn = recipe.model.attn_implementation
    out = [
        f"model states as this codebase holds them: {est.layout.states.weight_format}, "
        f"{est.layout.states.optimizer_format}",
        *est.layout.notes,
        f"activations: Llama-style decoder layers, {attn} attention"
        + (" (b*a*s^2 probabilities saved)" if attn == "eager" else " (no s^2 term)")
        + (", packed/padded rows carry a mask so k/v are repeated to every head" if attn == "sdpa" else ""),
        "vocabulary from the model config (special tokens added to the tokenizer grow the logits)",
        f"a fixed {_gib(CUDA_ALLOWANCE_BYTES)} GiB for the CUDA context, allocator fragmentation and "
        "communication buckets",
        f"GPU memory: {memory_source}",
    ]
    if engine.kind == "ddp" and engine.num_gpus > 1:
        out.append("DDP keeps gradients twice (accelerate's DDP default gradient_as_bucket_view=False)")
    if any(p.name == "gathered params" for p in est.parts):
        out.append(
            "ZeRO-3/FSDP working set: the unit in use + one prefetched (FSDP2's root unit stays "
            "gathered) and one layer's unsharded grads"
        )
    if est.total_host:
        out.append(
            f"host bytes are per GPU process; a node holds {engine.gpus_per_node}x "
            "(plus pinned buffers, not counted)"
        )
    if engine.on_cpu:
        out.append("CPU processes: 'per-GPU' means per process, in RAM")
    return tuple(out)


# -------------------------------------------------------------------------------------------- output


def _gib(nbytes: float) -> str:
    gib = nbytes / GiB
    return f"{gib:.2f}" if gib >= 0.995 or gib == 0 else f"{gib:.3g}"  # tiny models: keep digits


def _params(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def format_plan(plan: Plan) -> str:
    """The plan as a readable table with the verdict, suggestions and assumptions."""
    inv, est, eng = plan.inventory, plan.estimate, plan.engine
    trainable = est.layout.states.trainable_params
    lines = [
        f"plan: {plan.recipe_path}",
        f"model:  {_params(inv.total)} parameters ({inv.total:,}), {_params(trainable)} trainable; "
        f"{inv.num_layers} layers, hidden {inv.hidden_size}, vocab {inv.vocab_size:,}, "
        f"embeddings {'tied' if inv.tied else 'untied'}",
        f"engine: {eng.describe()}" + (f" [{_short_path(eng.config)}]" if eng.config else ""),
        f"batch:  micro_batch_size {plan.micro_batch_size} x {plan.seq_len} tokens, gradient checkpointing "
        f"{'on' if plan.checkpointing else 'off'}",
        "",
        f"{'part':34s} {'per-GPU GiB':>11s} {'host GiB':>9s}  note",
    ]
    other = "no checkpointing" if plan.checkpointing else "gradient checkpointing"
    for part in est.parts:
        host = _gib(part.host_bytes) if part.host_bytes else "-"
        note = part.note + (f"; NVMe {_gib(part.nvme_bytes)} GiB" if part.nvme_bytes else "")
        lines.append(f"{part.name:34s} {_gib(part.gpu_bytes):>11s} {host:>9s}  {note}")
        if part.name.startswith("activations"):
            label, size = f"(activations, {other})", f"({_gib(plan.other_activations)})"
            lines.append(f"{label:34s} {size:>11s} {'':>9s}  not counted")
    lines.append(f"{'total':34s} {_gib(est.total_gpu):>11s} {_gib(est.total_host):>9s}")
    verdict = "yes" if plan.fits else "NO"
    lines.append(
        f"fits in {_gib(plan.gpu_memory)} GiB ({plan.gpu_memory_source}): {verdict}, "
        f"{'headroom' if plan.fits else 'over by'} {_gib(abs(plan.headroom))} GiB"
    )
    if est.total_host:
        lines.append(f"host RAM per node: {_gib(est.total_host * eng.gpus_per_node)} GiB")
    lines += [f"suggestion: {line}" for line in plan.suggestion.lines]
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def _short_path(path: str) -> str:
    from finetune.cli import REPO_ROOT

    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else path


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan's numbers (bytes) as plain data for --json."""
    inv, est, acts = plan.inventory, plan.estimate, plan.estimate.activations
    engine = {**asdict(plan.engine), "name": plan.engine.name, "shard_degree": plan.engine.shard_degree}
    return {
        "recipe": plan.recipe_path,
        "model": {
            "params_total": inv.total,
            "params_trainable": est.layout.states.trainable_params,
            "lora_params": plan.adapter.lora_params,
            "modules_to_save_params": plan.adapter.saved_params,
            "num_layers": inv.num_layers,
            "hidden_size": inv.hidden_size,
            "vocab_size": inv.vocab_size,
            "tied_embeddings": inv.tied,
        },
        "engine": engine,
        "batch": {
            "micro_batch_size": plan.micro_batch_size,
            "seq_len": plan.seq_len,
            "gradient_checkpointing": plan.checkpointing,
        },
        "parts": [asdict(p) for p in est.parts],
        "activations": {
            "with_checkpointing_bytes": acts.peak(True) - acts.logits_and_loss,
            "without_checkpointing_bytes": acts.peak(False) - acts.logits_and_loss,
            "logits_and_loss_bytes": acts.logits_and_loss,
            "saved_bytes": acts.saved,
            "used": "with_checkpointing" if plan.checkpointing else "without_checkpointing",
        },
        "total_gpu_bytes": est.total_gpu,
        "total_host_bytes": est.total_host,
        "host_bytes_per_node": est.total_host * plan.engine.gpus_per_node,
        "gpu_memory_bytes": plan.gpu_memory,
        "gpu_memory_source": plan.gpu_memory_source,
        "fits": plan.fits,
        "headroom_bytes": plan.headroom,
        "suggestion": asdict(plan.suggestion),
        "assumptions": list(plan.assumptions),
    }


def plan_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2)
