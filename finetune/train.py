"""Train an LLM from a recipe: `accelerate launch finetune/train.py recipe.yaml [--section.field value ...]`.

Reads top to bottom: main -> setup -> train loop -> save. The same script runs on one CPU, one GPU,
DDP, FSDP2 and DeepSpeed; the accelerate config decides.

Counters: `step` counts optimizer steps (what the schedule, logging and checkpoints use);
`micro_step_in_epoch` counts micro-batches consumed in the current epoch (what resume skips).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a script, Python puts finetune/ first on sys.path; its modules (data, model, config...)
    # must not shadow top-level packages. The installed `finetune` package is imported instead.
    sys.path.pop(0)

import contextlib
import dataclasses
import gc
import math
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

import torch
from accelerate.utils import DistributedType, send_to_device

from finetune.checkpoint import find_checkpoint, load_train_state, save_checkpoint
from finetune.data.collate import collate_rows
from finetune.errors import FinetuneError
from finetune.metrics import (
    ProgressLog,
    device_peak_flops,
    host_peak_rss_gib,
    model_flops_per_token,
    peak_memory_gib,
)
from finetune.recipe import Recipe, load_recipe, recipe_to_dict
from finetune.recipe.yaml_io import dump_yaml


@dataclass
class LoopState:
    """What, besides accelerate's state (weights, optimizer, scheduler, RNG), resume needs; the
    counters every loop keeps (the LLM and diffusion loops add their own)."""

    step: int = 0
    epoch: int = 0
    micro_step_in_epoch: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_steps: int = 0
    fp16_skipped_steps: int = 0
    train_seconds: float = 0.0


@dataclass
class TrainState(LoopState):
    num_tokens: int = 0
    num_trainable_tokens: int = 0
    skipped_iterations: int = 0


@dataclass
class Run:
    recipe: Recipe
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_dl: Any
    eval_dl: Any
    tokenizer: Any
    manifest: dict
    total_steps: int
    steps_per_epoch: int
    output_dir: Path
    state: TrainState = field(default_factory=TrainState)
    flops_info: dict = field(default_factory=dict)
    stop_reason: str | None = None
    last_eval: tuple[int, dict] | None = None  # (step, metrics) of the latest evaluation


# ----------------------------------------------------------------------------------------- setup


class EpochSampler(torch.utils.data.Sampler):
    """Shuffles with a generator seeded by (seed, epoch): the order of any epoch is reproducible
    without saving sampler state, which makes mid-epoch resume exact."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        self.num_rows, self.seed, self.shuffle, self.epoch = num_rows, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.num_rows, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_rows


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin, is_tensorboard_available, is_wandb_available

    train = recipe.train
    if train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise FinetuneError(
            "train.mixed_precision: fp16 with dynamic loss scaling needs a GPU; on CPU use bf16 or no"
        )
    available = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}
    for tracker in train.report_to:
        if not available[tracker]():
            raise FinetuneError(
                f"train.report_to: {tracker} is not installed (pip install -e '.[tracking]' or pip install {tracker})"
            )
    from finetune.accelerate_config import engine_from_env
    from finetune.distributed import accelerator_kwargs, check_combination

    engine = engine_from_env()
    # The same refusals as `finetune train` makes before launch, for `accelerate launch` users.
    check_combination(
        engine,
        train,
        model_kind=recipe.model.kind,
        qlora=recipe.lora.enable_qlora,
        cuda_available=torch.cuda.is_available(),
    )
    kwargs: dict[str, Any] = accelerator_kwargs(train, engine)
    if recipe.model.enable_compile:
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    return Accelerator(
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        log_with=list(train.report_to) or None,
        project_dir=train.output_dir,
        # We step the scheduler once per optimizer step ourselves (Accelerate would otherwise step
        # it num_processes times per call).
        step_scheduler_with_optimizer=False,
        **kwargs,
    )


