"""Tiny random Stable Diffusion pipelines built from configs (nothing downloaded).

For tests, the CPU demo recipe and benchmarks: `build_tiny_pipeline(folder)` writes a diffusers
folder that `StableDiffusionPipeline.from_pretrained(folder)` loads, with a byte-level CLIP
tokenizer made here (every byte is a token; no merges), so it runs offline. The SD3 and Flux
layouts also need a T5 tokenizer: a character-level Unigram vocabulary made here (`t5_tokenizer`);
the Qwen-Image and Flux.2 [klein] layouts a byte-level Qwen2 tokenizer with the chat markup tokens
(`qwen_tokenizer`).

    python -m finetune.diffusion.tiny outputs/tiny-sd            # SD 1.x layout
    python -m finetune.diffusion.tiny outputs/tiny-sdxl --sdxl   # SDXL layout (two text encoders)
    python -m finetune.diffusion.tiny outputs/tiny-sd3 --sd3     # SD3 layout (transformer, CLIP x2 + T5)
    python -m finetune.diffusion.tiny outputs/tiny-flux --flux   # Flux layout (transformer, CLIP + T5)
    python -m finetune.diffusion.tiny outputs/tiny-qwen --qwenimage  # Qwen-Image (Qwen2.5-VL, video VAE)
    python -m finetune.diffusion.tiny outputs/tiny-flux2 --flux2 # Flux.2 [klein] layout (Qwen3)
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


def t5_tokenizer():
    """A T5 tokenizer (Unigram, as T5's sentencepiece model) over printable ASCII characters.

    Ids 0-2 are <pad>, </s>, <unk> as in T5; every other piece is one character (or a word start
    marker), so any ASCII caption tokenizes without a download.
    """
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(c), -3.0) for c in range(ord("!"), ord("~") + 1)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def build_tiny_pipeline(
    folder: str | Path,
    *,
    sdxl: bool = False,
    sd3: bool = False,
    flux: bool = False,
    qwenimage: bool = False,
    flux2: bool = False,
    seed: int = 0,
    max_length: int = 16,
) -> Path:
    """Save a tiny random SD (or SDXL, SD3, Flux) pipeline to `folder`: 32-channel UNet and VAE (2 blocks each).

    Pixel sides must be multiples of 4 (VAE /2, UNet /2; SD3: VAE /2, patch 2; Flux: VAE /2, 2x2
    packing); 32-64 px images keep a training step in the tens of milliseconds on a CPU.
    """
    if sdxl + sd3 + flux + qwenimage + flux2 > 1:
        raise ValueError("build_tiny_pipeline: choose one of sdxl, sd3, flux, qwenimage and flux2")
    from diffusers import (
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
    vae = _tiny_vae(latent_channels=4)
    scheduler = DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        clip_sample=False,
    )
    if qwenimage:
        pipe = _tiny_qwenimage(seed)
    elif flux2:
        pipe = _tiny_flux2(seed)
    elif sd3:
        pipe = _tiny_sd3(text_config, tokenizer, seed)
    elif flux:
        pipe = _tiny_flux(text_config, tokenizer, seed)
    elif sdxl:
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


def _tiny_sd3(text_config, clip_tokenizer, seed: int):
    """StableDiffusion3Pipeline: 2-layer SD3Transformer2DModel, a 16-channel VAE with SD3's shift
    and scaling factors, two projected CLIP encoders and a 2-layer T5 (SD3 medium's layout)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer_3 = t5_tokenizer()
    t5 = _t5_config(tokenizer_3)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,  # T5 width; the two CLIPs' 16 + 16 are zero-padded to it
        caption_projection_dim=32,  # = heads x head dim
        pooled_projection_dim=32,  # the two CLIPs' pooled projections, 16 + 16
        pos_embed_max_size=32,  # latents up to 64 x 64 (128 px)
    )
    vae = _tiny_vae(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609)  # SD3's factors
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=CLIPTextModelWithProjection(text_config(16)),
        tokenizer=clip_tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(text_config(16)),
        tokenizer_2=clip_tokenizer,
        text_encoder_3=T5EncoderModel(t5),
        tokenizer_3=tokenizer_3,
    )


def _tiny_vae(
    *, latent_channels: int, scaling_factor: float | None = None, shift_factor: float | None = None
):
    """A 2-block AutoencoderKL (spatial factor 2). With `shift_factor` (SD3, Flux: latents =
    (z - shift_factor) * scaling_factor) it has no quant convs, as those VAEs have none."""
    from diffusers import AutoencoderKL

    factors = {}
    if shift_factor is not None:
        factors = {
            "scaling_factor": scaling_factor,
            "shift_factor": shift_factor,
            "use_quant_conv": False,
            "use_post_quant_conv": False,
        }
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=32,
        **factors,
    )


