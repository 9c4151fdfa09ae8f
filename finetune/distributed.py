"""Engines (DDP, FSDP2, DeepSpeed ZeRO) from the accelerate config and the recipe.

The accelerate config picks the engine (read into an `DistributedSetup` by finetune.accelerate_config); the
recipe owns the training values (micro batch, accumulation, clipping, precision). This module:

- refuses combinations that cannot work, before launch (`finetune train`) and again in the launched
  process (`accelerate launch finetune/train.py`), with a sentence saying what to use instead;
- fills the DeepSpeed JSON's "auto" values from the recipe, and reports a value the user wrote that
  disagrees with the recipe, naming both;
- builds the plugins Accelerate runs (`DeepSpeedPlugin`, `FullyShardedDataParallelPlugin`).

Everything else (sharding, collectives, checkpoint formats) is the engines' own.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from finetune.accelerate_config import DistributedSetup, load_ds_config
from finetune.errors import FinetuneError

if TYPE_CHECKING:
    from finetune.recipe import TrainSection

# What finetune builds itself from the recipe; a DeepSpeed JSON must not define them.
DS_FORBIDDEN_BLOCKS = {
    "optimizer": "train.optimizer / lr / adam_* / weight_decay",
    "scheduler": "train.lr_decay_style / lr_warmup_ratio / lr_min",
}


# ------------------------------------------------------------------------------------- refusals


def combination_problems(
    engine: DistributedSetup,
    train: TrainSection,
    *,
    model_kind: str,
    qlora: bool,
    cuda_available: bool,
    lora: bool = False,
) -> list[str]:
    """Why a run with these settings cannot work on this engine here, one sentence each (empty when
    it can). `model_kind` is model.kind (llm or diffusion), `qlora` lora.enable_qlora, `lora`
    lora.enable_lora."""
    import importlib.util

    problems = []
    where = engine.source
    if engine.kind == "fsdp" and not cuda_available:
        problems.append(
            f"{where}: FSDP in Accelerate needs CUDA GPUs and this machine has none; on CPU use "
            "multi_cpu (DDP over gloo) or zero1/zero2/zero3 (DeepSpeed, one process)"
        )
    if engine.kind == "fsdp" and engine.fsdp_version != 2:
        problems.append(
            f"{where}: fsdp_version {engine.fsdp_version} is not supported; set fsdp_config.fsdp_version: 2 "
            "(FSDP2, as in accelerate_configs/fsdp2.yaml)"
        )
    if model_kind == "diffusion" and engine.kind in ("fsdp", "deepspeed"):
        problems.append(
            f"{where}: diffusion LoRA training runs on one process or DDP, not {engine.label}: only the "
            "LoRA weights train (a few MB), so sharding saves nothing; use single_gpu or multi_gpu "
            "(multi_cpu without GPUs)"
        )
    if engine.kind == "deepspeed" and engine.num_processes > 1 and not cuda_available:
        # Accelerate (1.15) gives a DeepSpeed run without a GPU no distributed backend: every process
        # would believe it is the only one (and the main one), and they would clash writing checkpoints.
        problems.append(
            f"{where}: DeepSpeed without GPUs runs one process, not {engine.num_processes}: Accelerate treats "
            "each CPU process as the only one; use --num-processes 1, or multi_cpu for several CPU processes"
        )
    if engine.kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        problems.append(f"{where}: DeepSpeed is not installed: pip install -e '.[deepspeed]'")
    if engine.kind == "deepspeed" and engine.offload_optimizer != "none" and train.optimizer != "adamw":
        problems.append(
            f"{where}: optimizer offload runs DeepSpeed's CPU Adam; set train.optimizer: adamw "
            f"(not {train.optimizer}) or use a config without offload (zero2, zero3)"
        )
    if engine.kind == "fsdp" and qlora and train.mixed_precision != "bf16":
        problems.append(
            "lora.enable_qlora with FSDP: set train.mixed_precision: bf16 so the 4-bit weights are stored "
            "as bf16 and shard with the rest of the model"
        )
    if engine.use_cpu and engine.kind in ("fsdp", "deepspeed"):
        problems.append(
            f"{where}: use_cpu (or ACCELERATE_USE_CPU=true) cannot be combined with {engine.label}, "
            "which Accelerate would then silently turn off; set use_cpu: false (DeepSpeed uses its CPU "
            "accelerator by itself on a machine without GPUs)"
        )
    from finetune.parallel.sizes import engine_problems

    return problems + engine_problems(engine, train, cuda_available=cuda_available, lora=lora)


def check_combination(
    engine: DistributedSetup,
    train: TrainSection,
    *,
    model_kind: str,
    qlora: bool,
    cuda_available: bool,
    lora: bool = False,
) -> None:
    """Raise FinetuneError listing every `combination_problems` (none: return)."""
    problems = combination_problems(
        engine, train, model_kind=model_kind, qlora=qlora, cuda_available=cuda_available, lora=lora
    )
    if problems:
        raise FinetuneError("cannot train with this setup:\n  - " + "\n  - ".join(problems))


# ------------------------------------------------------------------------------------ DeepSpeed


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def fill_deepspeed_config(ds: dict, train: TrainSection, *, world_size: int, source: str) -> dict:
    """A copy of a DeepSpeed config with the recipe's values in place of "auto".

    A value the user wrote that disagrees with the recipe is an error naming both. (Accelerate's own
    `deepspeed_config_process` also compares, but its message cannot name the recipe field, and it
    runs only once the model is being prepared.)
    """
    ds = json.loads(json.dumps(ds))
    problems = [
        f"{source}: remove the {block!r} block: finetune builds it from the recipe ({fields})"
        for block, fields in DS_FORBIDDEN_BLOCKS.items()
        if block in ds
    ]
    clip = train.max_grad_norm if train.max_grad_norm is not None else 0.0  # 0 = off in DeepSpeed
    wanted = {
        "train_micro_batch_size_per_gpu": (train.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (
            train.gradient_accumulation_steps,
            "train.gradient_accumulation_steps",
        ),
        "train_batch_size": (
            train.micro_batch_size * train.gradient_accumulation_steps * world_size,
            f"train.micro_batch_size x gradient_accumulation_steps x {world_size} processes",
        ),
        "gradient_clipping": (clip, "train.max_grad_norm"),
        "bf16.enabled": (train.mixed_precision == "bf16", f"train.mixed_precision ({train.mixed_precision})"),
        "fp16.enabled": (train.mixed_precision == "fp16", f"train.mixed_precision ({train.mixed_precision})"),
    }
    for key, (value, field) in wanted.items():
        current = _get(ds, key)
        if current is None or current == "auto":
            _set(ds, key, value)
        elif not _same(current, value):
            problems.append(f"{source}: {key} is {current!r} but the recipe's {field} gives {value!r}")
    if problems:
        raise FinetuneError(
            'the DeepSpeed config disagrees with the recipe (set these to "auto" to take the recipe\'s '
            "values):\n  - " + "\n  - ".join(problems)
        )
    return ds


def deepspeed_plugin(train: TrainSection, engine: DistributedSetup, *, world_size: int):
    """Accelerate's DeepSpeedPlugin for the engine, with the recipe's values filled in."""
    from accelerate.utils import DeepSpeedPlugin

    if engine.ds_config_path is not None:
        ds = load_ds_config(engine.ds_config_path)
        source = str(engine.ds_config_path)
    else:  # zero_stage etc. given inline in the accelerate config: the same settings as a JSON
        ds = {"zero_optimization": {"stage": engine.zero_stage}}
        if engine.offload_optimizer != "none":
            ds["zero_optimization"]["offload_optimizer"] = {
                "device": engine.offload_optimizer,
                "pin_memory": True,
            }
        if engine.offload_params != "none":
            ds["zero_optimization"]["offload_param"] = {"device": engine.offload_params, "pin_memory": True}
        if engine.zero_stage == 3:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        source = engine.source
    filled = fill_deepspeed_config(ds, train, world_size=world_size, source=source)
    if engine.zero_stage == 3 and not _get(
        filled, "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ):
        # The final export gathers the 16-bit weights into one Hugging Face folder.
        _set(filled, "zero_optimization.stage3_gather_16bit_weights_on_model_save", True)
    zero3_init = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == "true"
    # The accelerate config's variables only matter without a JSON; with one, the plugin reads the
    # dict (Accelerate refuses both at once), so they are cleared here.
    for name in ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING"):
        os.environ.pop(name, None)
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    return DeepSpeedPlugin(
        hf_ds_config=filled,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        zero3_init_flag=zero3_init and engine.zero_stage == 3,
    )


def accelerator_kwargs(train: TrainSection, engine: DistributedSetup) -> dict:
    """Extra Accelerator arguments for the engine.

    Only DeepSpeed needs one: its JSON is filled from the recipe. FSDP's plugin is the one Accelerate
    builds from the launch environment; the recipe's precision becomes its mixed-precision policy
    and the model's `_no_split_modules` its wrap policy, both in Accelerate itself.
    """
    if engine.kind == "deepspeed":
        return {"deepspeed_plugin": deepspeed_plugin(train, engine, world_size=engine.num_processes)}
    return {}


# ------------------------------------------------------------------------- whole weights for generation


def sharding_of(accelerator) -> str | None:
    """How the prepared model's weights are split across processes: "zero3", "fsdp", or None (every
    process holds them whole: DDP, ZeRO-1/2, one process)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp"
    if kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        return "zero3"
    return None