def make_dataloader(
    dataset,
    recipe: Recipe,
    *,
    pad_id: int,
    packed: bool,
    shuffle: bool,
    drop_last: bool,
    num_replicas: int | None = None,
    rank: int = 0,
):
    """A DataLoader over the prepared rows.

    With `num_replicas` (training), batches come from a RankBatchSampler: this rank's share, the
    same number of batches on every rank, no row repeated; such a loader is not passed through
    `accelerator.prepare`. Without it (evaluation), a plain sampler that Accelerate shards, so
    `gather_for_metrics` can drop the rows it repeats to even out the ranks.
    """
    from finetune.data.sampler import RankBatchSampler

    data = recipe.data
    columns = [c for c in ("input_ids", "labels", "position_ids") if c in dataset.column_names]
    dataset = dataset.select_columns(columns)
    workers = data.dataloader_num_workers
    if num_replicas is not None:
        batching: dict[str, Any] = {
            "batch_sampler": RankBatchSampler(
                len(dataset),
                micro_batch_size=recipe.train.micro_batch_size,
                num_replicas=num_replicas,
                rank=rank,
                seed=recipe.train.seed,
                shuffle=shuffle,
                drop_last=drop_last,
            )
        }
    else:
        batching = {
            "batch_size": recipe.train.micro_batch_size,
            "sampler": EpochSampler(len(dataset), recipe.train.seed, shuffle=shuffle),
            "drop_last": drop_last,
        }
    return torch.utils.data.DataLoader(
        dataset,
        **batching,
        collate_fn=partial(
            collate_rows, pad_token_id=pad_id, pad_to_multiple_of=data.pad_to_multiple_of, packed=packed
        ),
        num_workers=workers,
        prefetch_factor=data.dataloader_prefetch_factor if workers > 0 else None,
        pin_memory=data.dataloader_pin_memory and torch.cuda.is_available(),
        # Its own generator: creating an iterator draws the workers' base seed from it, not from the
        # global RNG, so a resumed run (which creates its iterator right after restoring the RNG
        # state) draws the same dropout masks as an uninterrupted one.
        generator=torch.Generator().manual_seed(recipe.train.seed),
    )


