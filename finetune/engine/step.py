"""One optimizer step over an accumulation window, and what happens to its outcome.

The loss of a window is the sum of the objective's per-unit losses over the whole window on all
processes, divided by the number of units (trainable tokens, pairs, micro-batches) in that window on
all processes. Accelerate (or DeepSpeed) divides by the accumulation steps in backward and DDP
averages over processes, so each micro-batch's loss is scaled by (accumulation steps x processes) to
undo both. Gradients are synchronised on the window's last micro-batch only; the window is formed
by the loop (the last one of an epoch may be short), so the sync flag is set per micro-batch, as
transformers.Trainer does, rather than counted by `accelerator.accumulate`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from accelerate.utils import DistributedType, send_to_device

from finetune.engine.checkpoints import checkpoint
from finetune.errors import FinetuneError
from finetune.metrics import ProgressLog
from finetune.parallel.context import context_parallel_step
from finetune.parallel.offload import offloaded
from finetune.parallel.sizes import ranks_sharing_rows, size_of


def train_step(run, window: list[dict]) -> dict[str, Any]:
    """Forward/backward every micro-batch of `window`, then clip and step (or skip a nonfinite step).

    Returns the outcome: loss, whether the update was applied, grad_norm, the window's units, the
    objective's metrics averaged over those units, and whether fp16 loss scaling skipped the update.
    """
    acc, model, objective, train = run.accelerator, run.model, run.objective, run.train
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
    window = [send_to_device(b, acc.device) for b in window]
    # Sync point: one all-reduce of the window's unit count, needed before any backward.
    local_units = sum(objective.units(b) for b in window)
    global_units = acc.reduce(torch.as_tensor(local_units, device=acc.device).float(), reduction="sum")
    # Processes that read the same rows count their units once each: a context-parallel group splits one
    # row's loss (its count divides by the group), a tensor-parallel group computes the whole loss on every
    # process with no gradient averaging between them (the count over all processes and the scale by the
    # process count cancel). finetune.parallel.sizes.
    num_units = (global_units / size_of(train, "context")).clamp(min=1)
    scale = train.gradient_accumulation_steps * acc.num_processes
    loss_sum = torch.zeros((), device=acc.device)
    metric_sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        acc.gradient_state._set_sync_gradients(last)
        # DeepSpeed keeps its own accumulation boundary (set from the sync flag in backward).
        no_sync = contextlib.nullcontext() if last or deepspeed else acc.no_sync(model)
        # Context parallel shards the batch for its forward and backward; offloading moves what the
        # forward saves to the host (finetune.parallel).
        with no_sync, context_parallel_step(acc, train, batch):
            with offloaded(train):
                loss, metrics = objective.loss(model, batch, num_units)
            # Under DeepSpeed the last backward also runs the engine's step (clip, update, zero grad).
            acc.backward(loss * scale)
        loss_sum += loss.detach().float()
        for name, value in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0) + value.detach().float()
    loss_value = acc.reduce(loss_sum, reduction="sum").item()  # sync point: the nonfinite check needs it
    units = int(global_units.item()) // ranks_sharing_rows(train)
    result: dict[str, Any] = {
        "loss": loss_value,
        "units": units,
        "metrics": _means(acc, metric_sums, num_units),
    }
    if deepspeed:
        outcome = _deepspeed_outcome(run, loss_value)
        if outcome["applied"] and not outcome.get("fp16_skipped"):
            objective.after_update(model)
        return {**result, **outcome}
    if not math.isfinite(loss_value):
        run.optimizer.zero_grad(set_to_none=True)
        return {**result, "applied": False}
    # The gradient norm of every step (clipping at inf when train.max_grad_norm is null: norm only):
    # a finite loss can still give an inf/NaN gradient, and such an update would ruin the weights.
    # Under fp16 the scaler finds those itself (and lowers its scale), so its steps are left to it.
    grad_norm = acc.clip_grad_norm_(model.parameters(), train.max_grad_norm or float("inf"))
    if acc.scaler is None and not math.isfinite(float(grad_norm)):  # sync point
        run.optimizer.zero_grad(set_to_none=True)
        return {**result, "applied": False, "grad_norm": float(grad_norm)}
    fp16_skipped = optimizer_step(acc, run.optimizer)
    run.optimizer.zero_grad(set_to_none=True)
    if not fp16_skipped:
        objective.after_update(model)
    return {
        **result,
        "applied": True,
        "fp16_skipped": fp16_skipped,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
    }


COUNT_PREFIX = "count:"
"""A metric sum `name` is averaged over the window's units, or over the window's sum of the metric
`count:name` when the objective returns one (e.g. KTO's rewards of its desirable examples only); the
`count:` entries themselves are not logged."""


def _means(acc, sums: dict[str, torch.Tensor], num_units: torch.Tensor) -> dict[str, float]:
    """The objective's metric sums over the window, averaged over its units on all processes."""
    if not sums:
        return {}
    names = sorted(sums)
    totals = dict(
        zip(names, acc.reduce(torch.stack([sums[n] for n in names]), reduction="sum").tolist(), strict=True)
    )
    units = float(num_units)
    means = {}
    for name, total in totals.items():
        if name.startswith(COUNT_PREFIX):
            continue
        count = totals.get(COUNT_PREFIX + name, units)
        if count > 0:  # a metric with no example in the window (e.g. no undesirable one) is left out
            means[name] = total / count
    return means


def optimizer_step(acc, optimizer) -> bool:
    """Step the optimizer; True when fp16 loss scaling skipped the update (an overflow).

    The skip is read from the scale, which GradScaler lowers exactly when it finds an inf/NaN
    gradient: Accelerate's `optimizer_step_was_skipped` watches whether the optimizer's step method
    ran, but GradScaler always calls the step of a fused optimizer (the fused kernel itself skips the
    update), so that flag would miss every overflow. Reading the scale is a sync point (fp16 only).
    """
    if acc.scaler is None:
        optimizer.step()
        return False
    scale_before = acc.scaler.get_scale()
    optimizer.step()
    return acc.scaler.get_scale() < scale_before


def _deepspeed_outcome(run, loss_value: float) -> dict[str, Any]:
    """The step's outcome under DeepSpeed, whose engine has already stepped inside the last backward.

    DeepSpeed skips an update whose gradient norm is not finite when clipping is on or precision is
    16-bit (its overflow check): that is the nonfinite skip here. An update it applied despite a
    nonfinite loss cannot be undone, so the run stops.
    """
    acc = run.accelerator
    skipped = bool(acc.optimizer_step_was_skipped)
    grad_norm = acc.clip_grad_norm_(run.model.parameters(), run.train.max_grad_norm or 0.0)
    if not math.isfinite(loss_value):
        if not skipped:
            raise FinetuneError(
                f"nonfinite loss ({loss_value}) at step {run.state.step + 1} and DeepSpeed applied the "
                "update (its overflow check is off with fp32 and no clipping): set train.max_grad_norm "
                "so DeepSpeed skips such steps, and resume from the last checkpoint"
            )
        return {"applied": False}
    return {
        "applied": True,
        "fp16_skipped": skipped and run.train.mixed_precision == "fp16",
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
    }


def count_outcome(run, result: dict, log: ProgressLog) -> bool:
    """Count a step's outcome; True when its update was applied.

    A nonfinite step is logged; after train.max_consecutive_nonfinite of them in a row the run saves
    a checkpoint and stops. Nonfinite steps never update the weights or the optimizer, so they are
    still the last good state. The checkpoint is named after the steps consumed (data position and
    schedule are there): naming it after an earlier step would overwrite that step's real checkpoint.
    """
    st, train = run.state, run.train
    if result["applied"]:
        st.nonfinite_in_a_row = 0
        st.fp16_skipped_steps += int(result.get("fp16_skipped", False))
        st.num_units += result["units"]
        return True
    st.nonfinite_in_a_row += 1
    st.nonfinite_steps += 1
    log.log(
        {
            "step": st.step,
            "event": "nonfinite_loss" if not math.isfinite(result["loss"]) else "nonfinite_grad",
            "loss": result["loss"],
            "grad_norm": result.get("grad_norm"),
            "in_a_row": st.nonfinite_in_a_row,
        }
    )
    if st.nonfinite_in_a_row >= train.max_consecutive_nonfinite:
        path = checkpoint(run)
        raise FinetuneError(
            f"{st.nonfinite_in_a_row} nonfinite steps in a row (a loss or gradient that is inf or NaN; limit "
            "train.max_consecutive_nonfinite="
            f"{train.max_consecutive_nonfinite}); the last good state (weights and optimizer as of the last "
            f"finite step) is saved at {path}. Lower train.lr, check the data, or use bf16 instead of fp16."
        )
    return False
