"""The loop's counters (what resume needs besides accelerate's state) and the run the loop works on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LoopState:
    """Saved in every checkpoint's train_state.json; accelerate's state holds weights, optimizer,
    schedule and RNG.

    `step` counts optimizer steps (what the schedule, logging and checkpoints use);
    `micro_step_in_epoch` counts micro-batches consumed in the current epoch (what resume skips).
    `num_units` counts the normalisation units of the applied steps (trainable tokens, pairs, ...),
    `totals` the objective's running throughput totals (tokens, images ...). `extensions` records
    each time the run was made longer (train.extend_run): the step and the old and new totals.
    """

    step: int = 0
    epoch: int = 0
    micro_step_in_epoch: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_steps: int = 0
    fp16_skipped_steps: int = 0
    skipped_iterations: int = 0
    train_seconds: float = 0.0
    num_units: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)
    extensions: list[dict[str, int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        """From train_state.json, ignoring counters this version does not keep."""
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)


@dataclass
class Run:
    """Everything the loop needs, plain values only: the objective, Accelerate's objects, the train
    and hub sections, the resolved recipe (for checkpoints and trackers), and the state."""

    objective: Any
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    train: Any  # TrainSection
    hub: Any  # HubSection
    recipe_dict: dict
    manifest: dict
    output_dir: Path
    total_steps: int
    steps_per_epoch: int
    state: LoopState = field(default_factory=LoopState)
    stop_reason: str | None = None
    last_eval: tuple[int, dict] | None = None  # (step, fields) of the latest evaluation
    extra_state: dict = field(default_factory=dict)  # name -> object with state_dict, checkpointed
    resumed_at: int | None = None  # the checkpoint's step when this run resumed
    extension: dict | None = None  # the progress record of this run's extension (train.extend_run)
    # This process, this run (not resumed): the per-process summary of a multi-process run.
    steps_here: int = 0
    micro_batches_here: int = 0
    counts_here: dict[str, float] = field(default_factory=dict)
