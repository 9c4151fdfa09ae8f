"""Diffusion LoRA benchmarks.

CPU (default): time per epoch training on cached latents and text embeddings (what `finetune`
does) vs encoding every step (decode + resize + crop, VAE and text encoder inside the loop), same
tiny random SD pipeline, same images, same LoRA and steps; prints the ratio.

    python benchmarks/bench_diffusion.py                     # CPU, tiny pipeline, 64 px
    python benchmarks/bench_diffusion.py --gpu               # GPU only: SD-1.5-sized UNet LoRA at 512 px

`--gpu` builds an SD 1.5-sized UNet from its config (random weights, nothing downloaded) and
reports training images/s (bf16 autocast, LoRA rank 4 on the attention projections, batch 4,
latents as the cache serves them). It needs CUDA and refuses to run without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _images(folder: Path, count: int) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        size = [(96, 96), (128, 64), (64, 128)][i % 3]
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(
            folder / f"{i:03d}.png"
        )
        (folder / f"{i:03d}.txt").write_text(f"a photo of thing number {i}")


def _recipe(tmp: Path, pipeline: Path, images: Path, resolution: int, batch: int):
    from finetune.recipe import validate_recipe

    return validate_recipe(
        {
            "model": {"kind": "diffusion", "model_path": str(pipeline)},
            "data": {
                "datasets": [{"path": str(images), "type": "images"}],
                "dataset_prepared_path": str(tmp / "prepared"),
                "dataloader_num_workers": 0,
                "dataloader_prefetch_factor": None,
                "dataloader_drop_last": False,
            },
            "train": {"output_dir": str(tmp / "out"), "micro_batch_size": batch, "mixed_precision": "no"},
            "lora": {"lora_rank": 4, "lora_alpha": 4},
            "diffusion": {"resolution": resolution, "center_crop": True},
        }
    )


def bench_cpu(args) -> None:
    from finetune.diffusion import images as img
    from finetune.diffusion.cache import prepare_images
    from finetune.diffusion.loader import make_loader
    from finetune.diffusion.model import (
        add_lora,
        encode_pixels,
        encode_prompts,
        load_noise_scheduler,
        load_text_encoders,
        load_unet,
        load_vae,
        pipeline_info,
    )
    from finetune.diffusion.objective import diffusion_loss
    from finetune.diffusion.tiny import build_tiny_pipeline

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench-diffusion-"))
    pipeline = build_tiny_pipeline(tmp / "tiny-sd", max_length=77)
    _images(tmp / "images", args.images)
    recipe = _recipe(tmp, pipeline, tmp / "images", args.resolution, args.batch)
    t0 = time.perf_counter()
    prepared = prepare_images(recipe, log=lambda _: None, device="cpu")
    prepare_seconds = time.perf_counter() - t0
    info = pipeline_info(str(pipeline))
    vae = load_vae(info)
    tokenizers, encoders = load_text_encoders(info)
    scheduler = load_noise_scheduler(info, None)
    scaling = vae.config.scaling_factor
    records = {int(r["index"]): r for r in prepared.train.select_columns(["index", "caption", "key"])}
    paths = {i: tmp / "images" / r["key"] for i, r in records.items()}
    buckets = [tuple(b) for b in prepared.manifest["bucket_sizes"]]

    def train_epoch(encode_each_step: bool) -> float:
        torch.manual_seed(0)
        unet = load_unet(info, torch.float32)
        add_lora(
            unet,
            rank=4,
            alpha=4,
            dropout=0.0,
            targets=recipe.lora.lora_target_modules,
            gradient_checkpointing=False,
        )
        optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-4)
        loader = make_loader(prepared.train, batch_size=args.batch, seed=0, drop_last=False)
        start = time.perf_counter()
        for batch in loader:
            if encode_each_step:  # what a loop without the cache does: decode, crop, VAE, text encoder
                pixels, captions = [], []
                for index in batch["index"].tolist():
                    image = img.load_image(paths[index])
                    h, w = batch["latent_mean"].shape[-2:]
                    factor = 2  # the tiny VAE downsamples by 2
                    bucket = (h * factor, w * factor)
                    assert bucket in buckets
                    pixels.append(img.to_pixels(img.resize_and_crop(image, bucket, center=True)[0]))
                    captions.append(records[index]["caption"])
                mean, std = encode_pixels(vae, torch.from_numpy(np.stack(pixels)))
                embeds = encode_prompts(tokenizers, encoders, captions, "sd")
                batch = {
                    **batch,
                    "latent_mean": mean,
                    "latent_std": std,
                    "prompt_embeds": embeds["prompt_embeds"],
                }
            loss = diffusion_loss(unet, scheduler, batch, scaling_factor=scaling)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    train_epoch(False)  # warm-up (allocator, kernels)
    train_epoch(True)
    cached, uncached = [], []
    for _ in range(args.repeats):  # interleaved, so load changes on a shared machine hit both alike
        cached.append(train_epoch(False))
        uncached.append(train_epoch(True))
    c, u = statistics.median(cached), statistics.median(uncached)
    print(f"command: python benchmarks/bench_diffusion.py {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"tiny SD pipeline (UNet and VAE 32/64 channels, CLIP 2 layers, 77 tokens), {len(prepared.train)} images, "
        f"{args.resolution} px, buckets {prepared.manifest['buckets']}, batch {args.batch}, "
        f"{torch.get_num_threads()} CPU threads, median of {args.repeats}"
    )
    print("| loop | seconds / epoch | images / s |")
    print("|---|---|---|")
    n = len(prepared.train)
    print(f"| cached latents + text embeddings | {c:.3f} | {n / c:.1f} |")
    print(f"| VAE + text encoder every step | {u:.3f} | {n / u:.1f} |")
    print(
        f"ratio (encode every step / cached): {u / c:.2f}x; one-time prepare (encode + save): {prepare_seconds:.2f} s"
    )


def bench_gpu(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU")
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from finetune.diffusion.model import add_lora
    from finetune.diffusion.objective import diffusion_loss

    torch.manual_seed(0)
    unet = UNet2DConditionModel(  # the SD 1.5 UNet configuration, random weights
        sample_size=64,
        cross_attention_dim=768,
        block_out_channels=(320, 640, 1280, 1280),
        attention_head_dim=8,
        layers_per_block=2,
    )
    unet = unet.to("cuda", torch.bfloat16)
    add_lora(
        unet,
        rank=4,
        alpha=4,
        dropout=0.0,
        targets=["to_k", "to_q", "to_v", "to_out.0"],
        gradient_checkpointing=False,
    )
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-4, fused=True)
    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    b = args.batch
    batch = {
        "latent_mean": torch.randn(b, 4, 64, 64, device="cuda"),
        "latent_std": torch.rand(b, 4, 64, 64, device="cuda") * 0.1,
        "prompt_embeds": torch.randn(b, 77, 768, device="cuda"),
        "is_prior": torch.zeros(b, dtype=torch.bool, device="cuda"),
    }

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = diffusion_loss(unet, scheduler, batch, scaling_factor=0.18215, model_dtype=torch.bfloat16)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.gpu_steps):
        step()
    torch.cuda.synchronize()  # sync point: the timing needs the kernels finished
    seconds = time.perf_counter() - start
    print(f"command: python benchmarks/bench_diffusion.py {' '.join(sys.argv[1:])}")
    print(
        f"SD-1.5-sized UNet LoRA (r=4, attention), 512 px (64x64 latents), batch {b}, bf16 autocast, "
        f"{torch.cuda.get_device_name()}: {args.gpu_steps * b / seconds:.1f} images/s, "
        f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="SD-1.5-sized UNet images/s at 512 px (CUDA only)")
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--gpu-steps", type=int, default=20)
    args = parser.parse_args()
    bench_gpu(args) if args.gpu else bench_cpu(args)


if __name__ == "__main__":
    main()
