"""Parameter groups, optimizer and LR schedule (torch optimizers, transformers schedules)."""

from __future__ import annotations

import importlib.util

import torch

from finetune.errors import FinetuneError


def param_groups(model: torch.nn.Module, weight_decay: float, no_decay_params: list[str]) -> list[dict]:
    """Two groups: decayed weights, and parameters whose name matches no_decay_params (biases, norms)
    or that are 1-D, which get no weight decay."""
    decay, no_decay = [], []
    patterns = [p.lower() for p in no_decay_params]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        if param.ndim < 2 or any(p in lowered for p in patterns):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: torch.nn.Module,
    *,
    name: str,
    lr: float,
    weight_decay: float,
    no_decay_params: list[str],
    betas: tuple[float, float],
    eps: float,
    cpu_offload: bool = False,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """adamw (fused kernels with `fused`, for CUDA), adamw_8bit (bitsandbytes) or sgd.

    `fused` is decided by the caller from the device the model will train on: the optimizer is built
    before `accelerator.prepare` moves the parameters there, so they are still on the CPU here.

    `cpu_offload` (DeepSpeed with offload_optimizer): DeepSpeed's CPU AdamW, which updates the
    offloaded fp32 states on the CPU with vectorised kernels (DeepSpeed refuses a plain torch
    optimizer there). It is compiled on first use (about a minute; cached afterwards).
    """
    groups = param_groups(model, weight_decay, no_decay_params)
    if not groups:
        raise FinetuneError("the model has no trainable parameters (check lora.lora_target_modules)")
    if cpu_offload:
        if name != "adamw":
            raise FinetuneError(
                f"train.optimizer {name}: optimizer offload needs adamw (DeepSpeed's CPU Adam)"
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)
    if name == "adamw_8bit":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise FinetuneError("train.optimizer adamw_8bit needs bitsandbytes: pip install -e '.[qlora]'")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    raise FinetuneError(f"train.optimizer: unknown optimizer {name!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    style: str,
    num_warmup_steps: int,
    num_training_steps: int,
    lr: float,
    lr_min: float,
):
    """Warmup then constant / linear (to lr_min) / cosine (to lr_min), from transformers.optimization."""
    from transformers.optimization import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_polynomial_decay_schedule_with_warmup,
    )

    if style == "constant" or (style == "linear" and lr_min >= lr):
        # Linear decay from lr to lr_min == lr is constant; transformers' polynomial schedule refuses it.
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps)
    if style == "linear":
        # Polynomial decay with power 1 is linear decay to lr_end.
        return get_polynomial_decay_schedule_with_warmup(
            optimizer, num_warmup_steps, num_training_steps, lr_end=lr_min, power=1.0
        )
    if style == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps, num_training_steps, min_lr=lr_min
        )
    raise FinetuneError(f"train.lr_decay_style: unknown schedule {style!r}")


def optimizer_for(
    model: torch.nn.Module, train, *, cpu_offload: bool = False, device: torch.device | None = None
) -> torch.optim.Optimizer:
    """`build_optimizer` with the recipe's train section (optimizer, lr, decay, Adam settings);
    fused AdamW when `device` (where training runs) is a CUDA device."""
    return build_optimizer(
        model,
        name=train.optimizer,
        lr=train.lr,
        weight_decay=train.weight_decay,
        no_decay_params=train.no_decay_params,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        cpu_offload=cpu_offload,
        fused=device is not None and device.type == "cuda",
    )


def scheduler_for(optimizer: torch.optim.Optimizer, train, total_steps: int):
    """`build_scheduler` with the recipe's train section over `total_steps` optimizer steps."""
    return build_scheduler(
        optimizer,
        style=train.lr_decay_style,
        num_warmup_steps=int(train.lr_warmup_ratio * total_steps),
        num_training_steps=total_steps,
        lr=train.lr,
        lr_min=train.lr_min,
    )
