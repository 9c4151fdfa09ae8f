"""The loop every objective shares: setup -> epochs of accumulation windows -> final evaluation -> save."""

from __future__ import annotations

import gc
import signal
import time
from itertools import islice
from pathlib import Path

import torch

from finetune import trackers
from finetune.checkpoint import file_stamps, record_written
from finetune.engine.checkpoints import (
    check_finite_weights,
    checkpoint,
    checkpoint_if_stopped,
    resume,
    schedule_length,
    should_save,
)
from finetune.engine.lifecycle import (
    FINISHED,
    agree,
    check_output_dir,
    finished_message,
    hold_output_dir,
    mark_finished,
    startup_pause,
)
from finetune.engine.outputs import flat, log_step, push_final, start_profiler, stop_profiler
from finetune.engine.state import Run
from finetune.engine.step import count_outcome, train_step
from finetune.errors import write_error, write_failure_reason
from finetune.metrics import ProgressLog
from finetune.parallel.sequence import shard_sequences
from finetune.parallel.sizes import size_of
from finetune.parallel.tensor import prepare_tensor_parallel
from finetune.recipe.yaml_io import dump_yaml


def train(objective, accelerator, *, train, hub, recipe_dict: dict, memory_plan: dict | None = None) -> int:
    """Train `objective` with `accelerator` under the recipe's train and hub sections; 0 when done or
    stopped cleanly (with a checkpoint), or when resuming a run that is already finished. `recipe_dict`
    is the resolved recipe, written next to the outputs, into every checkpoint and to the trackers;
    `memory_plan`, the planner's prediction for the run, goes into progress.jsonl's "started" record.
    The run holds output_dir's lock throughout (finetune.engine.lifecycle)."""
    output_dir = Path(train.output_dir)
    with hold_output_dir(accelerator, output_dir):
        finished = None
        if accelerator.is_main_process:
            finished = finished_message(output_dir, train.load_checkpoint_path, recipe_dict)
        if agree(accelerator, finished) is not None:
            accelerator.print(finished)
            return 0
        return run_to_the_end(
            objective, accelerator, train=train, hub=hub, recipe_dict=recipe_dict, memory_plan=memory_plan
        )


def run_to_the_end(objective, accelerator, *, train, hub, recipe_dict: dict, memory_plan=None) -> int:
    """setup -> loop -> final evaluation -> save (and push) -> the finished record."""
    run = setup(objective, accelerator, train=train, hub=hub, recipe_dict=recipe_dict)
    if accelerator.is_main_process:
        start_progress_log(
            run.output_dir / "progress.jsonl", resumed_at=run.resumed_at, say=accelerator.print
        )
    log = ProgressLog(
        run.output_dir / "progress.jsonl",
        enabled=accelerator.is_main_process,
        log_format=train.log_format,
        total_steps=run.total_steps,
        initial_step=run.state.step,
    )
    try:
        log.log(started_record(run, memory_plan))
        if run.extension is not None:
            log.log(run.extension)
        train_loop(run, log)
        if run.stop_reason is not None:
            return 0
        final = {"step": run.state.step}
        if objective.can_evaluate:
            if run.last_eval is None or run.last_eval[0] != run.state.step:
                evaluate(run, log)  # else eval_every just evaluated this very state
            final.update(run.last_eval[1])
    finally:
        log.close()
    if train.save_hf_weights:
        save_final(run, final)
    if accelerator.num_processes > 1:  # every process: equal counts, or ranks drifted apart in the data
        counts = ", ".join(f"{int(run.counts_here.get(k, 0))} {k}" for k in objective.summary_keys)
        print(
            f"process {accelerator.process_index}: {run.steps_here} steps, {run.micro_batches_here} "
            f"micro-batches, {counts}",
            flush=True,
        )
    if accelerator.is_main_process:
        mark_finished(run.output_dir, run.state.step)
    accelerator.print(f"done: {run.state.step} steps, outputs in {run.output_dir}")
    return 0


