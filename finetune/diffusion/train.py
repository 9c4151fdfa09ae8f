"""Diffusion LoRA training: setup -> train loop -> validation samples -> save.

Entered from finetune/train.py `main()` when `model.kind` is diffusion, with the same Accelerator
(`make_accelerator`): the same launchers, mixed precision, accumulation, checkpoints
(finetune.checkpoint), `progress.jsonl`, trackers, stop signals and Hub push as LLM runs.

Counters as in the LLM loop: `step` counts optimizer steps, `micro_step_in_epoch` the micro-batches
consumed in the current epoch (what resume skips). Precision: the frozen UNet is held in
`weight_dtype` (the mixed-precision dtype under `model.torch_dtype: auto`), the LoRA weights in fp32
(fp16 loss scaling needs fp32 gradients), and the VAE only ran at prepare time, in fp32.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from finetune.checkpoint import find_checkpoint, load_train_state
from finetune.errors import FinetuneError
from finetune.metrics import ProgressLog, host_peak_rss_gib, peak_memory_gib
from finetune.recipe import Recipe, recipe_to_dict
from finetune.recipe.yaml_io import dump_yaml
from finetune.train import (
    LoopState,
    StopFlag,
    _flat,
    checkpoint_if_stopped,
    count_nonfinite,
    end_of_step,
    optimizer_step,
    push_final,
    schedule_length,
)


@dataclass
class DiffusionState(LoopState):
    """The loop's counters (accelerate's state holds LoRA weights, optimizer, scheduler, RNG, EMA)."""

    num_images: int = 0


@dataclass
class DiffusionRun:
    recipe: Recipe
    accelerator: Any
    info: Any  # PipelineInfo
    unet: Any
    optimizer: Any
    scheduler: Any
    noise_scheduler: Any
    train_dl: Any
    batch_sampler: Any
    manifest: dict
    total_steps: int
    steps_per_epoch: int
    output_dir: Path
    weight_dtype: torch.dtype
    scaling_factor: float
    shift_factor: float = 0.0  # the VAE's (SD3: 0.0609); latents = (z - shift) * scaling_factor
    guidance_scale: float | None = None  # Flux's embedded guidance; None without guidance embeddings
    ema: Any = None
    state: DiffusionState = field(default_factory=DiffusionState)
    stop_reason: str | None = None
    pipeline: Any = None  # built at the first validation, kept for the next ones
    samples: list = field(default_factory=list)  # (prompt, path) of the latest validation
    sampled_at: int | None = None
    # This process, this run (not resumed): the per-process summary of a multi-process run.
    steps_here: int = 0
    micro_batches_here: int = 0
    images_here: int = 0


def run_training(recipe: Recipe, accelerator) -> int:
    """setup -> loop -> final samples -> save; 0 when done or stopped cleanly (with a checkpoint)."""
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
        if recipe.diffusion.validation_prompts and run.sampled_at != run.state.step:
            sample(run, log)
    finally:
        log.close()
    if recipe.train.save_hf_weights:
        save_final(run)
    if accelerator.num_processes > 1:  # every process: equal counts, or ranks drifted apart in the data
        print(
            f"process {accelerator.process_index}: {run.steps_here} steps, {run.micro_batches_here} "
            f"micro-batches, {run.images_here} images",
            flush=True,
        )
    accelerator.print(f"done: {run.state.step} steps, outputs in {run.output_dir}")
    return 0


# ----------------------------------------------------------------------------------------- setup


def setup(recipe: Recipe, accelerator) -> DiffusionRun:
    """Cached latents, UNet with LoRA, optimizer, schedule, resume."""
    from functools import partial

    from accelerate.utils import set_seed

    from finetune.data.prepare import prepare_on_main_process
    from finetune.diffusion.cache import prepare_images
    from finetune.diffusion.loader import make_loader
    from finetune.diffusion.model import (
        add_lora,
        guidance_embeds,
        load_denoiser,
        load_noise_scheduler,
        pipeline_info,
        weight_dtype,
    )
    from finetune.optim import optimizer_for, scheduler_for

    train, settings = recipe.train, recipe.diffusion
    output_dir = Path(train.output_dir)
    set_seed(train.seed, deterministic=train.enable_full_determinism)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "recipe.resolved.yaml").write_text(dump_yaml(recipe_to_dict(recipe)))
    info = pipeline_info(recipe.model.model_path, recipe.model.revision, settings.vae_path)
    # One process per machine encodes; the others wait, however long the VAE takes, then load
    # the cache it wrote.
    prepared = prepare_on_main_process(
        recipe, accelerator, build=partial(prepare_images, device=accelerator.device)
    )

    dtype = weight_dtype(recipe.model.torch_dtype, train.mixed_precision)
    unet = load_denoiser(info, dtype)  # the UNet, or SD3's transformer (still named `unet` here)
    lora = recipe.lora
    trainable = add_lora(
        unet,
        rank=lora.lora_rank,
        alpha=lora.lora_alpha,
        dropout=lora.lora_dropout,
        targets=lora.lora_target_modules,
        gradient_checkpointing=train.gradient_checkpointing,
    )
    total = sum(p.numel() for p in unet.parameters())
    accelerator.print(
        f"{info.denoiser_name} LoRA: {trainable:,} trainable / {total:,} total parameters ({info.class_name})"
    )
    noise_scheduler = load_noise_scheduler(info, settings.prediction_type)
    guidance_scale = None
    if guidance_embeds(info):
        guidance_scale = settings.guidance_scale
    elif info.family == "flux":  # a non-default value was refused when the cache was prepared
        accelerator.print(
            f"diffusion.guidance_scale: not used: the transformer of {info.path} has no guidance embedding"
        )
    optimizer = optimizer_for(unet, train, device=accelerator.device)
    # This rank's share of every epoch (the same number of batches on every rank, no image
    # repeated): the loader is not passed through accelerator.prepare, train_step moves batches.
    train_dl = make_loader(
        prepared.train,
        batch_size=train.micro_batch_size,
        seed=train.seed,
        drop_last=recipe.data.dataloader_drop_last,
        num_workers=recipe.data.dataloader_num_workers,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
    )
    batch_sampler = train_dl.batch_sampler
    _report_dropped(accelerator, batch_sampler, prepared, recipe)
    _checkpoint_lora_only(accelerator, info)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    ema = None
    if settings.use_ema:
        from diffusers.training_utils import EMAModel

        ema = EMAModel([p for p in unet.parameters() if p.requires_grad], decay=settings.ema_decay)
        ema.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)  # saved and restored with every checkpoint

    steps_per_epoch, total_steps = schedule_length(
        len(train_dl),
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        num_train_epochs=train.num_train_epochs,
        max_steps=train.max_steps,
    )
    scheduler = scheduler_for(optimizer, train, total_steps)
    scheduler = accelerator.prepare(scheduler)
    run = DiffusionRun(
        recipe=recipe,
        accelerator=accelerator,
        info=info,
        unet=unet,
        optimizer=optimizer,
        scheduler=scheduler,
        noise_scheduler=noise_scheduler,
        train_dl=train_dl,
        batch_sampler=batch_sampler,
        manifest=prepared.manifest,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        output_dir=output_dir,
        weight_dtype=dtype,
        scaling_factor=prepared.manifest["latents"]["scaling_factor"],
        shift_factor=prepared.manifest["latents"].get("shift_factor") or 0.0,
        guidance_scale=guidance_scale,
        ema=ema,
    )
    # From here on each process draws its own noise, timesteps and flips: their images differ, and the
    # same draws on every rank would waste the batch's diversity. Everything above (LoRA init
    # included) used the same seed on every rank; one process keeps exactly the seed it had.
    set_seed(train.seed, device_specific=True, deterministic=train.enable_full_determinism)
    checkpoint_path = find_checkpoint(train.load_checkpoint_path, output_dir)
    if checkpoint_path is not None:
        accelerator.load_state(str(checkpoint_path))
        if ema is not None:
            ema.to(accelerator.device)
        run.state = DiffusionState(**load_train_state(checkpoint_path)["state"])
        accelerator.print(f"resumed from {checkpoint_path} at step {run.state.step}")
    elif train.load_checkpoint_path == "auto":
        accelerator.print(f"load_checkpoint_path: auto found no checkpoint in {output_dir}; starting fresh")
    return run


def _report_dropped(accelerator, sampler, prepared, recipe) -> None:
    """Refuse an epoch without batches; say which images an epoch leaves out (drop_last, small buckets)."""
    train, processes = recipe.train, accelerator.num_processes
    if len(sampler) == 0:
        raise FinetuneError(
            f"no training batches: no bucket holds train.micro_batch_size x processes ({train.micro_batch_size} "
            f"x {processes}) images (buckets: {prepared.manifest['buckets']}); lower micro_batch_size, set "
            "data.dataloader_drop_last: false, or diffusion.aspect_ratio_buckets: false"
        )
    dropped = sampler.dropped_rows(0)
    if not dropped:
        return
    if recipe.data.dataloader_drop_last:
        accelerator.print(
            f"data.dataloader_drop_last: {dropped} images per epoch do not fill a batch "
            f"of train.micro_batch_size x processes ({train.micro_batch_size} x {processes}) in their bucket "
            "and are left out (a different set each epoch)"
        )
    else:
        accelerator.print(
            f"warning: {dropped} images per epoch are in buckets with fewer images than processes "
            f"({processes}) and are never trained on; use fewer processes, add images, or set "
            f"diffusion.aspect_ratio_buckets: false (buckets: {prepared.manifest['buckets']})"
        )


def _checkpoint_lora_only(accelerator, info) -> None:
    """Checkpoints hold the LoRA weights (pytorch_lora_weights.safetensors), not the frozen UNet.

    accelerate's save_state would otherwise write the whole UNet (3.4 GB for SD 1.5 in fp32) at
    every checkpoint. The hooks take the models out of accelerate's hands and save/load the
    adapter in the diffusers format instead.
    """
    from finetune.diffusion.model import load_lora_into_unet, save_lora

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for model in models:
                save_lora(info, accelerator.unwrap_model(model), output_dir)
        weights.clear()  # nothing left for accelerate to save

    def load_hook(models, input_dir):
        while models:
            load_lora_into_unet(accelerator.unwrap_model(models.pop()), input_dir, prefix=info.denoiser_name)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# ------------------------------------------------------------------------------------------ loop


def train_step(run: DiffusionRun, window: list[dict]) -> dict[str, Any]:
    """One optimizer step over an accumulation window of micro-batches.

    Every micro-batch loss is a mean over its images. Accelerate divides by the accumulation steps
    in backward, so each loss is scaled by (accumulation steps / window length): the update is the
    mean over the window's micro-batches, also for an epoch's short last window. DDP averages over
    processes (every rank has a micro-batch at every position: BucketBatchSampler).

    Gradients are synchronised on the window's last micro-batch only; the sync flag is set per
    micro-batch (as finetune.train.train_step does) since the window is formed here.
    """
    from accelerate.utils import DistributedType, send_to_device

    acc, unet, train = run.accelerator, run.unet, run.recipe.train
    scale = train.gradient_accumulation_steps / len(window)
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED  # keeps its own accumulation boundary
    loss_sum = torch.zeros((), device=acc.device)
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        batch = send_to_device(batch, acc.device)
        acc.gradient_state._set_sync_gradients(last)
        with contextlib.nullcontext() if last or deepspeed else acc.no_sync(unet):
            loss = micro_batch_loss(run, batch)
            acc.backward(loss * scale)
            loss_sum += loss.detach().float()
    window_loss = acc.reduce(loss_sum, reduction="mean") / len(window)
    loss_value = window_loss.item()  # sync point: the nonfinite check needs the value on the host
    if not math.isfinite(loss_value):
        run.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_value, "applied": False}
    params = [p for p in unet.parameters() if p.requires_grad]
    grad_norm = None
    if train.max_grad_norm is not None:
        grad_norm = acc.clip_grad_norm_(params, train.max_grad_norm)
    skipped = optimizer_step(acc, run.optimizer)
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None and not skipped:
        run.ema.step(params)
    return {
        "loss": loss_value,
        "applied": True,
        "fp16_skipped": skipped,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
    }


def micro_batch_loss(run: DiffusionRun, batch: dict) -> torch.Tensor:
    """The family's objective: flow matching (SD3, Flux) or epsilon / v-prediction (UNets)."""
    from finetune.diffusion.objective import diffusion_loss, flow_matching_loss, flux_loss

    settings = run.recipe.diffusion
    common = dict(
        scaling_factor=run.scaling_factor,
        prior_loss_weight=settings.prior_loss_weight,
        model_dtype=run.weight_dtype,
    )
    if run.info.flow_matching:
        flow = dict(
            shift_factor=run.shift_factor,
            weighting_scheme=settings.weighting_scheme,
            logit_mean=settings.logit_mean,
            logit_std=settings.logit_std,
            mode_scale=settings.mode_scale,
        )
        if run.info.family == "flux":
            return flux_loss(
                run.unet, run.noise_scheduler, batch, guidance_scale=run.guidance_scale, **flow, **common
            )
        return flow_matching_loss(run.unet, run.noise_scheduler, batch, **flow, **common)
    return diffusion_loss(
        run.unet,
        run.noise_scheduler,
        batch,
        noise_offset=settings.noise_offset,
        snr_gamma=settings.snr_gamma,
        **common,
    )


