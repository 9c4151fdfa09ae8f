"""The training engine: the loop every objective shares.

The engine owns everything that does not depend on what is trained: seeding, the optimizer and the
LR schedule over the real number of optimizer steps, `accelerator.prepare`, the accumulation window
(token/pair-normalised loss, per-micro-batch gradient sync, clipping, the optimizer step), nonfinite
and fp16-overflow accounting, stop signals and the time limit, checkpoint cadence and exact resume,
evaluation cadence, progress.jsonl and the trackers, the profiler, and the final save and Hub push.
It knows nothing of LLMs, diffusion or preference pairs.

An objective (finetune/objectives/) is what varies: it builds the model and data for the run and
says what one micro-batch costs. The engine calls it through this narrow interface
(finetune/engine/objective.py):

* `build(accelerator) -> Parts`: model (unprepared), train loader, manifest, and optionally per-part
  learning rates (`lr_by_prefix`: parameter-name prefix -> lr, e.g. diffusion's text encoders). The
  objective prepares its data here (one process per machine) and registers any extra checkpointed state.
* `on_prepared(accelerator, model) -> extra state`: after `accelerator.prepare` (e.g. an EMA of the
  prepared weights, returned so that checkpoints hold it; stored without pickle).
* `units(batch)`: how many normalisation units a micro-batch holds (trainable tokens for causal-LM
  SFT, pairs for preference objectives, 1 per micro-batch for diffusion, whose loss is a mean).
* `loss(model, batch, num_units) -> (loss, metric sums)`: the micro-batch's loss summed over its
  units and divided by the units of the whole window on all processes, so that summing the window's
  losses gives the window's mean; metric sums (e.g. rewards) are averaged the same way for the log,
  or over their own count where the objective returns one as `count:<name>` (finetune.engine.step).
* `after_update(model)`: after every applied update (diffusion's EMA).
* `counts(batch)` and `log_fields(interval, elapsed, totals)`: throughput (tokens/s and MFU, images/s).
* `evaluate(model, step) -> fields` every `eval_every` steps and at the end (`can_evaluate`), and
  before the first step with train.eval_on_start.
* `save(model, metrics) -> extra files`: the final artifacts and model card (every process calls it).

Online objectives (RL) add a rollout step, and the engine stays objective-free:

* `batches_per_window` (attribute, optional): how many loader items make one optimizer step
  (default: train.gradient_accumulation_steps micro-batches). An online objective's loader yields
  one item per step: this process's prompts for it.
* `rollout(model, items, step) -> (micro-batches, stats)` (optional): turns a window's items into
  the micro-batches the usual accumulation window trains on (generate, score, advantages). `stats`
  are numbers summed into the logging interval beside `rollout_seconds`, the rollout's wall time,
  which `log_fields` reports apart from the training time.

Reading order: loop.py (train -> setup -> train_loop -> save_final), step.py (one window),
checkpoints.py (cadence, resume), outputs.py (progress records, trackers, profiler, Hub push),
accelerator.py (the Accelerator of a run), state.py (counters).
"""

from finetune.engine.accelerator import make_accelerator
from finetune.engine.loop import train
from finetune.engine.objective import Objective, Parts

__all__ = ["Objective", "Parts", "make_accelerator", "train"]
