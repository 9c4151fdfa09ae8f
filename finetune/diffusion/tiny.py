"""Tiny random Stable Diffusion pipelines built from configs (nothing downloaded).

For tests, the CPU demo recipe and benchmarks: `build_tiny_pipeline(folder)` writes a diffusers
folder that `StableDiffusionPipeline.from_pretrained(folder)` loads, with a byte-level CLIP
tokenizer made here (every byte is a token; no merges), so it runs offline.

    python -m finetune.diffusion.tiny outputs/tiny-sd            # SD 1.x layout
    python -m finetune.diffusion.tiny outputs/tiny-sdxl --sdxl   # SDXL layout (two text encoders)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

_SPECIALS = ["<|startoftext|>", "<|endoftext|>"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def write_clip_tokenizer(folder: str | Path, *, max_length: int = 16) -> int:
    """A byte-level CLIP tokenizer (vocab.json, merges.txt, tokenizer_config.json); returns its size."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    symbols = sorted(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + _SPECIALS
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": max_length,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return len(tokens)


def build_tiny_pipeline(
    folder: str | Path, *, sdxl: bool = False, seed: int = 0, max_length: int = 16
) -> Path:
    """Save a tiny random SD (or SDXL) pipeline to `folder`: 32-channel UNet and VAE (2 blocks each).

    Pixel sides must be multiples of 4 (VAE /2, UNet /2); 32-64 px images keep a training step in
    the tens of milliseconds on a CPU.
    """
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    folder = Path(folder)
    torch.manual_seed(seed)
    scratch = folder.parent / f".{folder.name}-tokenizer"
    vocab_size = write_clip_tokenizer(scratch, max_length=max_length)
    tokenizer = AutoTokenizer.from_pretrained(scratch)

    def text_config(hidden: int) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=max_length,
            projection_dim=hidden,
            bos_token_id=vocab_size - 2,
            eos_token_id=vocab_size - 1,
            pad_token_id=vocab_size - 1,
            hidden_act="gelu",
        )

    unet_kwargs = dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=32,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=32,
    )
    scheduler = DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        clip_sample=False,
    )
    if sdxl:
        unet = UNet2DConditionModel(
            **unet_kwargs,
            cross_attention_dim=64,  # 32 + 32: both encoders' hidden states concatenated
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=32 + 6 * 8,  # pooled text + 6 time ids x 8
            transformer_layers_per_block=1,
        )
        pipe = StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=CLIPTextModel(text_config(32)),
            text_encoder_2=CLIPTextModelWithProjection(text_config(32)),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=unet,
            scheduler=scheduler,
        )
    else:
        unet = UNet2DConditionModel(**unet_kwargs, cross_attention_dim=32)
        pipe = StableDiffusionPipeline(
            vae=vae,
            text_encoder=CLIPTextModel(text_config(32)),
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(folder)
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random Stable Diffusion pipeline folder.")
    parser.add_argument("folder")
    parser.add_argument("--sdxl", action="store_true", help="SDXL layout (two text encoders)")
    args = parser.parse_args(argv)
    print(build_tiny_pipeline(args.folder, sdxl=args.sdxl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
