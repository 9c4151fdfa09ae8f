"""Checks the preference tests share when they compare a loss with TRL's trainers (the text losses in
tests/unit/losses/test_preference_losses.py, the objective on images in
tests/unit/objectives/test_preference_images.py): one backward's loss and gradients, TRL's logged metrics,
and ours against them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

# The metrics of a paired loss that TRL's DPO trainer logs too.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


def loss_and_grads(
    model, compute: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`compute()`'s loss after one backward from zeroed gradients, and the gradients by parameter name."""
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def objective_loss_and_grads(obj, model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    """A preference objective's loss on `batch` after one backward (`loss_and_grads`), the gradients by
    parameter name, and the objective's metrics."""
    out = {}

    def compute():
        loss, out["metrics"] = obj.loss(model, batch, obj.units(batch))
        return loss

    loss, grads = loss_and_grads(model, compute)
    return loss, grads, out["metrics"]


def assert_grads_close(ours: dict, theirs: dict, *, rtol: float, atol: float) -> None:
    """The same parameters have gradients, each close to theirs."""
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], msg=name, rtol=rtol, atol=atol)


def trl_metrics(trainer, model) -> dict[str, float]:
    """The metrics a TRL trainer logged for its last batch (train or eval, as `model` is in)."""
    return {k: v[-1] for k, v in trainer._metrics["train" if model.training else "eval"].items()}


def assert_metrics_match(
    ours: dict[str, float], theirs: dict[str, float], keys: Iterable[str] = PAIR_METRICS
):
    """Our means of `keys` equal TRL's logged ones."""
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
