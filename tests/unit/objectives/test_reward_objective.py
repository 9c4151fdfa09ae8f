"""The reward-model objective (train.objective reward) on a tiny Llama with a score head: its loss and
metrics are finetune.losses.reward's functions (those are compared with TRL's RewardTrainer in
tests/unit/losses/test_reward_losses.py), packed rows give the loss and gradients of one pair per row,
accumulation over micro-batches equals one batch, evaluation reports the means over held-out pairs, and
LoRA trains the score head whole."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from finetune.engine.step import train_step
from finetune.losses.reward import bradley_terry_loss, sequence_scores
from finetune.objectives.reward import RewardObjective, held_out_means
from finetune.recipe import validate_recipe
from tests.fakes import cpu_accelerator, fake_run
from tests.unit.losses.test_reward_losses import PAD, packed_batch, pairs, tiny_reward_model

TOL = {"rtol": 1e-5, "atol": 1e-6}
DEMO_TOKENIZER = Path(__file__).resolve().parents[3] / "recipes" / "demo" / "tokenizer"


def objective(center: float = 0.0, **train) -> RewardObjective:
    recipe = validate_recipe(
        {
            "model": {"model_path": "org/base"},
            "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
            "train": {"output_dir": "out", "objective": "reward", **train},
            "reward": {"center_rewards_coefficient": center},
        }
    )
    obj = RewardObjective(recipe)
    obj.accelerator, obj.pad_id = cpu_accelerator(), PAD
    return obj


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def expected(model, data, margins=None, center=0.0):
    """The pure functions on one pair per row: per-pair losses, chosen and rejected scores."""
    batch = packed_batch(data, None, margins)
    scores = sequence_scores(model, batch, 2 * batch["num_units"], pad_token_id=PAD)
    chosen, rejected = scores[0::2], scores[1::2]
    return (
        bradley_terry_loss(chosen, rejected, margin=batch.get("margin"), center_rewards_coefficient=center),
        chosen,
        rejected,
    )


@pytest.mark.parametrize("with_margin", [False, True])
def test_the_loss_and_metrics_are_the_pure_functions_summed_over_pairs(with_margin):
    data, margins = pairs(5, seed=2), ([0.5, -1.0, 0.0, 2.0, 0.25] if with_margin else None)
    obj, model = objective(center=0.1), tiny_reward_model()
    batch = packed_batch(data, [[0, 1, 2], [3, 4]], margins)
    assert obj.units(batch) == 5
    loss, metrics = obj.loss(model, batch, torch.tensor(10))  # the window holds 10 pairs on all processes
    losses, chosen, rejected = expected(model, data, margins, center=0.1)
    torch.testing.assert_close(loss, losses.sum() / 10, **TOL)
    assert set(metrics) == {"accuracy", "margin", "rewards/chosen", "rewards/rejected"}
    assert metrics["accuracy"].item() == (chosen > rejected).sum().item()
    torch.testing.assert_close(metrics["margin"], (chosen - rejected).sum().detach(), **TOL)
    torch.testing.assert_close(metrics["rewards/chosen"], chosen.sum().detach(), **TOL)
    assert not any(v.requires_grad for v in metrics.values())


def test_packed_rows_give_the_loss_and_gradients_of_one_pair_per_row():
    data = pairs(6, seed=3)
    results = []
    for bins in ([[0, 1, 2], [3, 4, 5]], None):
        obj, model = objective(center=0.01), tiny_reward_model()
        batch = packed_batch(data, bins, [0.1 * k for k in range(6)])
        loss, metrics = obj.loss(model, batch, obj.units(batch))
        loss.backward()
        results.append((loss.detach(), grads(model), metrics))
    (loss_a, grads_a, metrics_a), (loss_b, grads_b, metrics_b) = results
    torch.testing.assert_close(loss_a, loss_b, **TOL)
    assert "score.weight" in grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)
    for name in metrics_a:
        torch.testing.assert_close(metrics_a[name], metrics_b[name], rtol=1e-5, atol=1e-5, msg=name)


def test_accumulation_over_micro_batches_equals_one_batch():
    """GA=2 over micro-batches of 3 and 1 pairs = one micro-batch of all four: the loss is summed over
    pairs and divided by the window's pairs."""
    data = pairs(4, seed=5)
    base = tiny_reward_model()
    outs, params = [], []
    for ga, rows_per_batch in ((2, 1), (1, 2)):
        obj = objective(center=0.01)
        run = fake_run(obj, copy.deepcopy(base), ga=ga)
        obj.accelerator = run.accelerator
        rows = [packed_batch(data[:3], [[0, 1, 2]]), packed_batch(data[3:], [[0]])]
        window = rows if rows_per_batch == 1 else [packed_batch(data, [[0, 1, 2], [3]])]
        outs.append(train_step(run, window))
        params.append({n: p.detach().clone() for n, p in run.model.named_parameters()})
    ga_out, big_out = outs
    assert ga_out["units"] == big_out["units"] == 4 and ga_out["applied"]
    assert ga_out["loss"] == pytest.approx(big_out["loss"], rel=1e-5)
    for name in params[0]:
        torch.testing.assert_close(params[0][name], params[1][name], rtol=1e-5, atol=1e-6, msg=name)
    for key, value in big_out["metrics"].items():
        assert ga_out["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_evaluate_reports_the_means_over_held_out_pairs():
    obj, model = objective(), tiny_reward_model()
    data = pairs(7, seed=6)
    rows = [
        packed_batch(data[:3], [[0, 1, 2]]),
        packed_batch(data[3:5], [[0, 1]]),
        packed_batch(data[5:], [[0, 1]]),
    ]
    obj.eval_loader = rows
    fields = obj.evaluate(model, step=0)
    with torch.no_grad():
        losses, chosen, rejected = expected(model, data)
    assert fields["eval_pairs"] == 7
    assert fields["eval_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert fields["eval_accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert fields["eval_margin"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-4, abs=1e-6)
    assert fields["eval_rewards/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-4, abs=1e-6)
    assert model.training  # back in training mode
    assert held_out_means(
        model.eval(), rows, center_rewards_coefficient=0.0, pad_token_id=PAD
    ) == pytest.approx(fields)


def test_lora_trains_the_score_head_whole_and_the_adapters(tmp_path):
    """build_lm with head score: PEFT's SEQ_CLS task, the score head in modules_to_save (trained whole),
    drawn from train.seed whatever the global RNG did before."""
    from finetune.model.build import load_tokenizer
    from finetune.objectives.lm import build_lm
    from tests.unit.losses.test_reward_losses import TINY_LLAMA

    recipe = validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama", **TINY_LLAMA},
                "tokenizer_path": str(DEMO_TOKENIZER),
            },
            "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
            "train": {"output_dir": str(tmp_path), "objective": "reward", "seed": 7},
            "lora": {"enable_lora": True, "lora_rank": 4, "lora_target_modules": "all-linear"},
        }
    )
    tokenizer = load_tokenizer(recipe.model)
    heads = []
    for draw in (0, 5):
        torch.manual_seed(draw)  # the global RNG: the random-init base differs, the head does not
        model, _ = build_lm(
            recipe.model, recipe.lora, recipe.train, tokenizer, cpu_accelerator(), head="score"
        )
        heads.append(model.base_model.model.score.modules_to_save["default"].weight.detach().clone())
        with_score = {n for n, p in model.named_parameters() if p.requires_grad and "score" in n}
        assert type(model).__name__ == "PeftModelForSequenceClassification"
        assert with_score == {"base_model.model.score.modules_to_save.default.weight"}
        assert model.config.pad_token_id == tokenizer.pad_token_id
    torch.testing.assert_close(heads[0], heads[1], rtol=0, atol=0)