@contextmanager
def whole_weights(model, accelerator, *, gather: bool = True):
    """Inside, the prepared `model`'s weights are whole on every process, so a generation loop runs
    locally at full speed; outside, they are sharded again. Every process must enter together (the
    gather is a collective).

    * ZeRO-3 (`gather`): DeepSpeed's GatheredParameters over all parameters, with the engine's
      per-module fetch/release hooks taken off meanwhile (else every module's forward would release its
      parameters again), and put back after.
    * FSDP2 (`gather`): every `fully_shard`ed module unsharded, and kept unsharded across forwards.
    * `gather=False`: the engine's own hooks fetch each layer's weights for its forward and release them
      after, for a model whose whole weights do not fit on one device (slow: every generated token
      gathers every layer; the caller keeps the processes' forwards in step, e.g. transformers'
      `synced_gpus`). Under FSDP2 the outermost sharded module is unsharded for the whole call: its
      forward hook is on the wrapper (a PEFT model), whose `generate` calls the inner model directly,
      so the weights it holds itself (embeddings, output head) would stay sharded.
    * Otherwise: nothing to do.
    Memory cost: one whole copy of the weights per process while inside.
    """
    sharding = sharding_of(accelerator)
    if sharding == "zero3" and gather:
        with _zero3_gathered(model):
            yield
    elif sharding == "fsdp":
        with _fsdp2_unsharded(model, outermost_only=not gather):
            yield
    else:
        yield