def setup(objective, accelerator, *, train, hub, recipe_dict: dict) -> Run:
    """Seed, the objective's parts, optimizer and schedule over the real number of steps, prepare,
    resume."""
    from accelerate.utils import set_seed

    from finetune.accelerate_config import setup_from_env
    from finetune.optim import optimizer_for, scheduler_for

    output_dir = Path(train.output_dir)
    set_seed(train.seed, deterministic=train.enable_full_determinism)
    if accelerator.is_main_process:
        check_output_dir(output_dir)
    startup_pause(output_dir)
    parts = objective.build(accelerator)
    engine = setup_from_env()
    # Sequence parallel: DeepSpeed's Ulysses registered for the model, each item a shard of a row.
    train_loader = shard_sequences(parts.model, parts.train_loader, train, accelerator)
    # The schedule length comes from the real number of optimizer steps in the (packed) data.
    steps_per_epoch, total_steps = schedule_length(
        len(train_loader),
        gradient_accumulation_steps=batches_per_window(objective, train),
        num_train_epochs=train.num_train_epochs,
        max_steps=train.max_steps,
    )
    optimizer = optimizer_for(
        parts.model,
        train,
        cpu_offload=engine.kind == "deepspeed" and engine.offload_optimizer != "none",
        device=accelerator.device,
        total_steps=total_steps,
        loraplus_lr_ratio=parts.loraplus_lr_ratio,
        lr_by_prefix=parts.lr_by_prefix,
    )
    scheduler = scheduler_for(optimizer, train, total_steps)
    extra_state = {}
    if engine.kind == "deepspeed":
        # Given the scheduler, the DeepSpeed engine would step it inside backward (and not on skipped
        # steps); the loop steps it itself, once per optimizer step, as for every other engine. It
        # changes the LR in the param groups DeepSpeed's optimizer shares with ours. Its state is
        # checkpointed beside accelerate's (finetune.engine.extra_state).
        model, optimizer = accelerator.prepare(parts.model, optimizer)
        extra_state["scheduler"] = scheduler
    elif size_of(train, "tensor") > 1:  # no DDP around a TP model; its checkpoints are sharded (DCP)
        model, optimizer, scheduler = prepare_tensor_parallel(accelerator, parts.model, optimizer, scheduler)
    else:
        model, optimizer, scheduler = accelerator.prepare(parts.model, optimizer, scheduler)
    extra_state.update(objective.on_prepared(accelerator, model) or {})
    run = Run(
        objective=objective,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_loader=train_loader,
        train=train,
        hub=hub,
        recipe_dict=recipe_dict,
        manifest=parts.manifest,
        output_dir=output_dir,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        extra_state=extra_state,
    )
    resume(run)
    if accelerator.is_main_process:  # after resume's checks: a refused resume leaves the old one in place
        (output_dir / "recipe.resolved.yaml").write_text(dump_yaml(recipe_dict))
    return run


def started_record(run: Run, memory_plan: dict | None) -> dict:
    """progress.jsonl's record of a (re)start: what `finetune report` needs besides the steps, the
    prepared data's fingerprint (its manifest is dataset_prepared_path/<fingerprint>/manifest.json)
    and the planner's prediction, to set beside the measured peak_mem_gib."""
    record = {
        "step": run.state.step,
        "event": "started",
        "data_fingerprint": (run.manifest or {}).get("fingerprint"),
        "num_processes": run.accelerator.num_processes,
        "total_steps": run.total_steps,
        "device": run.accelerator.device.type,
    }
    if memory_plan is not None:
        record["memory_plan"] = memory_plan
    return record


def start_progress_log(path: Path, *, resumed_at: int | None, say) -> None:
    """progress.jsonl for this run: a resumed run keeps the records up to its checkpoint's step (the
    steps after it are replayed) and marks the resume; a fresh run into a folder that holds another
    run's log starts a new one, keeping the old as progress.N.jsonl."""
    import json

    if not path.is_file() or path.stat().st_size == 0:
        return
    if resumed_at is None:
        n = 1
        while path.with_name(f"progress.{n}.jsonl").exists():
            n += 1
        path.rename(path.with_name(f"progress.{n}.jsonl"))
        say(
            f"{path.parent} held another run's progress.jsonl: kept as progress.{n}.jsonl; this run starts a new one"
        )
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # a line cut short by a crash
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > resumed_at:
            dropped += 1
        elif isinstance(record, dict) and record.get("event") == FINISHED:
            pass  # an extended run (train.extend_run) goes on: it is finished again at its new end
        else:
            kept.append(line)
    kept.append(json.dumps({"step": resumed_at, "event": "resumed"}))
    path.write_text("\n".join(kept) + "\n", encoding="utf-8")
    if dropped:
        say(
            f"progress.jsonl: {dropped} record(s) after step {resumed_at} removed; they are replayed from the checkpoint"
        )


