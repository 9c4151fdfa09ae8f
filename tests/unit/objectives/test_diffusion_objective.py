"""The diffusion objective without a pipeline: what an epoch leaves out (said before training), and
the engine's step for a loss that is a mean per micro-batch (on a linear model)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from finetune.diffusion.loader import BucketBatchSampler
from finetune.engine.step import train_step
from finetune.errors import FinetuneError
from finetune.objectives.diffusion import DiffusionObjective, report_dropped
from tests.fakes import fake_run

BUCKETS = np.array([0] * 5 + [1] * 1)  # 5 square images, 1 wide one


class _Accelerator:
    def __init__(self, processes: int):
        self.num_processes, self.messages = processes, []

    def print(self, *args):
        self.messages.append(" ".join(map(str, args)))


def _report(*, processes: int, batch_size: int, drop_last: bool) -> list[str]:
    accelerator = _Accelerator(processes)
    sampler = BucketBatchSampler(BUCKETS, batch_size, seed=0, drop_last=drop_last, num_replicas=processes)
    buckets = {"32x32": 5, "44x24": 1}
    report_dropped(accelerator, sampler, buckets, micro_batch_size=batch_size, drop_last=drop_last)
    return accelerator.messages


def test_nothing_is_said_when_every_image_is_trained() -> None:
    assert _report(processes=1, batch_size=2, drop_last=False) == []


def test_drop_last_tails_are_reported() -> None:
    (message,) = _report(processes=2, batch_size=2, drop_last=True)
    # 4 of the 5 square images fill one global batch; the last one and the wide image are left out.
    assert message.startswith("data.dataloader_drop_last: 2 images per epoch") and "(2 x 2)" in message


def test_a_bucket_smaller_than_the_processes_is_a_warning() -> None:
    (message,) = _report(processes=2, batch_size=2, drop_last=False)
    assert message.startswith(
        "warning: 1 images per epoch are in buckets with fewer images than processes (2)"
    )


def test_no_batch_at_all_is_refused() -> None:
    with pytest.raises(FinetuneError, match=r"no training batches.*\(4 x 2\)"):
        _report(processes=2, batch_size=4, drop_last=True)


# ------------------------------------------------------------------------------------- train_step


class _SquaredError(DiffusionObjective):
    """The diffusion objective's normalisation (one unit per micro-batch, a mean loss) on a linear model."""

    def __init__(self):
        pass

    def loss(self, model, batch, num_units):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean() / num_units, {}

    def after_update(self, model) -> None:
        pass


def test_an_update_is_the_mean_over_its_window_also_when_the_window_is_short() -> None:
    """A full window of 2 micro-batches, the short last window of an epoch (2 of 4 micro-batches)
    and one batch of both give the same update: accelerate's division by the accumulation steps
    is undone per window length."""
    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(3, 2)
    window = [{"x": torch.randn(2, 3, generator=g), "y": torch.randn(2, 2, generator=g)} for _ in range(2)]
    whole = {key: torch.cat([b[key] for b in window]) for key in ("x", "y")}
    weights = []
    for ga, batches in ((2, window), (4, window), (1, [whole])):
        run = fake_run(_SquaredError(), copy.deepcopy(base), ga=ga)
        result = train_step(run, batches)
        assert result["applied"]
        weights.append((result["loss"], run.accelerator.unwrap_model(run.model).weight.detach().clone()))
    (full_loss, full), (short_loss, short), (one_loss, one) = weights
    assert full_loss == pytest.approx(one_loss) and short_loss == pytest.approx(one_loss)
    assert not torch.equal(full, base.weight)
    torch.testing.assert_close(full, one)
    torch.testing.assert_close(short, one)