def schedule_length(
    num_batches: int, *, gradient_accumulation_steps: int, num_train_epochs: float, max_steps: int | None
) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps) for `num_batches` micro-batches per epoch.

    The last accumulation window of an epoch may be short; it still makes one optimizer step.
    `max_steps`, when set, overrides the epochs.

    >>> schedule_length(10, gradient_accumulation_steps=4, num_train_epochs=2, max_steps=None)
    (3, 6)
    """
    steps_per_epoch = math.ceil(num_batches / gradient_accumulation_steps)
    total_steps = max_steps or math.ceil(num_train_epochs * steps_per_epoch)
    return steps_per_epoch, total_steps


def setup(recipe: Recipe, accelerator) -> Run:
    """Data, model, optimizer, schedule, resume: everything the loop needs."""
    from accelerate.utils import set_seed

    from finetune.data.prepare import prepare_on_main_process
    from finetune.model import (
        apply_lora,
        build_model,
        check_attention_backend,
        count_parameters,
        load_tokenizer,
        pad_token_id,
        save_base_model,
    )

    train = recipe.train
    # Before the (possibly long) data preparation: an attention backend that cannot run here fails now.
    check_attention_backend(recipe.model.attn_implementation)
    output_dir = Path(train.output_dir)
    set_seed(train.seed, deterministic=train.enable_full_determinism)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "recipe.resolved.yaml").write_text(dump_yaml(recipe_to_dict(recipe)))

    tokenizer = load_tokenizer(recipe.model)
    # One process per machine builds the prepared dataset; the others wait, however long it takes,
    # then load it from the cache.
    prepared = prepare_on_main_process(recipe, accelerator)

    model = build_model(
        recipe.model,
        recipe.lora,
        mixed_precision=train.mixed_precision,
        vocab_size=len(tokenizer),
        gradient_checkpointing=train.gradient_checkpointing,
    )
    if recipe.lora.enable_lora:
        base_dir = None
        if recipe.model.model_path is None:
            base_dir = output_dir / "base_model"
            save_base_model(model, base_dir, is_main_process=accelerator.is_main_process)
        model = apply_lora(model, recipe.lora, gradient_checkpointing=train.gradient_checkpointing)
        if base_dir is not None:
            model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
    if train.mixed_precision == "fp16":
        from finetune.model import upcast_trainable_to_fp32

        upcast_trainable_to_fp32(model)
    trainable, total = count_parameters(model)
    accelerator.print(f"parameters: {trainable:,} trainable / {total:,} total")

    from finetune.accelerate_config import engine_from_env
    from finetune.optim import optimizer_for, scheduler_for

    engine = engine_from_env()
    optimizer = optimizer_for(
        model,
        train,
        cpu_offload=engine.kind == "deepspeed" and engine.offload_optimizer != "none",
        device=accelerator.device,
    )
    pad_id = pad_token_id(tokenizer)
    train_dl = make_dataloader(
        prepared.train,
        recipe,
        pad_id=pad_id,
        packed=recipe.data.sample_packing,
        shuffle=True,
        drop_last=recipe.data.dataloader_drop_last,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
    )
    if len(train_dl) == 0:
        raise FinetuneError(
            "no training batches: the prepared train split has fewer rows than "
            f"train.micro_batch_size x processes ({len(prepared.train)} rows); lower micro_batch_size "
            "or set data.dataloader_drop_last: false"
        )
    dropped = train_dl.batch_sampler.dropped_per_epoch
    if dropped:
        accelerator.print(
            f"data.dataloader_drop_last: {dropped} of {len(prepared.train)} rows per epoch do not fill a "
            f"last batch of {train.micro_batch_size} x {accelerator.num_processes} processes and are "
            "not trained on (a different set each epoch); set dataloader_drop_last: false to keep them"
        )
    eval_dl = None
    if prepared.eval is not None and len(prepared.eval) > 0:
        eval_dl = make_dataloader(
            prepared.eval,
            recipe,
            pad_id=pad_id,
            packed=recipe.data.eval_sample_packing,
            shuffle=False,
            drop_last=False,
        )

    # The schedule length comes from the real number of optimizer steps in the packed data.
    steps_per_epoch, total_steps = schedule_length(
        len(train_dl),
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        num_train_epochs=train.num_train_epochs,
        max_steps=train.max_steps,
    )
    scheduler = scheduler_for(optimizer, train, total_steps)
    if engine.kind == "deepspeed":
        # Given the scheduler, the DeepSpeed engine would step it inside backward (and not on skipped
        # steps); the loop steps it itself, once per optimizer step, as for every other engine. It
        # changes the LR in the param groups DeepSpeed's optimizer shares with ours.
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(scheduler)
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)

    run = Run(
        recipe=recipe,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dl=train_dl,
        eval_dl=eval_dl,
        tokenizer=tokenizer,
        manifest=prepared.manifest,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        output_dir=output_dir,
    )
    unwrapped = accelerator.unwrap_model(model)
    run.flops_info = {"config": unwrapped.config, "num_params": total, "num_trainable": trainable}

    checkpoint = find_checkpoint(train.load_checkpoint_path, output_dir)
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        run.state = TrainState(**load_train_state(checkpoint)["state"])
        accelerator.print(f"resumed from {checkpoint} at step {run.state.step}")
    elif train.load_checkpoint_path == "auto":
        accelerator.print(f"load_checkpoint_path: auto found no checkpoint in {output_dir}; starting fresh")
    return run


# ------------------------------------------------------------------------------------------ loop


class StopFlag:
    """Set by SIGTERM/SIGINT: the loop finishes the current step, checkpoints and exits 0."""

    def __init__(self):
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name


def count_trainable(batch: dict) -> torch.Tensor:
    """Tokens that contribute to the loss: labels shifted by one (the model predicts t+1 from t)."""
    return (batch["labels"][:, 1:] != -100).sum()


def count_tokens(batch: dict) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def forward(model, batch: dict, *, num_items: torch.Tensor | None = None):
    """The model's forward on a collated batch (labels included when num_items is given).

    use_cache=False matters for correctness, not only memory: with a KV cache, transformers skips
    the packed-sequence detection that turns restarting position_ids into a block-diagonal mask,
    and packed sequences would attend to each other.
    """
    if num_items is None:
        batch = {k: v for k, v in batch.items() if k != "labels"}
        return model(**batch, use_cache=False)
    return model(**batch, use_cache=False, num_items_in_batch=num_items)


def train_step(run: Run, window: list[dict]) -> dict[str, Any]:
    """One optimizer step over an accumulation window of micro-batches.

    The loss is the sum of token losses over the whole window on all processes, divided by the
    number of trainable tokens in that window on all processes. Accelerate (or DeepSpeed) divides by
    the accumulation steps in backward and DDP averages over processes, so each micro-batch's loss is
    scaled by (accumulation steps x processes) to undo both.

    Gradients are synchronised on the window's last micro-batch only. The window is formed here (the
    last one of an epoch may be short), so the sync flag is set per micro-batch, as
    transformers.Trainer does, rather than counted by `accelerator.accumulate`.
    """
    acc, model, train = run.accelerator, run.model, run.recipe.train
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
    window = [send_to_device(b, acc.device) for b in window]
    # Sync point: one all-reduce of the window's trainable-token count, needed before any backward.
    local_count = sum(count_trainable(b) for b in window)
    global_count = acc.reduce(local_count.to(acc.device).float(), reduction="sum")
    scale = train.gradient_accumulation_steps * acc.num_processes
    loss_sum = torch.zeros((), device=acc.device)
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        acc.gradient_state._set_sync_gradients(last)
        # DeepSpeed keeps its own accumulation boundary (set from the sync flag in backward).
        no_sync = contextlib.nullcontext() if last or deepspeed else acc.no_sync(model)
        with no_sync:
            out = forward(model, batch, num_items=global_count.clamp(min=1))
            # Under DeepSpeed the last backward also runs the engine's step (clip, update, zero grad).
            acc.backward(out.loss * scale)
        loss_sum += out.loss.detach().float() * global_count
    grad_norm = None
    window_loss = acc.reduce(loss_sum, reduction="sum") / global_count.clamp(min=1)
    loss_value = window_loss.item()  # sync point: the nonfinite check needs the value on the host
    if deepspeed:
        return _deepspeed_result(run, loss_value, int(global_count.item()))
    if not math.isfinite(loss_value):
        run.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_value, "applied": False, "trainable": int(global_count.item())}
    if train.max_grad_norm is not None:
        grad_norm = acc.clip_grad_norm_(model.parameters(), train.max_grad_norm)
    elif run.state.step % train.log_steps == train.log_steps - 1:
        grad_norm = acc.clip_grad_norm_(model.parameters(), float("inf"))  # norm only, for the log
    fp16_skipped = optimizer_step(acc, run.optimizer)
    run.optimizer.zero_grad(set_to_none=True)
    return {
        "loss": loss_value,
        "applied": True,
        "fp16_skipped": fp16_skipped,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "trainable": int(global_count.item()),
    }


def optimizer_step(acc, optimizer) -> bool:
    """Step the optimizer; True when fp16 loss scaling skipped the update (an overflow).

    The skip is read from the scale, which GradScaler lowers exactly when it finds an inf/NaN
    gradient: Accelerate's `optimizer_step_was_skipped` watches whether the optimizer's step method
    ran, but GradScaler always calls the step of a fused optimizer (the fused kernel itself skips the
    update), so that flag would miss every overflow. Reading the scale is a sync point (fp16 only).
    """
    if acc.scaler is None:
        optimizer.step()
        return False
    scale_before = acc.scaler.get_scale()
    optimizer.step()
    return acc.scaler.get_scale() < scale_before


def _deepspeed_result(run: Run, loss_value: float, trainable: int) -> dict[str, Any]:
    """The step's outcome under DeepSpeed, whose engine has already stepped inside the last backward.

    DeepSpeed skips an update whose gradient norm is not finite when clipping is on or precision is
    16-bit (its overflow check): that is the nonfinite skip here. An update it applied despite a
    nonfinite loss cannot be undone, so the run stops.
    """
    acc = run.accelerator
    skipped = bool(acc.optimizer_step_was_skipped)
    grad_norm = acc.clip_grad_norm_(run.model.parameters(), run.recipe.train.max_grad_norm or 0.0)
    if not math.isfinite(loss_value):
        if not skipped:
            raise FinetuneError(
                f"nonfinite loss ({loss_value}) at step {run.state.step + 1} and DeepSpeed applied the "
                "update (its overflow check is off with fp32 and no clipping): set train.max_grad_norm "
                "so DeepSpeed skips such steps, and resume from the last checkpoint"
            )
        return {"loss": loss_value, "applied": False, "trainable": trainable}
    return {
        "loss": loss_value,
        "applied": True,
        "fp16_skipped": skipped and run.recipe.train.mixed_precision == "fp16",
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "trainable": trainable,
    }


def skip_window(run: Run, window: list[dict]) -> None:
    """train.iterations_to_skip: the window's batches are consumed without forward or update."""
    run.state.skipped_iterations += 1


