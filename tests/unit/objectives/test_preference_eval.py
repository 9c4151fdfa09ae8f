"""finetune.objectives.preference_eval.summarize on hand-worked log-prob sums."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from finetune.objectives.preference_eval import summarize

SETTINGS = SimpleNamespace(beta=0.5, label_smoothing=0.0, dpo_smoothing="conservative")


def _scores(sums: list[float], units: list[int]) -> dict:
    return {
        "sums": torch.tensor(sums),
        "counts": torch.ones(len(sums), dtype=torch.long),
        "nll": None,
        "num_units": torch.tensor(units),
        "desirable": None,
    }


def test_dpo_metrics_against_the_reference_and_the_reference_free_preference():
    # Two batches; pairs are (chosen, rejected) in turn. Policy vs reference differences:
    # pair 1: chosen +1, rejected -1 -> margin 0.5 * 2 = 1.0; pair 2: chosen 0, rejected +2 -> -1.0;
    # pair 3: chosen +2, rejected 0 -> 1.0.
    reference = [_scores([-10, -12, -8, -9], [2]), _scores([-5, -4], [1])]
    policy = [_scores([-9, -13, -8, -7], [2]), _scores([-3, -4], [1])]
    metrics = summarize(policy, reference, name="dpo", settings=SETTINGS)
    margins = [1.0, -1.0, 1.0]
    assert metrics["eval_pairs"] == 3
    assert metrics["eval_rewards/margins"] == pytest.approx(sum(margins) / 3)
    assert metrics["eval_rewards/accuracies"] == pytest.approx(2 / 3)
    expected_loss = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / 3
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["eval_rewards/chosen"] == pytest.approx(0.5 * (1 + 0 + 2) / 3)
    # Reference-free: chosen above rejected in pairs 1 (-9 > -13) and 3 (-3 > -4), not 2 (-8 < -7).
    assert metrics["eval_preferred"] == pytest.approx(2 / 3)
    assert metrics["eval_logps/chosen"] == pytest.approx((-9 - 8 - 3) / 3)


def test_the_base_as_its_own_reference_has_zero_rewards():
    base = [_scores([-10, -12, -8, -9], [2])]
    metrics = summarize(base, base, name="dpo", settings=SETTINGS)
    assert metrics["eval_rewards/margins"] == 0.0 and metrics["eval_rewards/accuracies"] == 0.0
    assert metrics["eval_loss"] == pytest.approx(math.log(2))
    assert metrics["eval_preferred"] == 1.0  # both pairs: chosen has the higher log-prob


def test_objectives_with_a_reference_need_its_scores():
    with pytest.raises(ValueError, match="reference"):
        summarize([_scores([-1, -2], [1])], None, name="dpo", settings=SETTINGS)
