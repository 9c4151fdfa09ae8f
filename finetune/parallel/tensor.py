"""Tensor parallel: the model's own TP plan (transformers' `tp_plan="auto"` through its DistributedConfig,
weights as DTensors on a device mesh over every process), prepared without a data-parallel wrapper and
checkpointed shard by shard through torch.distributed.checkpoint.

Why not Accelerate's ParallelismConfig(tp_size): Accelerate 1.15 refuses it on CPU processes (MULTI_CPU
is not among the types it accepts), and for a model transformers has already split it adds only a size
check; transformers 5 builds the TP mesh from its DistributedConfig whatever Accelerate's is. What the
TP model needs from Accelerate is no DDP around it (DDP would average the shards of different weights):
`prepare_model(evaluation_mode=True)`, Accelerate's way to prepare a model without a distributed wrapper.

Data parallel beside tensor parallel (more processes than train.tensor_parallel_size): transformers'
DistributedConfig(tp_size, fsdp_size) builds the 2-D mesh (fsdp, tp) and wraps the TP model in torch's
FSDP2 (`fully_shard` on the fsdp dimension, by the model's FSDP plan) as it loads it, so gradients are
reduced across the TP groups by FSDP2. Accelerate's own 2-D route cannot run it: ParallelismConfig
refuses TP with plain replication ("cannot be used with pure data parallelism ... set dp_shard_size >
1"), its dp_shard needs Accelerate's FSDP plugin, which starts on CUDA only, and the plugin would wrap
the model transformers has already wrapped.

Why not Accelerate's save_state for the model and optimizer: it writes the model's state dict with
safetensors (which refuses DTensors) and the optimizer's from the main process only, and every process
holds different shards of both. torch.distributed.checkpoint (DCP) writes every process's shards and
loads them back into the same plan; Accelerate's FSDP2 checkpoints use it too.
"""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

SHARDED_STATE = "tp_state"
"""A tensor-parallel checkpoint's folder of DCP files: the trained weights' and the optimizer's shards."""


def distributed_config(train: Any, num_processes: int = 0):
    """transformers' DistributedConfig for `from_pretrained`, or None without tensor parallel: the model's
    own TP plan over train.tensor_parallel_size processes and, on more processes than that, FSDP2 across
    the TP groups (transformers' 2-D mesh, dims (fsdp, tp), tp innermost as finetune.parallel.sizes lays
    out ranks): data parallel beside tensor parallel."""
    if train.tensor_parallel_size <= 1:
        return None
    from transformers.distributed import DistributedConfig

    tp = train.tensor_parallel_size
    data_parallel = max(1, num_processes // tp)
    return DistributedConfig(tp_size=tp, tp_plan="auto", fsdp_size=data_parallel)


def is_tensor_parallel(model) -> bool:
    """Whether `model` (possibly PEFT- or Accelerate-wrapped) was split by a TP plan."""
    base = getattr(model, "module", model)
    config = getattr(getattr(base, "config", None), "distributed_config", None)
    return getattr(config, "tp_size", 1) > 1


def planned_modules(model) -> dict[str, str]:
    """{module name: TP style} of a TP model's split modules: its resolved plan (`model.tp_plan`, keys with
    `*` for layer numbers; transformers 5 adds embed_tokens as embedding_rowwise beside the config's
    base_model_tp_plan and the head's lm_head colwise_gather_output)."""
    plan = getattr(model, "tp_plan", None) or {}
    return {
        name: style
        for name, _ in model.named_modules()
        for pattern, style in plan.items()
        if fnmatch(name, pattern)
    }


def check_lora_plan(model, modules_to_save: list[str] | None) -> None:
    """Before PEFT wraps a TP model: refuse lora.modules_to_save entries the plan splits. PEFT's trained
    copy of such a module is a deepcopy of its DTensor weights outside the plan's hooks (measured: the
    deepcopy itself fails on the second process, 'invalid python storage')."""
    planned = planned_modules(model)
    split = sorted(
        {
            f"{entry}, which it splits {style}"
            for entry in modules_to_save or []
            for name, style in planned.items()
            if name == entry or name.endswith("." + entry)
        }
    )
    if split:
        raise FinetuneError(
            f"tensor parallel with LoRA: lora.modules_to_save names {split[0]} (the model's TP plan): PEFT "
            "would train a whole copy of its DTensor shards outside the plan; remove it from "
            "lora.modules_to_save (train it fully without tensor parallel), or train without LoRA "
            "(lora.enable_lora: false), which splits every weight"
        )


def check_adapter_layers(model) -> None:
    """After PEFT wrapped a TP model: refuse LoRA adapters beside layers PEFT cannot shard them with. PEFT
    0.21 shards an adapter beside a column-wise layer (q/k/v/gate/up in Llama's plan); beside a row-wise
    one (o_proj, down_proj) the forward fails under transformers 5 (measured: "shape '[32, 32]' is
    invalid for input of size 2048" in the sharded matmul), and beside any other style PEFT leaves the
    adapter unsharded."""
    wrong = []
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        plan = getattr(base, "_hf_tp_plan", None) if base is not None else None
        if plan is not None and plan != "colwise":
            wrong.append(f"{name.removeprefix('base_model.model.')} ({plan})")
    if wrong:
        raise FinetuneError(
            f"tensor parallel with LoRA: {len(wrong)} adapted layer(s) the TP plan does not split column-wise, "
            f"e.g. {wrong[0]}: PEFT shards adapters only beside column-wise layers; set "
            "lora.lora_target_modules to those (Llama, Qwen2: [q_proj, k_proj, v_proj, gate_proj, up_proj]), "
            "or train without tensor parallel"
        )


def prepare_tensor_parallel(accelerator, model, optimizer, scheduler):
    """(model, optimizer, scheduler) prepared for a TP model: the model without a data-parallel wrapper
    (mixed precision and torch.compile still applied), the optimizer as it is (Accelerate's would be
    saved from the main process only), the scheduler by Accelerate (its state is in every checkpoint);
    checkpoints hold the model's and optimizer's shards (`register_sharded_checkpoints`)."""
    model = accelerator.prepare_model(model, evaluation_mode=True)
    scheduler = accelerator.prepare(scheduler)
    register_sharded_checkpoints(accelerator, model, optimizer)
    return model, optimizer, scheduler


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Trained tensors only: a LoRA run's frozen base is rebuilt from the recipe on resume.
    options = StateDictOptions(ignore_frozen_params=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def register_sharded_checkpoints(accelerator, model, optimizer) -> None:
    """Every process writes its shards of the trained weights and optimizer states into
    <checkpoint>/tp_state through torch.distributed.checkpoint on `accelerator.save_state`, and reads
    them back on `load_state`; Accelerate then saves and loads the rest (scheduler, RNG)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    def save_hook(models, weights, output_dir):
        dcp.save(_state(model, optimizer), checkpoint_id=str(Path(output_dir) / SHARDED_STATE))
        weights.clear()  # written above, shard by shard

    def load_hook(models, input_dir):
        folder = Path(input_dir) / SHARDED_STATE
        if not folder.is_dir():
            raise FinetuneError(
                f"{input_dir} holds no {SHARDED_STATE}/: it was not written by a tensor-parallel run; resume "
                "with the recipe (and train.tensor_parallel_size) that wrote it"
            )
        state = _state(model, optimizer)
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(ignore_frozen_params=True),
        )
        models.clear()  # loaded above

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