@contextmanager
def _zero3_gathered(engine):
    """GatheredParameters with the engine's ZeRO-3 module hooks off (DeepSpeed has no public switch for
    this: the hooks are its parameter offload's, removed and registered again by its own methods)."""
    import deepspeed

    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    module = getattr(engine, "module", engine)
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        if offload is not None:
            for handle in [*offload.forward_hooks, *offload.backward_hooks]:
                handle.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            for param in module.parameters():
                param.ds_active_sub_modules.clear()
        try:
            yield
        finally:
            if offload is not None:
                offload._register_deepspeed_module(offload.module)


@contextmanager
def _fsdp2_unsharded(model, *, outermost_only: bool = False):
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if outermost_only:
        inner = {id(c) for m in sharded for c in m.modules() if c is not m and isinstance(c, FSDPModule)}
        sharded = [m for m in sharded if id(m) not in inner]
    # What each module did after a forward before (the root keeps its weights; torch decides that on
    # the first forward), put back after: torch has no getter, so it is read from the module's state.
    before = {id(m): _fsdp2_state(m) for m in sharded}
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            auto, post_forward = before[id(module)]
            state = module._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for group, mesh in zip(state._fsdp_param_groups, post_forward, strict=True):
                group.post_forward_mesh_info = mesh


def _fsdp2_state(module) -> tuple[bool, list]:
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]
