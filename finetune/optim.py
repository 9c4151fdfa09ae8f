"""Parameter groups, optimizer and LR schedule (torch and transformers optimizers, transformers schedules).

`train.optimizer` names come from finetune.recipe.optimizers: `adamw` and `muon` are built here, every
other name by transformers' own table (`Trainer.get_optimizer_cls_and_kwargs`), so its defaults and
optim_args are exactly what a transformers Trainer run with `optim=<name>` gets.
"""

from __future__ import annotations

import torch

from finetune.errors import FinetuneError
from finetune.recipe.optimizers import (
    LOW_RANK_OPTIMIZERS,
    PACKAGES,
    SCHEDULE_FREE_OPTIMIZERS,
    missing_package,
)


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    no_decay_params: list[str],
    lr_by_prefix: dict[str, float] | None = None,
) -> list[dict]:
    """Two groups: decayed weights, and parameters whose name matches no_decay_params (biases, norms)
    or that are 1-D, which get no weight decay. With `lr_by_prefix`, the parameters whose name starts
    with a prefix get two groups of their own with that `lr` (torch optimizers read a group's lr, and
    the schedule scales each group's initial lr)."""
    prefixes = list(lr_by_prefix or {})
    buckets: dict[tuple[str | None, bool], list] = {}
    patterns = [p.lower() for p in no_decay_params]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        decayed = not (param.ndim < 2 or any(p in lowered for p in patterns))
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        buckets.setdefault((prefix, decayed), []).append(param)
    groups = []
    for prefix in (None, *prefixes):
        for decayed in (True, False):
            params = buckets.get((prefix, decayed))
            if params:
                group = {"params": params, "weight_decay": weight_decay if decayed else 0.0}
                if prefix is not None:
                    group["lr"] = lr_by_prefix[prefix]
                groups.append(group)
    return groups


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
    optim_args: dict | None = None,
    optim_target_modules: list[str] | str | None = None,
    warmup_steps: int = 0,
    gradient_accumulation_steps: int = 1,
    loraplus_lr_ratio: float | None = None,
    lr_by_prefix: dict[str, float] | None = None,
) -> torch.optim.Optimizer:
    """adamw (fused kernels with `fused`, for CUDA), muon, or one of transformers' optimizers by name.

    `fused` is decided by the caller from the device the model will train on: the optimizer is built
    before `accelerate.prepare` moves the parameters there, so they are still on the CPU here.

    `cpu_offload` (DeepSpeed with offload_optimizer): DeepSpeed's CPU AdamW, which updates the
    offloaded fp32 states on the CPU with vectorised kernels (DeepSpeed refuses a plain torch
    optimizer there). It is compiled on first use (about a minute; cached afterwards).

    `optim_args`, `optim_target_modules`, `warmup_steps` (schedule-free) and
    `gradient_accumulation_steps` go to transformers as its TrainingArguments fields of those names.

    `loraplus_lr_ratio` (LoRA+): PEFT's create_loraplus_optimizer builds the chosen optimizer class
    with its settings on PEFT's groups (A matrices at lr, B matrices at lr x ratio, decay on B only as
    PEFT does it with `weight_decay`).
    """
    groups = param_groups(model, weight_decay, no_decay_params, lr_by_prefix)
    if lr_by_prefix and (loraplus_lr_ratio is not None or name in ("muon", *LOW_RANK_OPTIMIZERS)):
        raise FinetuneError(
            f"per-part learning rates ({', '.join(lr_by_prefix)}) need an optimizer that takes finetune's "
            f"parameter groups; train.optimizer {name} (or LoRA+) makes its own: use adamw or drop them"
        )
    if not groups:
        raise FinetuneError("the model has no trainable parameters (check lora.lora_target_modules)")
    if cpu_offload:
        if name != "adamw":
            raise FinetuneError(
                f"train.optimizer {name}: optimizer offload needs adamw (DeepSpeed's CPU Adam)"
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    if loraplus_lr_ratio is not None and name in ("muon", *LOW_RANK_OPTIMIZERS):
        raise FinetuneError(
            f"lora.loraplus_lr_ratio sets per-matrix learning rates, which train.optimizer {name} (its own "
            "parameter grouping) cannot take: use adamw or another optimizer, or drop loraplus_lr_ratio"
        )
    if name == "adamw":
        if loraplus_lr_ratio is not None:
            return _loraplus(model, torch.optim.AdamW, {"betas": betas, "eps": eps, "fused": fused or None},
                             lr=lr, ratio=loraplus_lr_ratio, weight_decay=weight_decay)  # fmt: skip
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)
    if name == "muon":
        return muon_optimizer(
            model, lr=lr, weight_decay=weight_decay, no_decay_params=no_decay_params, betas=betas, eps=eps,
            muon_args=optim_args or {},
        )  # fmt: skip
    install = missing_package(name)
    if install is not None:
        raise FinetuneError(
            f"train.optimizer {name} needs the {PACKAGES[name].module} package, which is not installed: {install}"
        )
    from accelerate.state import PartialState
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        # Without use_configured_state, TrainingArguments' device setup resets Accelerate's state and
        # the run's Accelerator with it; it needs one to exist (finetune's tests build optimizers alone).
        accelerator_config={"use_configured_state": bool(PartialState._shared_state)},
        output_dir="unused",  # required by TrainingArguments; nothing is written there
        optim=name,
        optim_args=",".join(f"{k}={v}" for k, v in (optim_args or {}).items()) or None,
        optim_target_modules=optim_target_modules,
        learning_rate=lr,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=eps,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        gradient_accumulation_steps=gradient_accumulation_steps,
        report_to="none",
    )
    try:
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except (ImportError, ValueError, TypeError, NotImplementedError) as exc:
        raise FinetuneError(f"train.optimizer {name}: {exc}") from None
    # As Trainer.create_optimizer does: GaLore and APOLLO return their own groups (projected targets
    # and the rest) in kwargs["params"]; every other optimizer gets finetune's weight-decay groups.
    params = kwargs.pop("params", groups)
    if loraplus_lr_ratio is not None:
        kwargs.pop("lr", None)
        return _loraplus(
            model, optimizer_cls, kwargs, lr=lr, ratio=loraplus_lr_ratio, weight_decay=weight_decay
        )
    return optimizer_cls(params, **kwargs)


