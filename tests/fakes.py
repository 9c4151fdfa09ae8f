"""Stand-ins for the engine's objects in tests: a fresh CPU Accelerator and a fake `run`.

Accelerate keeps process-wide singletons (AcceleratorState, GradientState): an Accelerator built after
another one in the same process gets the first one's settings unless they are reset. The
`fresh_accelerator_state` fixture (tests/conftest.py) resets them around a test; `cpu_accelerator`
resets them before building one, for tests that build several.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def reset_accelerator_state() -> None:
    """Forget Accelerate's process-wide state, so the next Accelerator is built from its own arguments."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def cpu_accelerator(ga: int = 1):
    """A fresh fp32 CPU Accelerator accumulating over `ga` micro-batches."""
    from accelerate import Accelerator

    reset_accelerator_state()
    return Accelerator(gradient_accumulation_steps=ga, mixed_precision="no", cpu=True)


def fake_run(objective, model=None, *, ga: int = 1, max_grad_norm=None, **fields) -> SimpleNamespace:
    """The engine's `run` (finetune.engine.state.Run) with only what the step and logging functions read.

    With a model: a fresh CPU Accelerator (`cpu_accelerator(ga)`) prepares it with plain SGD (lr 0.5)
    over its trainable parameters, as train_step needs. Without: a stand-in accelerator (CPU, no
    scaler, one process, no trackers) for the functions that only log. `fields` add or replace attributes.
    """
    from finetune.engine.state import LoopState

    train = SimpleNamespace(
        gradient_accumulation_steps=ga,
        max_grad_norm=max_grad_norm,
        log_steps=1,
        mixed_precision="no",
        report_to=[],
    )
    run = SimpleNamespace(objective=objective, train=train, state=LoopState())
    if model is None:
        run.accelerator = SimpleNamespace(
            device=torch.device("cpu"), scaler=None, num_processes=1, print=print, trackers=[]
        )
    else:
        run.accelerator = cpu_accelerator(ga)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        run.model, run.optimizer = run.accelerator.prepare(model, optimizer)
    vars(run).update(fields)
    return run
