"""One optimizer step of the engine (finetune.engine.step.train_step) with the causal-LM objective:
token-normalised gradient accumulation, nonfinite-loss skipping, clipping."""

from __future__ import annotations

import copy

import pytest
import torch

from finetune.data.batching.collate import collate_rows
from finetune.engine.step import train_step
from finetune.objectives.sft import SFTObjective
from finetune.recipe import validate_recipe
from tests.fakes import fake_run
from tests.tiny import sequences, tiny_model


def _run(model, ga: int, max_grad_norm=None):
    return fake_run(_sft(), model, ga=ga, max_grad_norm=max_grad_norm)


def _sft() -> SFTObjective:
    recipe = validate_recipe(
        {
            "model": {"model_path": "org/base"},
            "data": {"datasets": [{"path": "a.jsonl", "type": "alpaca"}]},
            "train": {"output_dir": "out"},
        }
    )
    return SFTObjective(recipe)


def _rows():
    # Sequences of different lengths and different trainable counts: a per-micro-batch mean would
    # weight them wrongly, a token-normalised loss does not.
    return sequences()


def test_accumulation_matches_one_big_batch():
    base = tiny_model("sdpa")
    rows = _rows()
    run_ga = _run(copy.deepcopy(base), ga=4)
    window = [collate_rows([r], pad_token_id=0, packed=False) for r in rows]
    out_ga = train_step(run_ga, window)
    run_big = _run(copy.deepcopy(base), ga=1)
    out_big = train_step(run_big, [collate_rows(rows, pad_token_id=0, packed=False)])
    assert out_ga["applied"] and out_big["applied"]
    assert (
        out_ga["units"] == out_big["units"] == sum(sum(1 for t in r["labels"][1:] if t != -100) for r in rows)
    )
    assert out_ga["loss"] == pytest.approx(out_big["loss"], rel=1e-5)
    params_ga = dict(run_ga.accelerator.unwrap_model(run_ga.model).named_parameters())
    for name, p in run_big.accelerator.unwrap_model(run_big.model).named_parameters():
        torch.testing.assert_close(params_ga[name], p, rtol=1e-5, atol=1e-6, msg=name)
    # The update really moved the weights (so the comparison is not vacuous).
    moved = any(
        not torch.equal(p, q) for p, q in zip(base.parameters(), run_big.model.parameters(), strict=True)
    )
    assert moved


def test_mean_of_micro_batch_means_would_differ():
    """Control for the test above: averaging per-micro-batch mean losses gives other gradients, so
    the equivalence test can tell the two apart."""
    rows = _rows()
    grads = []
    for per_batch_mean in (True, False):
        model = tiny_model("sdpa")
        if per_batch_mean:
            losses = []
            for r in rows:
                batch = collate_rows([r], pad_token_id=0, packed=False)
                labels = batch.pop("labels")
                losses.append(model(**batch, labels=labels, use_cache=False).loss)
            torch.stack([x for x in losses if torch.isfinite(x)]).mean().backward()
        else:
            batch = collate_rows(rows, pad_token_id=0, packed=False)
            labels = batch.pop("labels")
            model(**batch, labels=labels, use_cache=False).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert not torch.allclose(grads[0], grads[1], rtol=1e-2, atol=1e-6)


def test_nonfinite_loss_skips_the_update():
    base = tiny_model("sdpa")
    with torch.no_grad():
        base.model.norm.weight.fill_(float("nan"))
    run = _run(copy.deepcopy(base), ga=2)
    before = {n: p.clone() for n, p in run.model.named_parameters()}
    rows = _rows()
    out = train_step(run, [collate_rows([r], pad_token_id=0, packed=False) for r in rows[:2]])
    assert out["applied"] is False
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(p, before[name], equal_nan=True, msg=name)
        assert p.grad is None


def test_clipping_reports_grad_norm_and_scales_the_update():
    """With max_grad_norm below the gradient's norm, the reported norm is the unclipped one and the SGD
    update is the unclipped update times max_grad_norm / norm (torch's clip_grad_norm_, whose
    coefficient is max_norm / (norm + 1e-6))."""
    model = tiny_model("sdpa")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = collate_rows(_rows(), pad_token_id=0, packed=False)
    free = _run(copy.deepcopy(model), ga=1)
    norm = train_step(free, [batch])["grad_norm"]
    clipped = _run(copy.deepcopy(model), ga=1, max_grad_norm=norm / 4)
    out = train_step(clipped, [batch])
    assert out["applied"] and out["grad_norm"] == pytest.approx(norm, rel=1e-6)
    coefficient = (norm / 4) / (norm + 1e-6)
    free_params = dict(free.model.named_parameters())
    moved = 0
    for name, p in clipped.model.named_parameters():
        update, free_update = p.detach() - before[name], free_params[name].detach() - before[name]
        # atol: the rounding of (weight after - weight before), measured up to 6e-8 here.
        torch.testing.assert_close(update, free_update * coefficient, rtol=1e-4, atol=2e-7, msg=name)
        moved += int(free_update.abs().max() > 1e-4)
    assert moved > 0  # the comparison is not of unmoved weights


def test_a_finite_loss_with_nonfinite_gradients_does_not_update():
    model = tiny_model("sdpa")
    run = _run(copy.deepcopy(model), ga=1)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    param = next(p for p in run.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    out = train_step(run, [collate_rows(_rows(), pad_token_id=0, packed=False)])
    hook.remove()
    assert out["applied"] is False and torch.isfinite(torch.tensor(out["loss"]))
    assert out["grad_norm"] != out["grad_norm"]  # NaN
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], msg=name)
        assert p.grad is None
