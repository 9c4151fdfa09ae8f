"""Diffusion LoRA / DreamBooth: the denoising (or flow-matching) loss on cached VAE latents.

Precision: the frozen UNet (or SD3/Flux transformer, still called `unet` here) is held in the
weight dtype (the mixed-precision dtype under `model.torch_dtype: auto`), the LoRA weights in fp32
(fp16 loss scaling needs fp32 gradients); the VAE only ran at prepare time, in fp32. Every
micro-batch loss is a mean over its images, so a micro-batch is the normalisation unit: the window's
update is the mean over its micro-batches. "Evaluation" is validation samples (images) every
`diffusion.validation_steps` and at the end.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from finetune import trackers
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.notices import warn

# diffusion.adapter -> how messages name it.
ADAPTER_NAMES = {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa", "full": "full fine-tuning"}


class _DeviceEMA:
    """diffusers' EMAModel as checkpointed extra state (finetune.engine.extra_state: safetensors and
    JSON, never pickle), put back on the device after a load (its restored shadow weights arrive on
    the CPU)."""

    def __init__(self, ema, device):
        self.ema, self.device = ema, device

    def state_dict(self) -> dict:
        return self.ema.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state)
        self.ema.to(self.device)


def report_dropped(accelerator, sampler, buckets: dict, *, micro_batch_size: int, drop_last: bool) -> None:
    """Refuse an epoch without batches; say which images an epoch leaves out (drop_last, small buckets)."""
    processes = accelerator.num_processes
    if len(sampler) == 0:
        raise FinetuneError(
            f"no training batches: no bucket holds train.micro_batch_size x processes ({micro_batch_size} "
            f"x {processes}) images (buckets: {buckets}); lower micro_batch_size, set "
            "data.dataloader_drop_last: false, or diffusion.aspect_ratio_buckets: false"
        )
    dropped = sampler.dropped_rows(0)
    if not dropped:
        return
    if drop_last:
        accelerator.print(
            f"data.dataloader_drop_last: {dropped} images per epoch do not fill a batch "
            f"of train.micro_batch_size x processes ({micro_batch_size} x {processes}) in their bucket "
            "and are left out (a different set each epoch)"
        )
    else:
        warn(
            f"{dropped} images per epoch are in buckets with fewer images than processes "
            f"({processes}) and are never trained on; use fewer processes, add images, or set "
            f"diffusion.aspect_ratio_buckets: false (buckets: {buckets})",
            emit=accelerator.print,
        )


class DiffusionObjective:
    """LoRA, LoKr, LoHa or full fine-tuning of a diffusers pipeline's denoiser (SD 1.x/2.x, SDXL, SD3,
    Flux), optionally with LoRA on its CLIP text encoder(s) (finetune.diffusion.text_encoder)."""

    name = "diffusion"
    summary_keys = ("images",)

    def __init__(self, recipe):
        # The objective is built by the entry point from the whole recipe and keeps only its parts.
        self.recipe = recipe
        self.train, self.settings = recipe.train, recipe.diffusion
        self.can_evaluate = bool(self.settings.validation_prompts)
        self.eval_every = self.settings.validation_steps if self.can_evaluate else None
        self.accelerator = None
        self.info: Any = None  # PipelineInfo
        self.noise_scheduler: Any = None
        self.weight_dtype = torch.float32
        self.scaling_factor, self.shift_factor = 1.0, 0.0
        self.guidance_scale: float | None = None  # Flux's embedded guidance; None without it
        self.ema: Any = None
        self.manifest: dict = {}
        self.pipeline: Any = None  # built at the first validation, kept for the next ones
        self.samples: list = []  # (prompt, path) of the latest validation
        # diffusion.train_text_encoder: all of the pipeline's tokenizers and encoders (trained and frozen,
        # in its order) and each cached row's caption by its index, to encode at every step.
        self.tokenizers: list = []
        self.encoders: list = []
        self.captions: dict[int, str] = {}

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare.build import prepare_on_main_process
        from finetune.diffusion.cache import prepare_images
        from finetune.diffusion.loader import make_loader
        from finetune.diffusion.model import load_noise_scheduler, pipeline_info

        self.accelerator = accelerator
        recipe, train, settings = self.recipe, self.train, self.settings
        self.info = pipeline_info(recipe.model.model_path, recipe.model.revision, settings.vae_path)
        if settings.train_text_encoder:  # refused for SD3 before anything is encoded
            from finetune.diffusion.text_encoder import trained_encoder_names

            trained_encoder_names(self.info.family, self.info.class_name)
        # One process per machine encodes; the others wait, however long the VAE takes, then load
        # the cache it wrote.
        prepared = prepare_on_main_process(
            recipe, accelerator, build=partial(prepare_images, device=accelerator.device)
        )
        self.manifest = prepared.manifest
        self.scaling_factor = prepared.manifest["latents"]["scaling_factor"]
        self.shift_factor = prepared.manifest["latents"].get("shift_factor") or 0.0
        unet = self._denoiser(accelerator)
        if settings.train_text_encoder:
            unet = self._with_text_encoders(accelerator, unet, prepared.train)
        self.noise_scheduler = load_noise_scheduler(self.info, settings.prediction_type)
        self._guidance(accelerator)
        # This rank's share of every epoch (the same number of batches on every rank, no image
        # repeated): the loader is not passed through accelerator.prepare; the engine moves batches.
        train_loader = make_loader(
            prepared.train,
            batch_size=train.micro_batch_size,
            seed=train.seed,
            drop_last=recipe.data.dataloader_drop_last,
            num_workers=recipe.data.dataloader_num_workers,
            num_replicas=accelerator.num_processes,
            rank=accelerator.process_index,
        )
        report_dropped(
            accelerator,
            train_loader.batch_sampler,
            prepared.manifest["buckets"],
            micro_batch_size=train.micro_batch_size,
            drop_last=recipe.data.dataloader_drop_last,
        )
        self._checkpoint_trained_only()
        return Parts(
            model=unet,
            train_loader=train_loader,
            manifest=prepared.manifest,
            lr_by_prefix=self._text_encoder_lr(),
        )

    def _denoiser(self, accelerator):
        from finetune.diffusion.adapters import add_peft_adapter, make_fully_trainable
        from finetune.diffusion.model import add_lora, load_denoiser, lora_target_names, weight_dtype

        lora, adapter = self.recipe.lora, self.settings.adapter
        # Full fine-tuning trains the weights themselves: fp32 masters (validated: torch_dtype auto/fp32).
        dtype = "fp32" if adapter == "full" else self.recipe.model.torch_dtype
        self.weight_dtype = weight_dtype(dtype, self.train.mixed_precision)
        unet = load_denoiser(self.info, self.weight_dtype)
        checkpointing = self.train.gradient_checkpointing
        if adapter == "full":
            trainable = make_fully_trainable(unet, gradient_checkpointing=checkpointing)
        elif adapter == "lora":
            trainable = add_lora(
                unet, rank=lora.lora_rank, alpha=lora.lora_alpha, dropout=lora.lora_dropout,
                targets=lora.lora_target_modules, gradient_checkpointing=checkpointing,
            )  # fmt: skip
        else:
            trainable = add_peft_adapter(
                unet, adapter, rank=lora.lora_rank, alpha=lora.lora_alpha, dropout=lora.lora_dropout,
                targets=lora_target_names(unet, lora.lora_target_modules), gradient_checkpointing=checkpointing,
            )  # fmt: skip
        total = sum(p.numel() for p in unet.parameters())
        accelerator.print(
            f"{self.info.denoiser_name} {ADAPTER_NAMES[adapter]}: {trainable:,} trainable / {total:,} total parameters "
            f"({self.info.class_name})"
        )
        return unet

    def _with_text_encoders(self, accelerator, unet, rows):
        """LoRA on the family's CLIP encoder(s), trained with the denoiser as one module; the captions of
        the cached rows, to encode them at every step."""
        from finetune.diffusion.model import load_text_encoders
        from finetune.diffusion.text_encoder import (
            WithTextEncoders,
            add_text_encoder_lora,
            trained_encoder_names,
        )

        names = trained_encoder_names(self.info.family, self.info.class_name)
        # Loaded on the CPU; only the trained ones stay and go to the device (Flux's frozen T5 is read
        # from the cache: its embeddings never change, so it is dropped, not kept in device memory).
        self.tokenizers, encoders = load_text_encoders(self.info, "cpu")
        lora, trained = self.recipe.lora, {}
        for name, encoder in zip(self.info.text_encoder_names, encoders, strict=True):
            if name in names:
                count = add_text_encoder_lora(
                    encoder.to(accelerator.device),
                    rank=lora.lora_rank,
                    alpha=lora.lora_alpha,
                    dropout=lora.lora_dropout,
                )
                accelerator.print(f"{name} LoRA: {count:,} trainable parameters")
                trained[name] = encoder
        self.encoders = [trained.get(name) for name in self.info.text_encoder_names]
        self.captions = dict(zip(rows["index"], rows["caption"], strict=True))
        return WithTextEncoders(unet, trained)

    def _text_encoder_lr(self) -> dict[str, float] | None:
        """The text encoders' own learning rate (diffusion.text_encoder_lr) as an optimizer group."""
        if not self.settings.train_text_encoder or self.settings.text_encoder_lr is None:
            return None
        return {"text_encoders.": self.settings.text_encoder_lr}

    def _guidance(self, accelerator) -> None:
        from finetune.diffusion.model import guidance_embeds

        if guidance_embeds(self.info):
            self.guidance_scale = self.settings.guidance_scale
        elif self.info.spec.guidance:  # a non-default value was refused when the cache was prepared
            accelerator.print(
                f"diffusion.guidance_scale: not used: the transformer of {self.info.path} has no guidance embedding"
            )

    def _checkpoint_trained_only(self) -> None:
        """Checkpoints hold what trains, in the format the final save uses, not the frozen weights.

        accelerate's save_state would otherwise write the whole UNet (3.4 GB for SD 1.5 in fp32) at
        every checkpoint. The hooks take the models out of accelerate's hands and save/load the
        adapters (diffusers' LoRA file with any text-encoder LoRA, or PEFT's LoKr / LoHa folder) or, for
        full fine-tuning, the whole denoiser.
        """
        acc = self.accelerator

        def save_hook(models, weights, output_dir):
            if acc.is_main_process:
                for model in models:
                    self._write_trained(acc.unwrap_model(model), Path(output_dir))
            weights.clear()  # nothing left for accelerate to save

        def load_hook(models, input_dir):
            while models:
                self._read_trained(acc.unwrap_model(models.pop()), Path(input_dir))

        acc.register_save_state_pre_hook(save_hook)
        acc.register_load_state_pre_hook(load_hook)

    def _write_trained(self, model, folder: Path) -> None:
        from finetune.diffusion.adapters import save_denoiser, save_peft_adapter
        from finetune.diffusion.model import save_lora
        from finetune.diffusion.text_encoder import split, text_encoder_lora_layers

        denoiser, encoders = split(model)
        adapter, name = self.settings.adapter, self.info.denoiser_name
        if adapter == "lora":
            save_lora(self.info, denoiser, folder, **text_encoder_lora_layers(encoders, self.info.family))
        elif adapter == "full":
            save_denoiser(denoiser, folder / name)
        else:
            save_peft_adapter(denoiser, folder / name)

    def _read_trained(self, model, folder: Path) -> None:
        from finetune.diffusion.adapters import load_denoiser_weights, load_peft_adapter
        from finetune.diffusion.model import load_lora_into_unet
        from finetune.diffusion.text_encoder import load_text_encoder_lora, split

        denoiser, encoders = split(model)
        adapter, name = self.settings.adapter, self.info.denoiser_name
        if adapter == "lora":
            load_lora_into_unet(denoiser, folder, prefix=name)
            if encoders:
                load_text_encoder_lora(encoders, folder)
        elif adapter == "full":
            load_denoiser_weights(denoiser, folder / name)
        else:
            load_peft_adapter(denoiser, folder / name)

    def on_prepared(self, accelerator, model) -> dict[str, Any]:
        from accelerate.utils import set_seed

        extra_state = {}
        if self.settings.use_ema:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(
                [p for p in model.parameters() if p.requires_grad], decay=self.settings.ema_decay
            )
            self.ema.to(accelerator.device)
            # Saved and restored with every checkpoint by the engine, not by accelerate's
            # register_for_checkpointing, which pickles and loads with weights_only=False.
            extra_state["ema"] = _DeviceEMA(self.ema, accelerator.device)
        # From here on each process draws its own noise, timesteps and flips: their images differ, and the
        # same draws on every rank would waste the batch's diversity. Everything above (LoRA init
        # included) used the same seed on every rank; one process keeps exactly the seed it had.
        set_seed(self.train.seed, device_specific=True, deterministic=self.train.enable_full_determinism)
        return extra_state

    # ------------------------------------------------------------------------------------ step

    def units(self, batch: dict) -> int:
        return 1  # the loss is a mean over the micro-batch's images

    def loss(self, model, batch: dict, num_units: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The family's objective: flow matching (SD3, Flux) or epsilon / v-prediction (UNets)."""
        from finetune.diffusion.objective import diffusion_loss

        settings = self.settings
        if self.encoders:  # text-encoder LoRA: this step's CLIP embeddings replace the cached ones
            from finetune.diffusion.text_encoder import trainable_embeds

            captions = [self.captions[int(i)] for i in batch["index"]]
            batch = {
                **batch,
                **trainable_embeds(self.info.family, self.tokenizers, self.encoders, captions, batch),
            }
        common = dict(
            scaling_factor=self.scaling_factor,
            prior_loss_weight=settings.prior_loss_weight,
            model_dtype=self.weight_dtype,
        )
        if self.info.flow_matching:
            flow = dict(
                shift_factor=self.shift_factor,
                weighting_scheme=settings.weighting_scheme,
                logit_mean=settings.logit_mean,
                logit_std=settings.logit_std,
                mode_scale=settings.mode_scale,
            )
            if self.info.spec.guidance:  # Flux, Flux.2: embedded guidance (None: not distilled)
                flow["guidance_scale"] = self.guidance_scale
            mean = self.info.spec.loss(model, self.noise_scheduler, batch, **flow, **common)
        else:
            mean = diffusion_loss(
                model,
                self.noise_scheduler,
                batch,
                noise_offset=settings.noise_offset,
                snr_gamma=settings.snr_gamma,
                **common,
            )
        return mean / num_units, {}

    def after_update(self, model) -> None:
        """EMA of the trained weights, after every applied update."""
        if self.ema is not None:
            self.ema.step([p for p in model.parameters() if p.requires_grad])

    def counts(self, batch: dict) -> dict[str, float]:
        return {"images": len(batch["index"])}

    def log_fields(self, interval: dict[str, float], elapsed: float, totals: dict[str, float]) -> dict:
        acc = self.accelerator
        images = interval.get("images", 0)  # this process's
        total = images
        if acc.num_processes > 1:  # sync point (log steps only): ranks' batches may differ by one image
            total = int(acc.reduce(torch.tensor(images, device=acc.device), reduction="sum").item())
        totals["num_images"] = totals.get("num_images", 0) + total
        return {
            "images_per_sec": images / elapsed,
            "images_per_sec_total": total / elapsed,
            "num_images": totals["num_images"],
        }

    # ------------------------------------------------------------------------------ validation

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """Generate the validation prompts' images (main process), save them under samples/step-N/,
        log them to the trackers.

        With EMA, the samples use the EMA weights (what the final save holds); the trained weights are
        put back afterwards.
        """
        from finetune.diffusion.sampling import generate, load_pipeline, save_samples

        acc, settings = self.accelerator, self.settings
        acc.wait_for_everyone()
        fields: dict[str, Any] = {"event": "samples"}
        if acc.is_main_process:
            from finetune.diffusion.text_encoder import split

            trained = acc.unwrap_model(model)
            params = [p for p in trained.parameters() if p.requires_grad]
            if self.ema is not None:
                self.ema.store(params)
                self.ema.copy_to(params)
            trained.eval()
            t0 = time.perf_counter()
            try:
                if self.pipeline is None:
                    unet, encoders = split(trained)
                    self.pipeline = load_pipeline(
                        self.info, dtype=self.weight_dtype, device=acc.device, unet=unet, **encoders
                    )
                with acc.autocast():
                    images = generate(
                        self.pipeline,
                        settings.validation_prompts,
                        num_images=settings.num_validation_images,
                        steps=settings.validation_inference_steps,
                        guidance_scale=settings.validation_guidance_scale,
                        resolution=settings.resolution,
                        seed=self.train.seed,
                        device=acc.device,
                        max_sequence_length=self.info.sequence_length(settings.max_sequence_length),
                    )
            finally:
                trained.train()
                if self.ema is not None:
                    self.ema.restore(params)
            folder = Path(self.train.output_dir) / "samples" / f"step-{step}"
            self.samples = save_samples(images, settings.validation_prompts, folder)
            fields.update(
                images=len(self.samples), folder=str(folder), seconds=round(time.perf_counter() - t0, 3)
            )
            trackers.log_images(acc, "validation", images, settings.validation_prompts, step)
        acc.wait_for_everyone()
        return fields

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """What trained (EMA weights when use_ema) and the card: pytorch_lora_weights.safetensors
        (diffusers' format, text-encoder LoRA included), the LoKr / LoHa folder `<denoiser>/` (PEFT's
        format), or for full fine-tuning the whole pipeline folder `pipeline/`."""
        from finetune.model_card import write_diffusion_model_card
        from finetune.recipe import recipe_to_dict

        acc, output_dir = self.accelerator, Path(self.train.output_dir)
        if not acc.is_main_process:
            return []
        trained = acc.unwrap_model(model)
        params = [p for p in trained.parameters() if p.requires_grad]
        if self.ema is not None:
            self.ema.copy_to(params)
        self._save_final(trained, output_dir)
        write_diffusion_model_card(
            output_dir,
            recipe=recipe_to_dict(self.recipe),
            manifest=self.manifest,
            metrics={"step": metrics["step"], "images_seen": metrics.get("num_images", 0)},
            extensions=metrics.get("extensions") or [],
            samples=[(prompt, path.relative_to(output_dir).as_posix()) for prompt, path in self.samples],
        )
        return [path for _, path in self.samples]

    def _save_final(self, trained, output_dir: Path) -> None:
        from finetune.diffusion.sampling import load_pipeline

        adapter, name = self.settings.adapter, self.info.denoiser_name
        if adapter != "full":
            self._write_trained(trained, output_dir)
            where = "pytorch_lora_weights.safetensors" if adapter == "lora" else f"{name}/ (PEFT format)"
            self.accelerator.print(f"{ADAPTER_NAMES[adapter]} weights saved: {output_dir / where}")
            return
        # The base pipeline's other components around the trained denoiser, saved as one folder.
        pipeline = load_pipeline(self.info, dtype=self.weight_dtype, device="cpu", unet=trained)
        pipeline.save_pretrained(str(output_dir / "pipeline"), safe_serialization=True)
        self.accelerator.print(f"pipeline with the trained {name} saved: {output_dir / 'pipeline'}")
