"""Diffusion families on their tiny pipelines (CPU): LoRA training step time and LoRA file size.

For each flow-matching family (SD3, Flux, Qwen-Image, Flux.2 [klein]): the tiny pipeline of
finetune.diffusion.tiny, 8 solid-colour 32 px images prepared into the latent cache
(finetune.diffusion.cache.prepare_images), LoRA rank 4 on the default targets, fp32, micro batch 2;
times `steps` optimizer steps of the family's loss (its row's `loss`, as training calls it) after 2
warm-up steps and reports the median, then writes the LoRA with `save_lora` and reports its size.

    python benchmarks/bench_diffusion_families.py [--steps 10] [--families sd3,flux,qwenimage,flux2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(family: str, steps: int, root: Path) -> dict:
    from finetune.diffusion.cache import prepare_images
    from finetune.diffusion.loader import make_loader
    from finetune.diffusion.model import (
        guidance_embeds,
        load_denoiser,
        load_noise_scheduler,
        pipeline_info,
        save_lora,
    )
    from finetune.diffusion.tiny import build_tiny_pipeline
    from tests.diffusion_data import validated_recipe, with_default_lora, write_color_folder

    pipeline = build_tiny_pipeline(root / f"tiny-{family}", **{family: True})
    write_color_folder(root / "imgs")
    recipe = validated_recipe(root / family, pipeline, root / "imgs", max_sequence_length=24)
    prepared = prepare_images(recipe, log=lambda _: None)
    info = pipeline_info(str(pipeline))
    transformer = with_default_lora(load_denoiser(info, torch.float32)).train()
    scheduler = load_noise_scheduler(info, None)
    latents = prepared.manifest["latents"]
    factors = {
        "scaling_factor": latents["scaling_factor"],
        "shift_factor": latents.get("shift_factor") or 0.0,
    }
    if info.spec.guidance:  # Flux, Flux.2: embedded guidance where the transformer has it
        factors["guidance_scale"] = 3.5 if guidance_embeds(info) else None
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    loader = make_loader(prepared.train, batch_size=2, seed=0, drop_last=False)
    times = []
    torch.manual_seed(0)
    while len(times) < steps + 2:
        for batch in loader:
            t0 = time.perf_counter()
            loss = info.spec.loss(transformer, scheduler, batch, weighting_scheme="logit_normal", **factors)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
            if len(times) == steps + 2:
                break
    out = root / f"lora-{family}"
    save_lora(info, transformer, out)
    size = (out / "pytorch_lora_weights.safetensors").stat().st_size
    return {
        "family": family,
        "pipeline": info.class_name,
        "denoiser_params": sum(p.numel() for p in transformer.parameters()),
        "lora_params": sum(p.numel() for p in params),
        "step_ms": 1000 * statistics.median(times[2:]),
        "lora_bytes": size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--families", default="sd3,flux,qwenimage,flux2")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print(
        "| family | pipeline | transformer parameters | LoRA parameters | step (ms, median) | LoRA file (bytes) |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            r = measure(family, args.steps, Path(tmp) / family)
            print(
                f"| {r['family']} | {r['pipeline']} | {r['denoiser_params']:,} | {r['lora_params']:,} | "
                f"{r['step_ms']:.1f} | {r['lora_bytes']:,} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
