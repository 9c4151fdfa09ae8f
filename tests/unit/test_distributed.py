"""Engines from accelerate configs: what each shipped config asks for, how `accelerate launch` passes it
to the training process (translated here with Accelerate's own launcher code, then built into the
plugins Accelerate runs), the DeepSpeed "auto" values filled from the recipe, and the refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from finetune.cli import ACCELERATE_CONFIGS
from finetune.distributed import (
    Engine,
    accelerator_kwargs,
    combination_problems,
    engine_from_env,
    fill_deepspeed_config,
    read_accelerate_config,
)
from finetune.errors import FinetuneError
from finetune.recipe import Recipe, validate_recipe
from tests.tiny import tiny_model


def _recipe(**train) -> Recipe:
    return validate_recipe(
        {
            "model": {"model_path": "org/base"},
            "data": {"datasets": [{"path": "a.jsonl", "type": "alpaca"}]},
            "train": {"output_dir": "out", **train},
        }
    )


EXPECTED = {
    "single_gpu": dict(kind="single"),
    "multi_gpu": dict(kind="ddp", num_processes=8),
    "multi_cpu": dict(kind="ddp", num_processes=2, use_cpu=True),
    "fsdp2": dict(kind="fsdp", fsdp_version=2, offload_params=False, hybrid_shard=False),
    "fsdp2_offload": dict(kind="fsdp", fsdp_version=2, offload_params=True),
    "fsdp2_hybrid": dict(kind="fsdp", fsdp_version=2, hybrid_shard=True, num_machines=2, num_processes=16),
    "multi_node": dict(kind="fsdp", fsdp_version=2, num_machines=2, num_processes=16),
    "zero1": dict(kind="deepspeed", zero_stage=1, offload_optimizer=False, offload_params=False),
    "zero2": dict(kind="deepspeed", zero_stage=2, offload_optimizer=False),
    "zero2_offload": dict(kind="deepspeed", zero_stage=2, offload_optimizer=True, offload_params=False),
    "zero3": dict(kind="deepspeed", zero_stage=3, offload_optimizer=False, offload_params=False),
    "zero3_offload": dict(kind="deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True),
}


def test_every_shipped_config_is_described_here():
    assert sorted(EXPECTED) == sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_read_shipped_config(name: str):
    engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
    for field, value in EXPECTED[name].items():
        assert getattr(engine, field) == value, field
    if engine.kind == "deepspeed":
        assert engine.ds_config_path == (ACCELERATE_CONFIGS / "deepspeed" / f"{name}.json").resolve()


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


def test_offload_without_an_engine_is_refused(tmp_path: Path):
    path = tmp_path / "ddp_offload.yaml"
    path.write_text(
        "distributed_type: MULTI_GPU\nnum_processes: 2\nfsdp_config:\n  fsdp_offload_params: true\n"
    )
    with pytest.raises(FinetuneError) as info:
        read_accelerate_config(path)
    message = str(info.value)
    assert str(path) in message and "fsdp_offload_params" in message and "MULTI_GPU" in message
    assert "zero2_offload, zero3_offload or fsdp2_offload" in message


def test_deepspeed_json_found_beside_the_config(tmp_path: Path):
    (tmp_path / "my.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    path = tmp_path / "ds.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: my.json\n")
    engine = read_accelerate_config(path)
    assert engine.zero_stage == 2 and engine.ds_config_path == (tmp_path / "my.json").resolve()
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: missing.json\n")
    with pytest.raises(FinetuneError, match=r"deepspeed_config_file 'missing\.json' not found"):
        read_accelerate_config(path)


# ------------------------------------------------------------------------------- DeepSpeed auto


def test_fill_takes_every_auto_value_from_the_recipe():
    ds = json.loads((ACCELERATE_CONFIGS / "deepspeed" / "zero3.json").read_text())
    recipe = _recipe(
        micro_batch_size=4, gradient_accumulation_steps=8, max_grad_norm=0.5, mixed_precision="bf16"
    )
    filled = fill_deepspeed_config(ds, recipe, world_size=16, source="zero3.json")
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
        _recipe(max_grad_norm=None, mixed_precision="no"),
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
        fill_deepspeed_config(ds, recipe, world_size=2, source="mine.json")
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
    engine = Engine(**{**engine.__dict__, "num_processes": 4})
    recipe = _recipe(micro_batch_size=2, gradient_accumulation_steps=3, mixed_precision="bf16")
    plugin = accelerator_kwargs(recipe, engine)["deepspeed_plugin"]
    assert plugin.zero_stage == 3 and plugin.zero3_init_flag is True
    assert plugin.offload_optimizer_device == "cpu" and plugin.offload_param_device == "cpu"
    assert plugin.gradient_accumulation_steps == 3
    config = plugin.deepspeed_config
    assert config["train_batch_size"] == 2 * 3 * 4 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["bf16"]["enabled"] is True
    assert accelerator_kwargs(recipe, Engine(kind="ddp", num_processes=2)) == {}


# --------------------------------------------------------- translation through accelerate launch


def _launch_env(name: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file <name>` gives the training processes, from
    Accelerate's own launcher code (nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(ACCELERATE_CONFIGS / f"{name}.yaml"), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    env["WORLD_SIZE"] = str(args.num_processes)
    return env


@pytest.mark.parametrize(
    "name", [n for n in sorted(EXPECTED) if EXPECTED[n]["kind"] in ("fsdp", "deepspeed")]
)
def test_launch_environment_describes_the_same_engine(name: str):
    from_file = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
    from_env = engine_from_env(_launch_env(name))
    for field in (
        "kind",
        "zero_stage",
        "offload_optimizer",
        "offload_params",
        "fsdp_version",
        "hybrid_shard",
    ):
        assert getattr(from_env, field) == getattr(from_file, field), field
    assert from_env.num_processes == from_file.num_processes


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_offload", "fsdp2_hybrid"])
def test_fsdp2_plugin_translation(name: str, monkeypatch: pytest.MonkeyPatch):
    """recipe + accelerate config -> the FSDP2 plugin Accelerate builds (its own set_mixed_precision and
    set_auto_wrap_policy steps, run here as Accelerator and prepare run them)."""
    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    for key, value in _launch_env(name).items():
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
    (problem,) = combination_problems(recipe, fsdp, cuda_available=False)
    assert "needs CUDA GPUs" in problem and "multi_cpu" in problem and "zero" in problem
    assert combination_problems(recipe, fsdp, cuda_available=True) == []
    fsdp1 = Engine(kind="fsdp", fsdp_version=1, source="old.yaml")
    assert any(
        "fsdp_version 1 is not supported" in p
        for p in combination_problems(recipe, fsdp1, cuda_available=True)
    )
    offload = read_accelerate_config(ACCELERATE_CONFIGS / "zero2_offload.yaml")
    (problem,) = combination_problems(_recipe(optimizer="adamw_8bit"), offload, cuda_available=True)
    assert "train.optimizer: adamw (not adamw_8bit)" in problem
    qlora = _recipe(mixed_precision="no").model_copy(
        update={"lora": recipe.lora.model_copy(update={"enable_lora": True, "enable_qlora": True})}
    )
    (problem,) = combination_problems(qlora, fsdp, cuda_available=True)
    assert "mixed_precision: bf16" in problem
    ddp_cpu = Engine(kind="deepspeed", zero_stage=2, use_cpu=True, source="cpu_ds.yaml")
    assert any(
        "use_cpu (or ACCELERATE_USE_CPU=true) cannot be combined" in p
        for p in combination_problems(recipe, ddp_cpu, cuda_available=False)
    )
    for name in ("zero1", "zero2", "zero3", "multi_cpu", "single_gpu"):
        engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
        if engine.kind == "deepspeed":  # one process on CPU (see the next test)
            engine = Engine(**{**engine.__dict__, "num_processes": 1})
        assert combination_problems(recipe, engine, cuda_available=False) == [], name


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
        (problem,) = combination_problems(recipe, engine, cuda_available=True)
        assert "diffusion LoRA training runs on one process or DDP" in problem and "multi_gpu" in problem
    for name in ("single_gpu", "multi_gpu", "multi_cpu"):
        engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
        assert combination_problems(recipe, engine, cuda_available=False) == []


def test_deepspeed_without_gpus_is_one_process():
    recipe = _recipe()
    engine = Engine(
        **{**read_accelerate_config(ACCELERATE_CONFIGS / "zero3.yaml").__dict__, "num_processes": 2}
    )
    (problem,) = combination_problems(recipe, engine, cuda_available=False)
    assert "DeepSpeed without GPUs runs one process, not 2" in problem and "--num-processes 1" in problem
    assert combination_problems(recipe, engine, cuda_available=True) == []
    one = Engine(**{**engine.__dict__, "num_processes": 1})
    assert combination_problems(recipe, one, cuda_available=False) == []
