"""Images from the pipeline: validation samples during training, and missing DreamBooth class images."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock

from finetune.diffusion.model import PipelineInfo
from finetune.diffusion.sources import list_images

if TYPE_CHECKING:
    from finetune.recipe import DiffusionSection


def load_pipeline(info: PipelineInfo, *, dtype: torch.dtype, device, unet=None, **components: Any):
    """The full pipeline for sampling, optionally around the denoiser being trained (LoRA active) and
    other trained components by their pipeline name (`text_encoder=...`)."""
    kwargs: dict[str, Any] = {"revision": info.revision, "dtype": dtype, **components}
    if unet is not None:
        kwargs[info.denoiser_name] = unet
    if info.vae_path:
        from diffusers import AutoencoderKL

        kwargs["vae"] = AutoencoderKL.from_pretrained(info.vae_path, dtype=dtype)
    kwargs.update(info.spec.load_kwargs)
    pipeline = info.pipeline_class.from_pretrained(info.path, **kwargs)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline.to(device)


def generate(
    pipeline,
    prompts: list[str],
    *,
    num_images: int,
    steps: int,
    guidance_scale: float,
    resolution: int,
    seed: int,
    device,
    max_sequence_length: int | None = None,
) -> list[list[Any]]:
    """`num_images` PIL images per prompt, seeded per (seed, prompt, image): the same every run.

    `max_sequence_length`: SD3's or Flux's T5 length (the one training cached); None for SD / SDXL.

    The global RNG is left untouched (forked), so sampling in the middle of training does not change
    the noise drawn by the next training steps, and a resumed run stays identical.
    """
    devices = [device] if torch.device(device).type == "cuda" else []
    extra = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    out = []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for p, prompt in enumerate(prompts):
            generators = [
                torch.Generator(device=device).manual_seed(seed * 1_000_003 + p * 1009 + i)
                for i in range(num_images)
            ]
            result = pipeline(
                prompt=[prompt] * num_images,  # by name: Flux2KleinPipeline's first argument is `image`
                num_inference_steps=steps,
                guidance_scale=guidance_scale,
                height=resolution,
                width=resolution,
                generator=generators,
                **extra,
            )
            out.append(result.images)
    return out


def save_samples(images: list[list[Any]], prompts: list[str], folder: Path) -> list[tuple[str, Path]]:
    """PNG files `<prompt index>-<image index>-<slug>.png`; returns (prompt, path) pairs."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = []
    for p, (prompt, row) in enumerate(zip(prompts, images, strict=True)):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", prompt).strip("-")[:40] or "prompt"
        for i, image in enumerate(row):
            path = folder / f"{p:02d}-{i:02d}-{slug}.png"
            image.save(path)
            saved.append((prompt, path))
    return saved


def ensure_class_images(
    settings: DiffusionSection, info: PipelineInfo, *, seed: int, device, log: Callable[[str], None] = print
) -> int:
    """Generate class images until diffusion.class_data_dir holds num_class_images; returns how many.

    Generated with the base pipeline and class_prompt (as diffusers' DreamBooth does), seeded per
    image from `seed` (train.seed), saved as PNG. A lock keeps two processes from generating the same
    files.
    """
    folder = Path(settings.class_data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.parent / f".{folder.name}.generate.lock"):
        have = len(list_images(folder))
        missing = settings.num_class_images - have
        if missing <= 0:
            return 0
        log(f"generating {missing} class images for {settings.class_prompt!r} in {folder} (have {have})")
        dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
        pipeline = load_pipeline(info, dtype=dtype, device=device)
        batch = settings.encode_batch_size
        made = 0
        while made < missing:
            count = min(batch, missing - made)
            images = generate(
                pipeline,
                [settings.class_prompt],
                num_images=count,
                steps=settings.class_generation_steps,
                guidance_scale=settings.validation_guidance_scale,
                resolution=settings.resolution,
                seed=seed + have + made,
                device=device,
                max_sequence_length=info.sequence_length(settings.max_sequence_length),
            )[0]
            for image in images:
                path, suffix = folder / f"class-{have + made:05d}.png", 0
                while path.exists():  # a user's file of that name is kept
                    suffix += 1
                    path = folder / f"class-{have + made:05d}-{suffix}.png"
                image.save(path)
                made += 1
        del pipeline
        return made
