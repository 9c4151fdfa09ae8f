"""Engines (DDP, FSDP2, DeepSpeed ZeRO) from the accelerate config and the recipe.

The accelerate config picks the engine; the recipe owns the training values (micro batch,
accumulation, clipping, precision). This module:

- reads an accelerate config (YAML, plus its DeepSpeed JSON) into an `Engine` description;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

REPO_ROOT = Path(__file__).resolve().parent.parent

# What finetune builds itself from the recipe; a DeepSpeed JSON must not define them.
DS_FORBIDDEN_BLOCKS = {
    "optimizer": "train.optimizer / lr / adam_* / weight_decay",
    "scheduler": "train.lr_decay_style / lr_warmup_ratio / lr_min",
}
OFFLOAD_KEYS = ("fsdp_offload_params", "offload_optimizer_device", "offload_param_device")


@dataclass(frozen=True)
class Engine:
    """What an accelerate config asks for."""

    kind: str  # single | ddp | fsdp | deepspeed
    num_processes: int = 1
    num_machines: int = 1
    use_cpu: bool = False
    zero_stage: int | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    fsdp_version: int | None = None
    hybrid_shard: bool = False
    source: str = "no accelerate config"
    ds_config_path: Path | None = None

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp" or (self.kind == "deepspeed" and (self.zero_stage or 0) > 0)

    @property
    def describe(self) -> str:
        if self.kind == "deepspeed":
            off = " with offload" if self.offload_optimizer or self.offload_params else ""
            return f"DeepSpeed ZeRO-{self.zero_stage}{off}"
        if self.kind == "fsdp":
            mode = "hybrid shard" if self.hybrid_shard else "full shard"
            off = " with CPU offload" if self.offload_params else ""
            return f"FSDP{self.fsdp_version or 1} {mode}{off}"
        return {"single": "a single process", "ddp": "DDP"}[self.kind]


def resolve_ds_config_file(value: str, *, relative_to: Path | None = None) -> Path:
    """A DeepSpeed JSON named in an accelerate config: as given (from the working directory), then
    beside the accelerate config, then from the repository root (the shipped configs name
    `accelerate_configs/deepspeed/*.json`, so they work from any directory)."""
    path = Path(value)
    candidates = [path]
    if not path.is_absolute():
        if relative_to is not None:
            candidates.append(relative_to / path)
        candidates.append(REPO_ROOT / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FinetuneError(
        f"deepspeed_config_file {value!r} not found (looked in: {', '.join(str(c) for c in candidates)}); "
        "fix the path in the accelerate config"
    )


def load_ds_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FinetuneError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise FinetuneError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


def _offload_device(block: Any) -> bool:
    return isinstance(block, dict) and str(block.get("device", "none")).lower() not in ("none", "")


def _engine_from_ds(ds: dict, **common: Any) -> Engine:
    zero = ds.get("zero_optimization") or {}
    return Engine(
        kind="deepspeed",
        zero_stage=int(zero.get("stage", 0)),
        offload_optimizer=_offload_device(zero.get("offload_optimizer")),
        offload_params=_offload_device(zero.get("offload_param")),
        **common,
    )


def read_accelerate_config(path: Path) -> Engine:
    """An `Engine` from an accelerate config file; offload settings outside DeepSpeed/FSDP are refused."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise FinetuneError(f"{path}: not valid YAML: {exc}") from None
    kind_name = str(data.get("distributed_type", "NO")).upper()
    common = {
        "num_processes": int(data.get("num_processes", 1) or 1),
        "num_machines": int(data.get("num_machines", 1) or 1),
        "use_cpu": bool(data.get("use_cpu", False)),
        "source": str(path),
    }
    fsdp = data.get("fsdp_config") or {}
    ds = data.get("deepspeed_config") or {}
    offload_set = [
        key
        for key in OFFLOAD_KEYS
        if str(fsdp.get(key, ds.get(key, "none"))).lower() not in ("none", "false", "")
    ]
    if offload_set and kind_name not in ("FSDP", "DEEPSPEED"):
        raise FinetuneError(
            f"{path}: {', '.join(offload_set)} is set but distributed_type is {kind_name}; offload needs "
            "DeepSpeed or FSDP: use zero2_offload, zero3_offload or fsdp2_offload instead"
        )
    if kind_name == "DEEPSPEED":
        if ds.get("deepspeed_config_file"):
            json_path = resolve_ds_config_file(ds["deepspeed_config_file"], relative_to=path.parent)
            return _engine_from_ds(load_ds_config(json_path), ds_config_path=json_path, **common)
        return Engine(
            kind="deepspeed",
            zero_stage=int(ds.get("zero_stage", 2)),
            offload_optimizer=str(ds.get("offload_optimizer_device", "none")).lower() != "none",
            offload_params=str(ds.get("offload_param_device", "none")).lower() != "none",
            **common,
        )
    if kind_name == "FSDP":
        parallel = data.get("parallelism_config") or {}
        return Engine(
            kind="fsdp",
            fsdp_version=int(fsdp.get("fsdp_version", 1)),
            offload_params=bool(fsdp.get("fsdp_offload_params", False)),
            hybrid_shard=int(parallel.get("parallelism_config_dp_replicate_size", 1)) > 1
            or "HYBRID" in str(fsdp.get("fsdp_sharding_strategy", "")).upper(),
            **common,
        )
    if kind_name in ("MULTI_GPU", "MULTI_CPU") or common["num_processes"] > 1:
        return Engine(kind="ddp", **common)
    return Engine(kind="single", **common)