# ------------------------------------------------------------------------------------------ loop


class StopFlag:
    """Set by SIGTERM/SIGINT: the loop finishes the current step, checkpoints and exits 0. `on_signal`
    (the objective's optional `on_stop_signal`) is told at once, in the signal handler: an objective
    waiting on something slow (a reward or tool call in its worker) stops waiting, so one signal ends
    the step soon."""

    def __init__(self, on_signal=None):
        self.signal_name: str | None = None
        self.on_signal = on_signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if self.on_signal is not None:
            self.on_signal(self.signal_name)


def batches_per_window(objective, train) -> int:
    """Loader items that make one optimizer step: the accumulation steps' micro-batches, or what an
    online objective says (one window of prompts, which its rollout turns into the micro-batches)."""
    return getattr(objective, "batches_per_window", None) or train.gradient_accumulation_steps


def rollout(run: Run, window: list, interval: dict) -> list[dict]:
    """An online objective's micro-batches for this step, made from the window's items (generate,
    score, advantages); its time and statistics go into the logging interval (rollout_seconds apart
    from the training time): summed, or kept at their largest for `max:` keys. Objectives without a
    rollout train on the loader's micro-batches."""
    make = getattr(run.objective, "rollout", None)
    if make is None:
        return window
    started = time.perf_counter()
    batches, stats = make(run.model, window, step=run.state.step + 1)
    for key, value in {**stats, "rollout_seconds": time.perf_counter() - started}.items():
        interval[key] = (
            max(interval.get(key, value), value) if key.startswith("max:") else interval.get(key, 0) + value
        )
    return batches


def train_loop(run: Run, log: ProgressLog) -> None:
    """Epochs of accumulation windows until total_steps; logs, evaluates, checkpoints, stops cleanly."""
    acc, train, st, objective = run.accelerator, run.train, run.state, run.objective
    per_window = batches_per_window(objective, train)
    stop = StopFlag(getattr(objective, "on_stop_signal", None))
    started = time.monotonic()
    profiler = None
    interval: dict = {"t0": time.perf_counter()}
    skip = set(train.iterations_to_skip)
    trackers.start(
        acc,
        train.report_to,
        run_name=run.output_dir.name,
        config=flat(run.recipe_dict),
        output_dir=run.output_dir,
    )
    if train.eval_on_start and objective.can_evaluate and st.step == 0:
        evaluate(run, log)  # the baseline: the model before any update
        interval["t0"] = time.perf_counter()  # its time is not the first steps'
    run.model.train()
    optimizer_mode(run, "train")
    while st.step < run.total_steps and run.stop_reason is None:
        loader = run.train_loader
        if getattr(loader, "resumes_itself", False):
            pass  # a data stream: its position is in the checkpoint's extra state, nothing to skip
        else:
            # The order of an epoch depends only on (seed, epoch): resume needs no sampler state.
            run.train_loader.batch_sampler.set_epoch(st.epoch)
            if st.micro_step_in_epoch:  # a loader that skips by itself (sequence shards) says how
                skipping = getattr(loader, "skip_first_batches", None)
                loader = (
                    skipping(st.micro_step_in_epoch)
                    if skipping
                    else acc.skip_first_batches(loader, st.micro_step_in_epoch)
                )
        batches = iter(loader)
        epoch_done = False
        while st.step < run.total_steps:
            window = list(islice(batches, per_window))
            if not window:
                epoch_done = True
                break
            st.micro_step_in_epoch += len(window)
            if train.enable_profiling and st.step + 1 == train.profile_start_step:
                profiler = start_profiler(acc)
            skipped = st.step + 1 in skip
            if not skipped:
                window = rollout(run, window, interval)
            run.micro_batches_here += len(window)
            for batch in window:
                for key, value in objective.counts(batch).items():
                    interval[key] = interval.get(key, 0) + value
                    run.counts_here[key] = run.counts_here.get(key, 0) + value
            if skipped:  # train.iterations_to_skip: consumed without rollout, forward or update
                st.skipped_iterations += 1
                result = {"applied": False, "skipped": True}
            else:
                result = train_step(run, window)
            result["lr"] = run.scheduler.get_last_lr()[0]  # the LR this step used (before the schedule moves)
            st.step += 1
            run.steps_here += 1
            run.scheduler.step()
            if result.get("skipped"):
                log.log({"step": st.step, "event": "skipped_iteration"})
            elif count_outcome(run, result, log):
                interval["units"] = interval.get("units", 0) + result["units"]
            if profiler is not None and st.step >= train.profile_end_step:
                stop_profiler(profiler, run)
                profiler = None
            if st.step % train.log_steps == 0 or st.step == run.total_steps:
                log_step(run, result, interval, log)
            paused = time.perf_counter()
            if objective.eval_every and st.step % objective.eval_every == 0:
                evaluate(run, log)  # before the checkpoint: a resumed run continues from the same RNG state
            going_on = end_of_step(run, stop, started)
            # Evaluation and checkpoint time is not training time: the next interval's tokens/s leave it out.
            interval["paused"] = interval.get("paused", 0.0) + time.perf_counter() - paused
            if not going_on:
                break
        if epoch_done:
            st.epoch += 1
            st.micro_step_in_epoch = 0
    if profiler is not None:
        stop_profiler(profiler, run)
    checkpoint_if_stopped(run, log)


