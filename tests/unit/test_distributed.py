"""Engines from accelerate configs: what each shipped config asks for, how `accelerate launch` passes it
to the training process (translated here with Accelerate's own launcher code, then built into the
plugins Accelerate runs), the DeepSpeed "auto" values filled from the recipe, and the refusals."""

from __future__ import annotations

import json
import os

import pytest

from finetune.accelerate_config import ACCELERATE_CONFIGS, DistributedSetup, read_accelerate_config
from finetune.distributed import (
    accelerator_kwargs,
    combination_problems,
    fill_deepspeed_config,
)
from finetune.errors import FinetuneError
from finetune.recipe import Recipe, validate_recipe
from tests.launch_env import launch_env
from tests.tiny import tiny_model


def _recipe(**train) -> Recipe:
    return validate_recipe(
        {
            "model": {"model_path": "org/base"},
            "data": {"datasets": [{"path": "a.jsonl", "type": "alpaca"}]},
            "train": {"output_dir": "out", **train},
        }
    )


def problems(recipe: Recipe, engine: DistributedSetup, *, cuda_available: bool) -> list[str]:
    return combination_problems(
        engine,
        recipe.train,
        model_kind=recipe.model.kind,
        qlora=recipe.lora.enable_qlora,
        cuda_available=cuda_available,
    )


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_shipped_deepspeed_json_leaves_the_recipe_values_auto(name: str):
    ds = json.loads((ACCELERATE_CONFIGS / "deepspeed" / f"{name}.json").read_text())
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert ds[key] == "auto"
    assert ds["gradient_clipping"] == "auto"
    assert ds["bf16"]["enabled"] == "auto" and ds["fp16"]["enabled"] == "auto"
    assert "optimizer" not in ds and "scheduler" not in ds
    if ds["zero_optimization"]["stage"] == 3:
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


# ------------------------------------------------------------------------------- DeepSpeed auto


def test_fill_takes_every_auto_value_from_the_recipe():
    ds = json.loads((ACCELERATE_CONFIGS / "deepspeed" / "zero3.json").read_text())
    recipe = _recipe(
        micro_batch_size=4, gradient_accumulation_steps=8, max_grad_norm=0.5, mixed_precision="bf16"
    )
    filled = fill_deepspeed_config(ds, recipe.train, world_size=16, source="zero3.json")
    assert filled["train_micro_batch_size_per_gpu"] == 4
    assert filled["gradient_accumulation_steps"] == 8
    assert filled["train_batch_size"] == 4 * 8 * 16
    assert filled["gradient_clipping"] == 0.5
    assert filled["bf16"]["enabled"] is True and filled["fp16"]["enabled"] is False
    assert ds["train_batch_size"] == "auto"  # the input is not modified
    # Values DeepSpeed sizes from the model stay "auto" for Accelerate to fill in prepare().
    assert filled["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_fill_no_clipping_and_fp32():
    filled = fill_deepspeed_config(
        {"gradient_clipping": "auto", "bf16": {"enabled": "auto"}},
        _recipe(max_grad_norm=None, mixed_precision="no").train,
        world_size=1,
        source="x.json",
    )
    assert filled["gradient_clipping"] == 0.0  # DeepSpeed's "off"
    assert filled["bf16"]["enabled"] is False and filled["fp16"]["enabled"] is False


def test_fill_conflicts_name_both_values():
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,  # agrees with the recipe: fine
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW"},
    }
    recipe = _recipe(
        micro_batch_size=8, gradient_accumulation_steps=4, max_grad_norm=0.3, mixed_precision="no"
    )
    with pytest.raises(FinetuneError) as info:
        fill_deepspeed_config(ds, recipe.train, world_size=2, source="mine.json")
    message = str(info.value)
    assert (
        "mine.json: train_micro_batch_size_per_gpu is 2 but the recipe's train.micro_batch_size gives 8"
        in message
    )
    assert "gradient_clipping is 1.0 but the recipe's train.max_grad_norm gives 0.3" in message
    assert "bf16.enabled is True but the recipe's train.mixed_precision (no) gives False" in message
    assert "remove the 'optimizer' block" in message
    assert "gradient_accumulation_steps is" not in message
    assert 'set these to "auto"' in message


def test_deepspeed_plugin_is_accelerates(monkeypatch: pytest.MonkeyPatch):
    """The plugin Accelerate runs holds the recipe's values and the JSON's ZeRO settings."""
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    engine = read_accelerate_config(ACCELERATE_CONFIGS / "zero3_offload.yaml")
    engine = DistributedSetup(**{**engine.__dict__, "num_processes": 4})
    recipe = _recipe(micro_batch_size=2, gradient_accumulation_steps=3, mixed_precision="bf16")
    plugin = accelerator_kwargs(recipe.train, engine)["deepspeed_plugin"]
    assert plugin.zero_stage == 3 and plugin.zero3_init_flag is True
    assert plugin.offload_optimizer_device == "cpu" and plugin.offload_param_device == "cpu"
    assert plugin.gradient_accumulation_steps == 3
    config = plugin.deepspeed_config
    assert config["train_batch_size"] == 2 * 3 * 4 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["bf16"]["enabled"] is True
    assert accelerator_kwargs(recipe.train, DistributedSetup(kind="ddp", num_processes=2)) == {}


