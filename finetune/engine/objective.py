"""The interface between the engine and an objective (see the package docstring for the prose)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


@dataclass
class Parts:
    """What an objective builds for the engine.

    `model` is not yet prepared (the engine builds the optimizer and schedule from it, then runs
    `accelerator.prepare`); `train_loader` yields this process's micro-batches, its batch sampler has
    `set_epoch(epoch)` and gives every process the same number of batches (it is not passed through
    `accelerator.prepare`; the engine moves batches to the device). A loader with `resumes_itself`
    (a data stream) restores its own position on resume from the extra state the objective
    registered (`on_prepared`), instead of the engine skipping the batches already trained on.
    """

    model: torch.nn.Module
    train_loader: Any
    manifest: dict = field(default_factory=dict)
    loraplus_lr_ratio: float | None = (
        None  # LoRA+: LoRA's B matrices train at lr x this (lora.loraplus_lr_ratio)
    )
    # Parameters whose name starts with a prefix train at its learning rate (and follow the schedule in
    # proportion), e.g. diffusion's text encoders: {"text_encoders.": diffusion.text_encoder_lr}.
    lr_by_prefix: dict[str, float] | None = None


class Objective(Protocol):
    """What the engine calls: build, per micro-batch loss and counts, evaluate, save.

    Attributes the engine reads: `name` (for messages), `eval_every` (optimizer steps between
    evaluations, None = none during training), `can_evaluate` (whether there is anything to
    evaluate; the engine evaluates once more at the end when the last step was not evaluated) and
    `summary_keys` (count names shown in the per-process summary of a multi-process run). Optional:
    `on_stop_signal(name)`, called in the signal handler when SIGTERM or SIGINT arrives (it must only
    set flags): online RL stops waiting on its reward and tool workers.
    """

    name: str
    eval_every: int | None
    can_evaluate: bool
    summary_keys: tuple[str, ...]

    def build(self, accelerator) -> Parts:
        """Tokenizer/data/model for this run (data prepared on one process per machine)."""

    def on_prepared(self, accelerator, model) -> dict[str, Any] | None:
        """Called once the engine has prepared model, optimizer and schedule (before a resume);
        returns objects (with state_dict / load_state_dict) to checkpoint besides accelerate's state."""

    def units(self, batch: dict) -> torch.Tensor:
        """How many normalisation units this micro-batch holds (trainable tokens, pairs, ...)."""

    def loss(
        self, model, batch: dict, num_units: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss of the micro-batch summed over its units and divided by `num_units`, the units of the
        whole accumulation window on all processes; metric sums over its units, detached)."""

    def after_update(self, model) -> None:
        """Called after every applied optimizer update (e.g. an EMA of the trained weights)."""

    def counts(self, batch: dict) -> dict[str, float]:
        """Throughput counts of a micro-batch on this process (tokens, images ...); no sync."""

    def log_fields(self, interval: dict[str, float], elapsed: float, totals: dict[str, float]) -> dict:
        """Progress fields for a logging interval: `interval` sums `counts` and holds `units` (the
        units of the applied steps, all processes); `totals` persists across resumes (update it)."""

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """Evaluate the model at `step`; the returned fields are written to progress.jsonl."""

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """Write the final artifacts into the output folder (called on every process); returns extra
        files under it to push besides its top-level files."""