def optimizer_mode(run: Run, mode: str) -> None:
    """Switch the optimizer to "train" or "eval" mode (accelerate's AcceleratedOptimizer.train/eval,
    which do nothing for optimizers without modes). A schedule-free optimizer trains on one weight
    sequence and evaluates and saves another: its eval() swaps the model's weights to the latter."""
    getattr(run.optimizer, mode, lambda: None)()


def evaluate(run: Run, log: ProgressLog) -> None:
    """The objective's evaluation at the current step (optimizer in eval mode), written to progress.jsonl."""
    optimizer_mode(run, "eval")
    try:
        fields = run.objective.evaluate(run.model, run.state.step)
    finally:
        optimizer_mode(run, "train")
    run.last_eval = (run.state.step, fields)
    log.log({"step": run.state.step, "event": "eval", **fields})


def end_of_step(run: Run, stop: StopFlag, started: float) -> bool:
    """After an optimizer step: agree on stopping (False: stop now), else checkpoint when due and
    release memory every empty_cache_steps / gc_steps."""
    train, step = run.train, run.state.step
    run.stop_reason = stop_reason(run, stop, started)
    if run.stop_reason is not None:
        return False
    if should_save(run):
        checkpoint(run)
    if train.empty_cache_steps and step % train.empty_cache_steps == 0 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if train.gc_steps and step % train.gc_steps == 0:
        gc.collect()
    return True


def stop_reason(run: Run, stop: StopFlag, started: float) -> str | None:
    """Agree across processes on whether to stop (a signal or the time limit)."""
    acc, limit = run.accelerator, run.train.exit_duration_in_mins
    flags = torch.tensor(
        [stop.signal_name is not None, limit is not None and (time.monotonic() - started) / 60 >= limit],
        dtype=torch.float32,
    )
    if acc.num_processes > 1:
        # Sync point: every rank must stop at the same step or the collectives would hang.
        flags = acc.reduce(flags.to(acc.device), reduction="sum").cpu()
    if flags[0] > 0:
        return f"received {stop.signal_name or 'a stop signal on another process'}"
    if flags[1] > 0:
        return f"train.exit_duration_in_mins ({limit}) reached"
    return None


# ------------------------------------------------------------------------------------------ save


def save_final(run: Run, metrics: dict) -> None:
    """The objective's final artifacts (every process takes part), then the Hub push."""
    acc = run.accelerator
    optimizer_mode(run, "eval")  # a schedule-free optimizer's evaluation weights are the ones to keep
    acc.wait_for_everyone()
    check_finite_weights(run, "the final model")
    before = file_stamps(run.output_dir)
    try:
        extra_files = run.objective.save(
            run.model,
            {**metrics, **run.state.totals, "units": run.state.num_units, "extensions": run.state.extensions},
        )
    except BaseException as exc:
        if write_failure_reason(exc) is None:
            raise
        raise write_error(
            exc,
            f"saving the final model in {run.output_dir}",
            run.output_dir,
            f"The files it wrote there are incomplete; the checkpoints in {run.output_dir / 'checkpoints'} "
            "are intact. Free space, or choose another train.output_dir (move checkpoints/ there), then "
            "resume with --train.load_checkpoint_path auto",
        ) from None
    if acc.is_main_process:
        record_written(run.output_dir, before)  # verified when finetune loads the model
    if acc.is_main_process and run.hub.model_id:
        push_final(run, extra_files=extra_files)
    acc.wait_for_everyone()