# --------------------------------------------------------- translation through accelerate launch


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_offload", "fsdp2_hybrid"])
def test_fsdp2_plugin_translation(name: str, monkeypatch: pytest.MonkeyPatch):
    """recipe + accelerate config -> the FSDP2 plugin Accelerate builds (its own set_mixed_precision and
    set_auto_wrap_policy steps, run here as Accelerator and prepare run them)."""
    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    for key, value in launch_env(name).items():
        if key not in os.environ or os.environ[key] != value:
            monkeypatch.setenv(key, value)
    recipe = _recipe(mixed_precision="bf16")
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision(recipe.train.mixed_precision)
    model = tiny_model("sdpa")
    plugin.set_auto_wrap_policy(model)

    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.cpu_ram_efficient_loading is True
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16
    offloaded = plugin.cpu_offload is not None and plugin.cpu_offload.__class__.__name__ == "CPUOffloadPolicy"
    assert offloaded == (name == "fsdp2_offload")
    # Each decoder layer is its own shard unit (from the model's _no_split_modules).
    assert plugin.auto_wrap_policy is not None
    wrapped = {
        type(m).__name__
        for m in model.modules()
        if plugin.auto_wrap_policy(m, recurse=False, nonwrapped_numel=0)
    }
    assert "LlamaDecoderLayer" in wrapped
    parallel = ParallelismConfig()
    expected = (2, 8) if name == "fsdp2_hybrid" else (1, 1)
    assert (parallel.dp_replicate_size, parallel.dp_shard_size) == expected


# ------------------------------------------------------------------------------------- refusals


def test_refusals_name_the_fix():
    recipe = _recipe()
    fsdp = read_accelerate_config(ACCELERATE_CONFIGS / "fsdp2.yaml")
    (problem,) = problems(recipe, fsdp, cuda_available=False)
    assert "needs CUDA GPUs" in problem and "multi_cpu" in problem and "zero" in problem
    assert problems(recipe, fsdp, cuda_available=True) == []
    fsdp1 = DistributedSetup(kind="fsdp", fsdp_version=1, source="old.yaml")
    assert any("fsdp_version 1 is not supported" in p for p in problems(recipe, fsdp1, cuda_available=True))
    offload = read_accelerate_config(ACCELERATE_CONFIGS / "zero2_offload.yaml")
    (problem,) = problems(_recipe(optimizer="adamw_8bit"), offload, cuda_available=True)
    assert "train.optimizer: adamw (not adamw_8bit)" in problem
    qlora = _recipe(mixed_precision="no").model_copy(
        update={"lora": recipe.lora.model_copy(update={"enable_lora": True, "enable_qlora": True})}
    )
    (problem,) = problems(qlora, fsdp, cuda_available=True)
    assert "mixed_precision: bf16" in problem
    ddp_cpu = DistributedSetup(kind="deepspeed", zero_stage=2, use_cpu=True, source="cpu_ds.yaml")
    assert any(
        "use_cpu (or ACCELERATE_USE_CPU=true) cannot be combined" in p
        for p in problems(recipe, ddp_cpu, cuda_available=False)
    )
    for name in ("zero1", "zero2", "zero3", "multi_cpu", "single_gpu"):
        engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
        if engine.kind == "deepspeed":  # one process on CPU (see the next test)
            engine = DistributedSetup(**{**engine.__dict__, "num_processes": 1})
        assert problems(recipe, engine, cuda_available=False) == [], name


def test_diffusion_runs_on_one_process_or_ddp():
    recipe = validate_recipe(
        {
            "model": {"kind": "diffusion", "model_path": "org/sd"},
            "data": {"datasets": [{"path": "images", "type": "images"}]},
            "train": {"output_dir": "out"},
        }
    )
    for name in ("zero2", "fsdp2"):
        engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
        (problem,) = problems(recipe, engine, cuda_available=True)
        assert "diffusion LoRA training runs on one process or DDP" in problem and "multi_gpu" in problem
    for name in ("single_gpu", "multi_gpu", "multi_cpu"):
        engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
        assert problems(recipe, engine, cuda_available=False) == []


def test_deepspeed_without_gpus_is_one_process():
    recipe = _recipe()
    engine = DistributedSetup(
        **{**read_accelerate_config(ACCELERATE_CONFIGS / "zero3.yaml").__dict__, "num_processes": 2}
    )
    (problem,) = problems(recipe, engine, cuda_available=False)
    assert "DeepSpeed without GPUs runs one process, not 2" in problem and "--num-processes 1" in problem
    assert problems(recipe, engine, cuda_available=True) == []
    one = DistributedSetup(**{**engine.__dict__, "num_processes": 1})
    assert problems(recipe, one, cuda_available=False) == []