def engine_from_env(env: os._Environ | dict | None = None) -> Engine:
    """The engine of the running process, from the variables `accelerate launch` sets."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    common = {
        "num_processes": world,
        "use_cpu": env.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"),
        "source": "the launched process's environment",
    }
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if config_file and config_file != "none":
            path = resolve_ds_config_file(config_file)
            return _engine_from_ds(load_ds_config(path), ds_config_path=path, **common)
        return Engine(
            kind="deepspeed",
            zero_stage=int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
            offload_optimizer=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") != "none",
            offload_params=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") != "none",
            **common,
        )
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return Engine(
            kind="fsdp",
            fsdp_version=int(env.get("FSDP_VERSION", "1")),
            offload_params=env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true",
            hybrid_shard=int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")) > 1,
            **common,
        )
    return Engine(kind="ddp" if world > 1 else "single", **common)


# ------------------------------------------------------------------------------------- refusals


def combination_problems(recipe: Any, engine: Engine, *, cuda_available: bool) -> list[str]:
    """Why this recipe cannot run on this engine here, one sentence each (empty when it can)."""
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
    if getattr(recipe.model, "kind", "llm") == "diffusion" and engine.kind in ("fsdp", "deepspeed"):
        problems.append(
            f"{where}: diffusion LoRA training runs on one process or DDP, not {engine.describe}: only the "
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
    if engine.kind == "deepspeed" and engine.offload_optimizer and recipe.train.optimizer != "adamw":
        problems.append(
            f"{where}: optimizer offload runs DeepSpeed's CPU Adam; set train.optimizer: adamw "
            f"(not {recipe.train.optimizer}) or use a config without offload (zero2, zero3)"
        )
    if engine.kind == "fsdp" and recipe.lora.enable_qlora and recipe.train.mixed_precision != "bf16":
        problems.append(
            "lora.enable_qlora with FSDP: set train.mixed_precision: bf16 so the 4-bit weights are stored "
            "as bf16 and shard with the rest of the model"
        )
    if engine.use_cpu and engine.kind in ("fsdp", "deepspeed"):
        problems.append(
            f"{where}: use_cpu (or ACCELERATE_USE_CPU=true) cannot be combined with {engine.describe}, "
            "which Accelerate would then silently turn off; set use_cpu: false (DeepSpeed uses its CPU "
            "accelerator by itself on a machine without GPUs)"
        )
    return problems


def check_combination(recipe: Any, engine: Engine, *, cuda_available: bool) -> None:
    problems = combination_problems(recipe, engine, cuda_available=cuda_available)
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


def fill_deepspeed_config(ds: dict, recipe: Any, *, world_size: int, source: str) -> dict:
    """A copy of a DeepSpeed config with the recipe's values in place of "auto".

    A value the user wrote that disagrees with the recipe is an error naming both. (Accelerate's own
    `deepspeed_config_process` also compares, but its message cannot name the recipe field, and it
    runs only once the model is being prepared.)
    """
    train = recipe.train
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


def deepspeed_plugin(recipe: Any, engine: Engine, *, world_size: int):
    """Accelerate's DeepSpeedPlugin for the engine, with the recipe's values filled in."""
    from accelerate.utils import DeepSpeedPlugin

    if engine.ds_config_path is not None:
        ds = load_ds_config(engine.ds_config_path)
        source = str(engine.ds_config_path)
    else:  # zero_stage etc. given inline in the accelerate config: the same settings as a JSON
        ds = {"zero_optimization": {"stage": engine.zero_stage}}
        if engine.offload_optimizer:
            ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if engine.offload_params:
            ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        if engine.zero_stage == 3:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        source = engine.source
    filled = fill_deepspeed_config(ds, recipe, world_size=world_size, source=source)
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
        gradient_accumulation_steps=recipe.train.gradient_accumulation_steps,
        zero3_init_flag=zero3_init and engine.zero_stage == 3,
    )


def accelerator_kwargs(recipe: Any, engine: Engine) -> dict:
    """Extra Accelerator arguments for the engine.

    Only DeepSpeed needs one: its JSON is filled from the recipe. FSDP's plugin is the one Accelerate
    builds from the launch environment; the recipe's precision becomes its mixed-precision policy
    and the model's `_no_split_modules` its wrap policy, both in Accelerate itself.
    """
    if engine.kind == "deepspeed":
        return {"deepspeed_plugin": deepspeed_plugin(recipe, engine, world_size=engine.num_processes)}
    return {}