def train_loop(run: DiffusionRun, log: ProgressLog) -> None:
    """Epochs of accumulation windows until total_steps; logs, samples, checkpoints, stops cleanly."""
    acc, train, settings, st = run.accelerator, run.recipe.train, run.recipe.diffusion, run.state
    stop = StopFlag()
    started = time.monotonic()
    interval = {"t0": time.perf_counter(), "images": 0}
    if acc.is_main_process and train.report_to:
        acc.init_trackers(run.output_dir.name, config=_flat(recipe_to_dict(run.recipe)))
    run.unet.train()
    while st.step < run.total_steps and run.stop_reason is None:
        # The order of an epoch depends only on (seed, epoch): resume needs no sampler state.
        run.batch_sampler.set_epoch(st.epoch)
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
            interval["images"] += sum(len(b["index"]) for b in window)
            run.micro_batches_here += len(window)
            run.images_here += sum(len(b["index"]) for b in window)
            result = train_step(run, window)
            result["lr"] = run.scheduler.get_last_lr()[0]  # the LR this step used
            st.step += 1
            run.steps_here += 1
            run.scheduler.step()
            count_nonfinite(run, result, log)
            if st.step % train.log_steps == 0 or st.step == run.total_steps:
                _log_step(run, result, interval, log)
            if settings.validation_steps and st.step % settings.validation_steps == 0:
                sample(run, log)  # before the checkpoint: a resumed run continues from the same RNG state
            if not end_of_step(run, stop, started):
                break
        if epoch_done:
            st.epoch += 1
            st.micro_step_in_epoch = 0
    checkpoint_if_stopped(run, log)


