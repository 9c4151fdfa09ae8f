"""Every optimizer that runs on CPU checkpoints and resumes exactly: 4 steps straight give the same
weights as 2 steps, a checkpoint (finetune.engine.checkpoints, accelerate's save_state), a fresh model,
optimizer and schedule resumed from it (tensors-only loads), and 2 more steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from finetune.engine.checkpoints import checkpoint, resume
from finetune.engine.loop import optimizer_mode
from finetune.engine.state import LoopState
from finetune.optim import optimizer_for, scheduler_for
from tests.fakes import reset_accelerator_state
from tests.tiny import tiny_model

TOTAL = 4


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"needs {module}")


OPTIMIZERS = [
    pytest.param("adamw", {}),
    pytest.param("muon", {}),
    pytest.param("sgd", {"optim_args": {"momentum": 0.9}}),
    pytest.param("adafactor", {}),
    pytest.param("adagrad", {}),
    pytest.param("rmsprop", {}),
    pytest.param("adamw_8bit", {}, marks=_needs("bitsandbytes")),
    pytest.param("paged_adamw_8bit", {}, marks=_needs("bitsandbytes")),
    pytest.param("lion_8bit", {}, marks=_needs("bitsandbytes")),
    pytest.param("paged_ademamix_32bit", {}, marks=_needs("bitsandbytes")),
    pytest.param("rmsprop_bnb_8bit", {}, marks=_needs("bitsandbytes")),
    pytest.param(
        "galore_adamw",
        {"optim_target_modules": "all-linear", "optim_args": {"rank": 4, "update_proj_gap": 1}},
        marks=_needs("galore_torch"),
    ),
    pytest.param("schedule_free_adamw", {"lr_decay_style": "constant"}, marks=_needs("schedulefree")),
]


def _train_section(name: str, settings: dict, out: Path, load: str | None) -> SimpleNamespace:
    return SimpleNamespace(
        **{
            "optimizer": name,
            "lr": 1e-2,
            "lr_min": 0.0,
            "lr_warmup_ratio": 0.25,
            "lr_decay_style": "cosine",
            "weight_decay": 0.01,
            "no_decay_params": ["bias", "norm"],
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "adam_eps": 1e-8,
            "optim_args": {},
            "optim_target_modules": None,
            "gradient_accumulation_steps": 1,
            "load_checkpoint_path": load,
            "save_total_limit": None,
            "extend_run": False,
            "output_dir": str(out),
            **settings,
        }
    )


def _run(
    name: str, settings: dict, out: Path, *, steps: int, load: str | None = None, save_at: int | None = None
):
    """Train the tiny model `steps` optimizer steps in a fresh Accelerator; its weights after them."""
    reset_accelerator_state()
    acc = Accelerator(cpu=True, mixed_precision="no")
    model = tiny_model(vocab_size=64, hidden_size=32, intermediate_size=64)
    train = _train_section(name, settings, out, load)
    optimizer = optimizer_for(model, train, total_steps=TOTAL)
    scheduler = scheduler_for(optimizer, train, TOTAL)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    run = SimpleNamespace(
        accelerator=acc, model=model, optimizer=optimizer, scheduler=scheduler, output_dir=out, train=train,
        hub=SimpleNamespace(model_id=None), recipe_dict={"train": {"optimizer": name}}, extra_state={},
        state=LoopState(), total_steps=TOTAL, resumed_at=None,
    )  # fmt: skip
    resume(run)
    optimizer_mode(run, "train")
    batches = torch.randint(4, 64, (TOTAL, 2, 12), generator=torch.Generator().manual_seed(3))
    while run.state.step < steps:
        ids = batches[run.state.step]
        acc.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.state.step += 1
        if run.state.step == save_at:
            checkpoint(run)
    optimizer_mode(run, "eval")  # schedule-free: the weights it evaluates and saves
    weights = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}
    reset_accelerator_state()
    return weights


@pytest.mark.parametrize(("name", "settings"), OPTIMIZERS)
def test_two_steps_then_resume_equals_four_straight(tmp_path, name, settings):
    straight = _run(name, settings, tmp_path / "straight", steps=TOTAL)
    _run(name, settings, tmp_path / "cut", steps=2, save_at=2)
    resumed = _run(name, settings, tmp_path / "cut", steps=TOTAL, load="auto")
    start = tiny_model(vocab_size=64, hidden_size=32, intermediate_size=64)
    assert any(not torch.equal(p, straight[n]) for n, p in start.named_parameters())  # it trained
    for param_name, weight in straight.items():
        assert torch.equal(resumed[param_name], weight), param_name