def _loraplus(model, optimizer_cls, kwargs: dict, *, lr: float, ratio: float, weight_decay: float):
    """LoRA+ through PEFT's create_loraplus_optimizer (its groups: A at lr, B at lr x ratio, embeddings'
    LoRA at its default 1e-6)."""
    from peft import PeftModel
    from peft.optimizers import create_loraplus_optimizer

    if not isinstance(model, PeftModel):
        raise FinetuneError("lora.loraplus_lr_ratio needs LoRA adapters: set lora.enable_lora: true")
    return create_loraplus_optimizer(
        model, optimizer_cls, lr=lr, loraplus_lr_ratio=ratio, loraplus_weight_decay=weight_decay, **kwargs
    )


def muon_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    no_decay_params: list[str],
    betas: tuple[float, float],
    eps: float,
    muon_args: dict,
) -> MuonWithAdamW:
    """torch's Muon on the trainable 2-D hidden weight matrices (attention and MLP projections, LoRA's
    A and B), torch's AdamW on embeddings, the output head, norms and biases, as Muon's authors use it.

    Muon's `adjust_lr_fn` defaults to `match_rms_adamw` (Moonshot's scaling, 0.2 * sqrt(max(A, B))),
    which gives its updates AdamW's RMS, so `train.lr` and `train.weight_decay` serve both halves.
    """
    edges = {
        id(p)
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None
        for p in module.parameters()
    }
    patterns = [p.lower() for p in no_decay_params]
    buckets: dict[tuple[bool, bool], list] = {}
    for pname, param in model.named_parameters():
        if not param.requires_grad:
            continue
        use_muon = param.ndim == 2 and id(param) not in edges
        decayed = param.ndim >= 2 and not any(p in pname.lower() for p in patterns)
        buckets.setdefault((use_muon, decayed), []).append(param)
    groups = [
        {"params": params, "use_muon": use_muon, "weight_decay": weight_decay if decayed else 0.0}
        for (use_muon, decayed), params in sorted(buckets.items(), reverse=True)
    ]
    muon_kwargs = {"adjust_lr_fn": "match_rms_adamw", **muon_args}
    try:
        return MuonWithAdamW(
            groups, lr=lr, muon_kwargs=muon_kwargs, adamw_kwargs={"betas": betas, "eps": eps}
        )
    except (
        TypeError,
        ValueError,
    ) as exc:  # torch's Muon checks its arguments (a wrong type, an unknown name)
        import inspect

        known = [
            n for n in inspect.signature(torch.optim.Muon).parameters if n not in ("self", "params", "lr")
        ]
        raise FinetuneError(
            f"train.optim_args {muon_args}: torch's Muon refuses them ({exc}); it takes {', '.join(known)} "
            "(numbers, and adjust_lr_fn a name)"
        ) from None


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the param groups marked `use_muon`, AdamW for the others, as one optimizer.

    Written by hand because torch has no composite optimizer, and the loop, `accelerate.prepare`, the LR
    scheduler and checkpoints each take one. The groups and the state live here and the two inner
    optimizers share them (the same dicts), so the scheduler's LR changes reach both and
    `state_dict` / `load_state_dict` are torch's own; after a load the inner optimizers are re-linked.
    """

    def __init__(self, groups: list[dict], *, lr: float, muon_kwargs: dict, adamw_kwargs: dict):
        self._kwargs = {True: muon_kwargs, False: adamw_kwargs}
        super().__init__(groups, {"lr": lr})
        self._link()

    def _link(self) -> None:
        self._parts = []
        for use_muon, cls in ((True, torch.optim.Muon), (False, torch.optim.AdamW)):
            mine = [g for g in self.param_groups if g["use_muon"] is use_muon]
            if not mine:
                continue
            part = cls(
                [{"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"]} for g in mine],
                **self._kwargs[use_muon],
            )
            for theirs, group in zip(part.param_groups, mine, strict=True):
                for key, value in theirs.items():
                    group.setdefault(key, value)  # the inner optimizer's defaults (betas, momentum, ...)
            part.param_groups = mine
            part.state = self.state
            self._parts.append(part)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()  # torch's load replaced the groups and the state: share the new ones

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            part.step()
        return loss


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
    model: torch.nn.Module,
    train,
    *,
    cpu_offload: bool = False,
    device: torch.device | None = None,
    total_steps: int = 0,
    loraplus_lr_ratio: float | None = None,
    lr_by_prefix: dict[str, float] | None = None,
) -> torch.optim.Optimizer:
    """`build_optimizer` with the recipe's train section (optimizer, lr, decay, Adam settings, optim_args);
    fused AdamW when `device` (where training runs) is a CUDA device. A schedule-free optimizer warms up
    itself over lr_warmup_ratio of `total_steps` (and `scheduler_for` then keeps the LR constant)."""
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
        optim_args=train.optim_args,
        optim_target_modules=train.optim_target_modules,
        warmup_steps=int(train.lr_warmup_ratio * total_steps),
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        loraplus_lr_ratio=loraplus_lr_ratio,
        lr_by_prefix=lr_by_prefix,
    )


def scheduler_for(optimizer: torch.optim.Optimizer, train, total_steps: int):
    """`build_scheduler` with the recipe's train section over `total_steps` optimizer steps; constant
    for a schedule-free optimizer, which warms up itself (see `optimizer_for`)."""
    schedule_free = train.optimizer in SCHEDULE_FREE_OPTIMIZERS
    return build_scheduler(
        optimizer,
        style=train.lr_decay_style,
        num_warmup_steps=0 if schedule_free else int(train.lr_warmup_ratio * total_steps),
        num_training_steps=total_steps,
        lr=train.lr,
        lr_min=train.lr_min,
    )