def evaluate(run: Run) -> dict[str, float]:
    """Token-weighted eval loss and perplexity over the eval split, gathered across processes."""
    acc, model = run.accelerator, run.model
    model.eval()
    total_loss, total_count = 0.0, 0
    with torch.no_grad():
        for batch in run.eval_dl:
            logits = forward(model, batch).logits[:, :-1].float()
            target = batch["labels"][:, 1:]
            per_token = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), target, ignore_index=-100, reduction="none"
            )
            sums, counts = per_token.sum(dim=1), (target != -100).sum(dim=1)
            sums, counts = acc.gather_for_metrics((sums, counts))
            total_loss += float(sums.sum())
            total_count += int(counts.sum())
    model.train()
    loss = total_loss / max(total_count, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": total_count}


def checkpoint(run: Any) -> Path:
    """checkpoints/step-N of the run (accelerate state + `run.state`), pushed with hub.strategy every_save.

    Shared with the diffusion loop: `run` needs accelerator, recipe, state (a dataclass with `step`),
    output_dir and total_steps.
    """
    state = dataclasses.asdict(run.state)
    path = save_checkpoint(
        run.accelerator,
        run.output_dir,
        run.state.step,
        {"state": state, "total_steps": run.total_steps},
        dump_yaml(recipe_to_dict(run.recipe)),
        total_limit=run.recipe.train.save_total_limit,
    )
    run.accelerator.print(f"checkpoint saved: {path}")
    if (
        run.recipe.hub.model_id
        and run.recipe.hub.strategy == "every_save"
        and run.accelerator.is_main_process
    ):
        from finetune.hub import push_folder

        push_folder(
            path,
            run.recipe.hub.model_id,
            private=run.recipe.hub.private,
            commit_message=f"checkpoint step {run.state.step}",
            path_in_repo=f"checkpoints/{path.name}",
        )
    return path


def should_save(run: Any) -> bool:
    """save_steps (every N optimizer steps) and save_epochs (every N epochs, fractions allowed)."""
    train, step = run.recipe.train, run.state.step
    if train.save_steps and step % train.save_steps == 0:
        return True
    if train.save_epochs:
        return crosses_epoch_mark(step, steps_per_epoch=run.steps_per_epoch, save_epochs=train.save_epochs)
    return False


def crosses_epoch_mark(step: int, *, steps_per_epoch: int, save_epochs: float) -> bool:
    """Whether optimizer step `step` is the first at or after a multiple of `save_epochs` epochs.

    Marks are placed in epochs, not as a rounded step interval, so they do not drift away from
    epoch ends: with 7 steps per epoch and save_epochs 0.5, saves land on steps 4, 7, 11, 14.

    >>> [s for s in range(1, 15) if crosses_epoch_mark(s, steps_per_epoch=7, save_epochs=0.5)]
    [4, 7, 11, 14]
    """
    interval = save_epochs * steps_per_epoch  # in optimizer steps, possibly fractional
    # The small epsilon keeps a mark that lands exactly on a step (e.g. 3 x 1/3 epoch) on that step.
    return math.floor(step / interval + 1e-9) > math.floor((step - 1) / interval + 1e-9)


def train_loop(run: Run, log: ProgressLog) -> None:
    """Epochs of accumulation windows until total_steps; logs, evals, checkpoints, stops cleanly."""
    acc, train, st = run.accelerator, run.recipe.train, run.state
    stop = StopFlag()
    started = time.monotonic()
    profiler = None
    interval = {"t0": time.perf_counter(), "tokens": 0, "trainable": 0, "seq_sq": 0.0, "seq": 0}
    peak = device_peak_flops(acc.device)
    skip = set(train.iterations_to_skip)
    if acc.is_main_process and train.report_to:
        acc.init_trackers(run.output_dir.name, config=_flat(recipe_to_dict(run.recipe)))
    run.model.train()
    while st.step < run.total_steps and run.stop_reason is None:
        run.train_dl.batch_sampler.set_epoch(st.epoch)
        loader = run.train_dl
        if st.micro_step_in_epoch:
            loader = acc.skip_first_batches(run.train_dl, st.micro_step_in_epoch)
        batches = iter(loader)
        epoch_done = False
        while st.step < run.total_steps:
            window = list(islice(batches, train.gradient_accumulation_steps))
            if not window:
                epoch_done = True
                break
            st.micro_step_in_epoch += len(window)
            if train.enable_profiling and st.step + 1 == train.profile_start_step:
                profiler = _start_profiler(acc)
            for b in window:
                interval["tokens"] += count_tokens(b)
                seq_sq, seq = _seq_stats(b)
                interval["seq_sq"] += seq_sq
                interval["seq"] += seq
            if st.step + 1 in skip:
                skip_window(run, window)
                result = {"applied": False, "skipped": True}
            else:
                result = train_step(run, window)
            result["lr"] = run.scheduler.get_last_lr()[0]  # the LR this step used (before the schedule moves)
            st.step += 1
            run.scheduler.step()
            _account(run, result, interval, log)
            if profiler is not None and st.step >= train.profile_end_step:
                _stop_profiler(profiler, run)
                profiler = None
            if st.step % train.log_steps == 0 or st.step == run.total_steps:
                st.train_seconds += time.perf_counter() - interval["t0"]
                _log_step(run, result, interval, log, peak)
            if run.eval_dl is not None and train.eval_steps and st.step % train.eval_steps == 0:
                metrics = evaluate(run)
                run.last_eval = (st.step, metrics)
                log.log({"step": st.step, "event": "eval", **metrics})
                if train.report_to:
                    acc.log(metrics, step=st.step)
            if not end_of_step(run, stop, started):
                break
        if epoch_done:
            st.epoch += 1
            st.micro_step_in_epoch = 0
    if profiler is not None:
        _stop_profiler(profiler, run)
    checkpoint_if_stopped(run, log)


def end_of_step(run: Any, stop: StopFlag, started: float) -> bool:
    """After an optimizer step: agree on stopping (False: stop now), else checkpoint when due and
    release memory every empty_cache_steps / gc_steps. Shared with the diffusion loop."""
    train, step = run.recipe.train, run.state.step
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


def checkpoint_if_stopped(run: Any, log: ProgressLog) -> None:
    """A run stopped by a signal or the time limit ends with a checkpoint to resume from."""
    if run.stop_reason is not None:
        path = checkpoint(run)
        log.message(
            f"stopping: {run.stop_reason}; checkpoint at {path}. Resume with "
            "--train.load_checkpoint_path auto"
        )


def _account(run: Run, result: dict, interval: dict, log: ProgressLog) -> None:
    st = run.state
    if result.get("skipped"):
        log.log({"step": st.step, "event": "skipped_iteration"})
        return
    if not count_nonfinite(run, result, log):
        return
    st.num_trainable_tokens += result["trainable"]
    interval["trainable"] += result["trainable"]


def count_nonfinite(run: Any, result: dict, log: ProgressLog) -> bool:
    """Count a step's outcome; True when its update was applied.

    A nonfinite step is logged; after train.max_consecutive_nonfinite of them in a row the run saves
    a checkpoint and stops. Nonfinite steps never update the weights or the optimizer, so they are
    still the last good state. The checkpoint is named after the steps consumed (data position and
    schedule are there): naming it after an earlier step would overwrite that step's real checkpoint.
    Shared with the diffusion loop (`run.state` has the nonfinite and fp16 counters).
    """
    st, train = run.state, run.recipe.train
    if result["applied"]:
        st.nonfinite_in_a_row = 0
        st.fp16_skipped_steps += int(result.get("fp16_skipped", False))
        return True
    st.nonfinite_in_a_row += 1
    st.nonfinite_steps += 1
    log.log(
        {
            "step": st.step,
            "event": "nonfinite_loss",
            "loss": result["loss"],
            "in_a_row": st.nonfinite_in_a_row,
        }
    )
    if st.nonfinite_in_a_row >= train.max_consecutive_nonfinite:
        path = checkpoint(run)
        raise FinetuneError(
            f"{st.nonfinite_in_a_row} nonfinite losses in a row (limit train.max_consecutive_nonfinite="
            f"{train.max_consecutive_nonfinite}); the last good state (weights and optimizer as of the last "
            f"finite loss) is saved at {path}. Lower train.lr, check the data, or use bf16 instead of fp16."
        )
    return False


def _seq_stats(batch: dict) -> tuple[float, int]:
    """(sum of squared sequence lengths, number of tokens) of a batch, from position_ids resets."""
    pos = batch["position_ids"]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    lengths = torch.diff(torch.nonzero(torch.cat([starts.flatten(), starts.new_ones(1)])).flatten())
    return float((lengths.double() ** 2).sum()), int(lengths.sum())


def _log_step(run: Run, result: dict, interval: dict, log: ProgressLog, peak: float | None) -> None:
    acc, st = run.accelerator, run.state
    # Interval token counts are this process's; throughput is reported per device and in total.
    elapsed = max(time.perf_counter() - interval["t0"], 1e-9)
    tokens, trainable = interval["tokens"], interval["trainable"]
    st.num_tokens += tokens
    seq_sq_mean = interval["seq_sq"] / max(interval["seq"], 1)
    flops_per_token = model_flops_per_token(
        run.flops_info["config"],
        num_params=run.flops_info["num_params"],
        num_trainable=run.flops_info["num_trainable"],
        seq_len_sq_mean=seq_sq_mean,
    )
    tflops = tokens * flops_per_token / elapsed / 1e12
    record = {
        "step": st.step,
        "epoch": st.epoch + st.micro_step_in_epoch / max(len(run.train_dl), 1),
        "loss": result.get("loss"),
        "lr": result["lr"],
        "grad_norm": result.get("grad_norm"),
        "tokens_per_sec": tokens / elapsed,
        "tokens_per_sec_total": tokens * acc.num_processes / elapsed,
        "trainable_tokens": trainable,
        "trainable_tokens_per_sec": trainable / elapsed,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
        "peak_mem_gib": peak_memory_gib(acc.device),
        "host_rss_gib": host_peak_rss_gib(),
        "fp16_skipped_steps": st.fp16_skipped_steps if run.recipe.train.mixed_precision == "fp16" else None,
        "loss_scale": acc.scaler.get_scale() if acc.scaler is not None else None,
        "nonfinite_steps": st.nonfinite_steps,
    }
    log.log(record)
    if run.recipe.train.report_to:
        acc.log(
            {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=st.step
        )
    interval.update(t0=time.perf_counter(), tokens=0, trainable=0, seq_sq=0.0, seq=0)


def stop_reason(run: Any, stop: StopFlag, started: float) -> str | None:
    """Agree across processes on whether to stop (a signal or the time limit).

    Shared with the diffusion loop: `run` needs `accelerator` and `recipe`.
    """
    acc, limit = run.accelerator, run.recipe.train.exit_duration_in_mins
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


def _start_profiler(acc):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if acc.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
    profiler.__enter__()
    return profiler


def _stop_profiler(profiler, run: Run) -> None:
    profiler.__exit__(None, None, None)
    trace_dir = run.output_dir / run.recipe.train.profile_trace_dir
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"trace_rank{run.accelerator.process_index}.json"
    profiler.export_chrome_trace(str(path))
    run.accelerator.print(f"profiler trace written to {path}")


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


# ------------------------------------------------------------------------------------------ save


def save_final(run: Run, final_metrics: dict) -> None:
    """The adapter (or full model) in Hugging Face format, tokenizer and model card, then the Hub."""
    acc, recipe = run.accelerator, run.recipe
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(run.model)
    # Sharded engines must gather the full weights first; otherwise the unwrapped model saves its own
    # state dict (get_state_dict of a torch.compile'd PEFT model has keys PEFT's save cannot map).
    from accelerate.utils import DistributedType

    sharded = acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    # ZeRO-3 gathers the 16-bit weights, FSDP2 a full state dict on rank 0 (every rank takes part).
    state_dict = acc.get_state_dict(run.model) if sharded else None
    merge = recipe.lora.enable_lora and not recipe.lora.save_lora_only
    if merge and sharded:
        # The sharded model cannot merge in place: save the adapter, then merge it into the base
        # weights on the main process (the same code as `finetune merge-lora`).
        from finetune.model import merge_lora

        adapter_dir = run.output_dir / ".adapter-to-merge"
        unwrapped.save_pretrained(
            adapter_dir, state_dict=state_dict, is_main_process=acc.is_main_process, safe_serialization=True
        )
        if acc.is_main_process:
            run.tokenizer.save_pretrained(adapter_dir)  # its length sizes the embeddings
            if acc.distributed_type == DistributedType.DEEPSPEED:
                # Otherwise transformers would load the base for merging partitioned (ZeRO-3 init);
                # training is over, nothing else is built under ZeRO-3 after this.
                from transformers.integrations.deepspeed import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
            merge_lora(str(adapter_dir), str(run.output_dir))
            shutil.rmtree(adapter_dir)
    else:
        if merge:
            unwrapped = unwrapped.merge_and_unload()
        unwrapped.save_pretrained(
            run.output_dir,
            state_dict=state_dict,
            is_main_process=acc.is_main_process,
            save_function=acc.save,
            safe_serialization=True,
        )
    if acc.is_main_process:
        run.tokenizer.save_pretrained(run.output_dir)
        from finetune.model_card import write_model_card

        write_model_card(
            run.output_dir, recipe=recipe_to_dict(recipe), manifest=run.manifest, metrics=final_metrics
        )
        if recipe.hub.model_id:
            push_final(run)
    acc.wait_for_everyone()


def push_final(run: Any, extra_files: list[Path] = ()) -> str:
    """Upload the final outputs: the top-level files of output_dir (adapter or model, tokenizer, card,
    resolved recipe, progress log) plus `extra_files` under output_dir (the diffusion samples the card
    shows); not checkpoints/, base_model/, the trace or tracker folders.

    They are hard-linked (copied where links fail) into a staging folder beside them, so nothing
    large is copied and push_folder uploads exactly that set.
    """
    from finetune.hub import push_folder

    hub = run.recipe.hub
    files = [
        path
        for path in sorted(run.output_dir.iterdir())
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(".lock")
    ]
    with tempfile.TemporaryDirectory(dir=run.output_dir, prefix=".hub-upload-") as staging:
        for path in [*files, *extra_files]:
            target = Path(staging) / Path(path).relative_to(run.output_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
        sha = push_folder(
            staging, hub.model_id, private=hub.private, commit_message=f"finetune: step {run.state.step}"
        )
    run.accelerator.print(f"pushed {run.output_dir} to {hub.model_id} (commit {sha})")
    return sha


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        recipe = load_recipe(argv[0], argv[1:])
        accelerator = make_accelerator(recipe)
        try:
            if recipe.model.kind == "diffusion":  # the same accelerator, launch and loop pieces
                from finetune.diffusion.train import run_training as run_diffusion_training

                return run_diffusion_training(recipe, accelerator)
            return run_training(recipe, accelerator)
        finally:
            # Also on an early stop or an abort: trackers flush their files here.
            accelerator.end_training()
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run_training(recipe: Recipe, accelerator) -> int:
    """setup -> train loop -> final eval -> save; 0 when done or stopped cleanly (with a checkpoint)."""
    run = setup(recipe, accelerator)
    log = ProgressLog(
        run.output_dir / "progress.jsonl",
        enabled=accelerator.is_main_process,
        log_format=recipe.train.log_format,
        total_steps=run.total_steps,
        initial_step=run.state.step,
    )
    try:
        train_loop(run, log)
        if run.stop_reason is not None:
            return 0
        final: dict[str, Any] = {"step": run.state.step, "trainable_tokens": run.state.num_trainable_tokens}
        if run.eval_dl is not None:
            if run.last_eval is not None and run.last_eval[0] == run.state.step:
                metrics = run.last_eval[1]  # eval_steps just evaluated this very state
            else:
                metrics = evaluate(run)
                log.log({"step": run.state.step, "event": "eval", **metrics})
            final.update(metrics)
    finally:
        log.close()
    if recipe.train.save_hf_weights:
        save_final(run, final)
    accelerator.print(f"done: {run.state.step} steps, outputs in {run.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
