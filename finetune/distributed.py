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
    engine: DistributedSetup, train: TrainSection, *, model_kind: str, qlora: bool, cuda_available: bool
) -> list[str]:
    """Why a run with these settings cannot work on this engine here, one sentence each (empty when
    it can). `model_kind` is model.kind (llm or diffusion), `qlora` lora.enable_qlora."""
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
    return problems


def check_combination(
    engine: DistributedSetup, train: TrainSection, *, model_kind: str, qlora: bool, cuda_available: bool
) -> None:
    """Raise FinetuneError listing every `combination_problems` (none: return)."""
    problems = combination_problems(
        engine, train, model_kind=model_kind, qlora=qlora, cuda_available=cuda_available
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