def _log_step(run: DiffusionRun, result: dict, interval: dict, log: ProgressLog) -> None:
    acc, st = run.accelerator, run.state
    elapsed = max(time.perf_counter() - interval["t0"], 1e-9)
    st.train_seconds += elapsed
    images = interval["images"]  # this process's
    total = images
    if acc.num_processes > 1:  # sync point (log steps only): ranks' batches may differ by one image
        total = int(acc.reduce(torch.tensor(images, device=acc.device), reduction="sum").item())
    st.num_images += total
    record = {
        "step": st.step,
        "epoch": st.epoch + st.micro_step_in_epoch / max(len(run.train_dl), 1),
        "loss": result.get("loss"),
        "lr": result["lr"],
        "grad_norm": result.get("grad_norm"),
        "images_per_sec": images / elapsed,
        "images_per_sec_total": total / elapsed,
        "num_images": st.num_images,
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
    interval.update(t0=time.perf_counter(), images=0)


# ------------------------------------------------------------------------------------ validation


def sample(run: DiffusionRun, log: ProgressLog) -> None:
    """Generate the validation prompts' images (main process), save them under samples/step-N/, log them.

    With EMA, the samples use the EMA weights (what the final save holds); the trained weights are
    put back afterwards.
    """
    from finetune.diffusion.sampling import generate, load_pipeline, log_to_trackers, save_samples

    acc, settings, st = run.accelerator, run.recipe.diffusion, run.state
    run.sampled_at = st.step
    acc.wait_for_everyone()
    if acc.is_main_process:
        unet = acc.unwrap_model(run.unet)
        params = [p for p in unet.parameters() if p.requires_grad]
        if run.ema is not None:
            run.ema.store(params)
            run.ema.copy_to(params)
        unet.eval()
        t0 = time.perf_counter()
        try:
            if run.pipeline is None:
                run.pipeline = load_pipeline(run.info, dtype=run.weight_dtype, device=acc.device, unet=unet)
            with acc.autocast():
                images = generate(
                    run.pipeline,
                    settings.validation_prompts,
                    num_images=settings.num_validation_images,
                    steps=settings.validation_inference_steps,
                    guidance_scale=settings.validation_guidance_scale,
                    resolution=settings.resolution,
                    seed=run.recipe.train.seed,
                    device=acc.device,
                    max_sequence_length=run.info.sequence_length(settings.max_sequence_length),
                )
        finally:
            unet.train()
            if run.ema is not None:
                run.ema.restore(params)
        folder = run.output_dir / "samples" / f"step-{st.step}"
        run.samples = save_samples(images, settings.validation_prompts, folder)
        log.log(
            {
                "step": st.step,
                "event": "samples",
                "images": len(run.samples),
                "folder": str(folder),
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
        if run.recipe.train.report_to:
            log_to_trackers(acc, images, settings.validation_prompts, st.step)
    acc.wait_for_everyone()


# ------------------------------------------------------------------------------------------ save


def save_final(run: DiffusionRun) -> None:
    """pytorch_lora_weights.safetensors (diffusers format; EMA weights when use_ema), card, Hub push."""
    from finetune.diffusion.model import save_lora
    from finetune.model_card import write_diffusion_model_card

    acc, recipe = run.accelerator, run.recipe
    acc.wait_for_everyone()
    if acc.is_main_process:
        unet = acc.unwrap_model(run.unet)
        params = [p for p in unet.parameters() if p.requires_grad]
        if run.ema is not None:
            run.ema.copy_to(params)
        save_lora(run.info, unet, run.output_dir)
        acc.print(f"LoRA weights saved: {run.output_dir / 'pytorch_lora_weights.safetensors'}")
        metrics = {"step": run.state.step, "images_seen": run.state.num_images}
        write_diffusion_model_card(
            run.output_dir,
            recipe=recipe_to_dict(recipe),
            manifest=run.manifest,
            metrics=metrics,
            samples=[(prompt, path.relative_to(run.output_dir).as_posix()) for prompt, path in run.samples],
        )
        if recipe.hub.model_id:
            push_final(run, extra_files=[path for _, path in run.samples])
    acc.wait_for_everyone()