def _t5_config(tokenizer):
    """A 2-layer, 32-wide T5 encoder over `tokenizer`'s vocabulary."""
    from transformers import T5Config

    return T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _tiny_flux(text_config, clip_tokenizer, seed: int):
    """FluxPipeline: a FluxTransformer2DModel with one double- and one single-stream block and
    guidance embeddings (FLUX.1-dev's layout), a 16-channel VAE with Flux's shift and scaling
    factors, a CLIP text encoder (pooled output) and a 2-layer T5; FLUX.1-dev's scheduler config
    (dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer_2 = t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels x a 2x2 patch (FluxPipeline._pack_latents)
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5 width
        pooled_projection_dim=32,  # CLIP width
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),  # sums to attention_head_dim
    )
    vae = _tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)  # Flux's factors
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=CLIPTextModel(text_config(32)),
        tokenizer=clip_tokenizer,
        text_encoder_2=T5EncoderModel(_t5_config(tokenizer_2)),
        tokenizer_2=tokenizer_2,
    )


_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's chat markup (Flux2KleinPipeline applies the tokenizer's chat template to each caption).
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer (every byte a token, no merges) with Qwen's chat markup tokens and a
    chat template, so captions tokenize as Qwen-Image's and Flux.2's pipelines format them, offline.

    The words of QwenImagePipeline's prompt template are tokens of their own (as in Qwen's BPE), so
    the template's prefix is the `prompt_template_encode_start_idx` (34) tokens that the pipeline
    drops: the cached embeddings are then the caption's, as with the real tokenizer.
    """
    import re

    from diffusers import QwenImagePipeline
    from transformers import AddedToken, Qwen2TokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(_bytes_to_unicode().values()))}
    for token in _QWEN_SPECIALS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2TokenizerFast(
        vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": _QWEN_SPECIALS})
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    template = QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
    )
    prefix = template.prompt_template_encode.split("{}")[0]
    words = re.findall(
        r" ?[^\s,:<>|]+|[,:]", prefix.replace("<|im_start|>", "\n").replace("<|im_end|>", "\n")
    )
    words.append("assistant")  # the suffix's role, one token as in Qwen's vocabulary
    tokenizer.add_tokens([AddedToken(w, normalized=False) for w in dict.fromkeys(words)])
    if len(tokenizer(prefix).input_ids) != template.prompt_template_encode_start_idx:
        raise AssertionError(
            f"the tiny Qwen tokenizer makes {len(tokenizer(prefix).input_ids)} tokens of QwenImagePipeline's "
            f"template prefix, not {template.prompt_template_encode_start_idx}"
        )
    return tokenizer


def _tiny_qwenimage(seed: int):
    """QwenImagePipeline: a 2-layer QwenImageTransformer2DModel, a 2-block AutoencoderKLQwenImage (a
    video VAE, spatial factor 2, 4 latent channels with per-channel latents_mean / latents_std that are
    not the identity, so the normalisation is exercised) and a 2-layer Qwen2.5-VL text encoder (16 wide,
    a 2-layer vision tower it never uses); Qwen-Image's scheduler config (dynamic shifting)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 latent channels x a 2x2 patch (QwenImagePipeline._pack_latents)
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,  # the text encoder's width
        axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],  # one spatial halving
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    text = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": len(tokenizer),
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1000000.0},
    }
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=len(tokenizer))
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler_config.json
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval(),
        tokenizer=tokenizer,
    )


def _tiny_flux2(seed: int):
    """Flux2KleinPipeline: a Flux2Transformer2DModel with one double- and one single-stream block and no
    guidance embeddings (FLUX.2 [klein]'s layout), a 2-block AutoencoderKLFlux2 (spatial factor 2, 4
    latent channels; BatchNorm statistics over the 16 patchified channels set away from the identity,
    so the normalisation is exercised) and a 27-layer, 16-wide Qwen3 text encoder (the pipeline stacks
    the hidden states of layers 9, 18 and 27)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels x a 2x2 patch (Flux2KleinPipeline._patchify_latents)
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # 3 stacked Qwen3 layers x 16
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
        guidance_embeds=False,
    )
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    generator = torch.Generator().manual_seed(seed)
    vae.bn.running_mean.copy_(0.2 * torch.randn(16, generator=generator))
    vae.bn.running_var.copy_(0.5 + torch.rand(16, generator=generator))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=27,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2 [klein]'s scheduler config (dynamic shifting)
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return Flux2KleinPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=Qwen3ForCausalLM(config).eval(),
        tokenizer=tokenizer,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random Stable Diffusion pipeline folder.")
    parser.add_argument("folder")
    parser.add_argument("--sdxl", action="store_true", help="SDXL layout (two text encoders)")
    parser.add_argument("--sd3", action="store_true", help="SD3 layout (transformer, CLIP x2 + T5)")
    parser.add_argument("--flux", action="store_true", help="Flux layout (transformer, CLIP + T5)")
    parser.add_argument("--qwenimage", action="store_true", help="Qwen-Image layout (Qwen2.5-VL, video VAE)")
    parser.add_argument("--flux2", action="store_true", help="Flux.2 [klein] layout (Qwen3 text encoder)")
    args = parser.parse_args(argv)
    print(
        build_tiny_pipeline(
            args.folder,
            sdxl=args.sdxl,
            sd3=args.sd3,
            flux=args.flux,
            qwenimage=args.qwenimage,
            flux2=args.flux2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
