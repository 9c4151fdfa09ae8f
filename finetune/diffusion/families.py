"""Diffusion pipeline families in one table: what training needs to know about a family of diffusers
pipelines, asked by the code instead of testing the family's name where it is used.

Who asks what:

* detection (finetune.diffusion.model.pipeline_info): which model_index.json `_class_name` is which row;
* loading: the denoiser's component name and class, the VAE's class, the text encoders' and
  tokenizers' component names;
* the latent cache (finetune.diffusion.cache): the pixel multiple (VAE downsampling x the denoiser's
  patching), the longest side the denoiser's position embeddings cover, how captions are encoded
  (`encode`: the pipeline's own encode_prompt), whether a pooled embedding column is stored, how
  latents are normalised (`latent_norm`: the VAE's shift / scaling factors, or per-channel statistics);
* training (finetune.objectives.diffusion): epsilon / v-prediction or flow matching, which loss
  (finetune.diffusion.objective) and whether the transformer may take embedded guidance;
* the recipe check (settings_problems): the default text length (`sequence_length`; None: the family
  has no diffusion.max_sequence_length).

A new family is one row here (and its tiny pipeline in finetune.diffusion.tiny, its loss in
finetune.diffusion.objective where the forward differs): docs/CONTRIBUTING.md, "Add a diffusion family".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from finetune.diffusion import objective, prompts


def unet_factor(config: dict) -> int:
    """A UNet halves the latent once per down block but the last."""
    return 2 ** (len(config["down_block_types"]) - 1)


def patch_factor(config: dict) -> int:
    """SD3: the transformer's patch embedding (config.patch_size)."""
    return config["patch_size"]


def packed_2x2(config: dict) -> int:
    """Flux, Qwen-Image, Flux.2: the pipeline packs (or patchifies) 2x2 latent patches, whatever the
    transformer's own patch_size."""
    return 2


def vae_factor(config: dict) -> int:
    """AutoencoderKL and AutoencoderKLFlux2 halve the image once per encoder block but the last;
    AutoencoderKLQwenImage once per entry of `temperal_downsample` (its pipeline's vae_scale_factor)."""
    if "temperal_downsample" in config:
        return 2 ** len(config["temperal_downsample"])
    return 2 ** (len(config["block_out_channels"]) - 1)


def scalar_norm(vae: Any) -> dict:
    """SD, SDXL, SD3, Flux: latents = (z - shift_factor) * scaling_factor (no shift for SD / SDXL)."""
    return {
        "scaling_factor": vae.config.scaling_factor,
        "shift_factor": getattr(vae.config, "shift_factor", None),
    }


def channel_norm(vae: Any) -> dict:
    """Qwen-Image: latents = (z - latents_mean) / latents_std per channel, from the VAE's config (as
    QwenImagePipeline and train_dreambooth_lora_qwen_image.py normalise them)."""
    return {
        "scaling_factor": [1.0 / s for s in vae.config.latents_std],
        "shift_factor": list(vae.config.latents_mean),
    }


def batch_norm(vae: Any) -> dict:
    """Flux.2: the 2x2-patchified latents normalised by the VAE's BatchNorm running statistics,
    (z - running_mean) / sqrt(running_var + batch_norm_eps), as Flux2KleinPipeline does; the channels are
    the patchified ones (4 x latent_channels), applied by finetune.diffusion.objective.flux2_loss."""
    import torch

    std = torch.sqrt(vae.bn.running_var.float() + vae.config.batch_norm_eps)
    return {"scaling_factor": (1.0 / std).tolist(), "shift_factor": vae.bn.running_mean.float().tolist()}


@dataclass(frozen=True)
class DiffusionFamily:
    """One family of diffusers text-to-image pipelines: a row of `FAMILIES`."""

    name: str  # the short name recorded in caches and manifests ("sd", "flux", ...)
    label: str  # how messages name it
    pipeline: str  # model_index.json `_class_name` of its text-to-image pipeline
    example: str  # a Hub id of one, for messages
    denoiser_class: str  # the diffusers class of the trained model
    text_encoders: tuple[str, ...]  # pipeline component names, in the pipeline's order
    encode: Callable[..., dict]  # (tokenizers, encoders, prompts, max_sequence_length) -> embeddings
    denoiser_factor: Callable[[dict], int]  # latent side divisor from the denoiser's config
    loss: Callable[..., Any] | None = None  # flow-matching families: their loss (objective.py)
    denoiser: str = "transformer"  # its pipeline component name
    vae_class: str = "AutoencoderKL"
    latent_norm: Callable[[Any], dict] = scalar_norm
    pooled: bool = False  # the cache stores pooled_prompt_embeds (and the loader SDXL's time ids)
    sequence_length: int | None = None  # default diffusion.max_sequence_length; None: not applicable
    guidance: bool = False  # its transformer may be guidance-distilled (config.guidance_embeds)
    video_vae: bool = False  # the VAE takes (batch, channels, frames, height, width): one frame
    max_side_config: str | None = None  # denoiser config field: position-embedding grid side in patches
    load_kwargs: dict = field(default_factory=dict)  # from_pretrained arguments of the sampling pipeline

    @property
    def flow_matching(self) -> bool:
        return self.loss is not None

    @property
    def tokenizers(self) -> tuple[str, ...]:
        return tuple(name.replace("text_encoder", "tokenizer") for name in self.text_encoders)


FAMILIES: tuple[DiffusionFamily, ...] = (
    DiffusionFamily(
        name="sd",
        label="SD 1.x/2.x",
        pipeline="StableDiffusionPipeline",
        example="stable-diffusion-v1-5/stable-diffusion-v1-5",
        denoiser="unet",
        denoiser_class="UNet2DConditionModel",
        text_encoders=("text_encoder",),
        encode=prompts.encode_clip,
        denoiser_factor=unet_factor,
        load_kwargs={
            "safety_checker": None,
            "requires_safety_checker": False,
        },  # training samples: no checker
    ),
    DiffusionFamily(
        name="sdxl",
        label="SDXL",
        pipeline="StableDiffusionXLPipeline",
        example="stabilityai/stable-diffusion-xl-base-1.0",
        denoiser="unet",
        denoiser_class="UNet2DConditionModel",
        text_encoders=("text_encoder", "text_encoder_2"),
        encode=prompts.encode_clip,
        denoiser_factor=unet_factor,
        pooled=True,
    ),
    DiffusionFamily(
        name="sd3",
        label="SD3",
        pipeline="StableDiffusion3Pipeline",
        example="stabilityai/stable-diffusion-3-medium-diffusers",
        denoiser_class="SD3Transformer2DModel",
        text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
        encode=prompts.encode_sd3,
        denoiser_factor=patch_factor,
        loss=objective.flow_matching_loss,
        pooled=True,
        sequence_length=256,
        max_side_config="pos_embed_max_size",
    ),
    DiffusionFamily(
        name="flux",
        label="Flux",
        pipeline="FluxPipeline",
        example="black-forest-labs/FLUX.1-dev",
        denoiser_class="FluxTransformer2DModel",
        text_encoders=("text_encoder", "text_encoder_2"),
        encode=prompts.encode_flux,
        denoiser_factor=packed_2x2,
        loss=objective.flux_loss,
        pooled=True,
        sequence_length=512,
        guidance=True,
    ),
    DiffusionFamily(
        name="qwenimage",
        label="Qwen-Image",
        pipeline="QwenImagePipeline",
        example="Qwen/Qwen-Image",
        denoiser_class="QwenImageTransformer2DModel",
        text_encoders=("text_encoder",),
        encode=prompts.encode_qwenimage,
        denoiser_factor=packed_2x2,
        loss=objective.qwenimage_loss,
        vae_class="AutoencoderKLQwenImage",
        latent_norm=channel_norm,
        sequence_length=512,  # QwenImagePipeline.__call__'s default
        video_vae=True,
    ),
    DiffusionFamily(
        name="flux2",
        label="Flux.2 [klein]",
        pipeline="Flux2KleinPipeline",
        example="black-forest-labs/FLUX.2-klein-4B",
        denoiser_class="Flux2Transformer2DModel",
        text_encoders=("text_encoder",),
        encode=prompts.encode_flux2,
        denoiser_factor=packed_2x2,
        loss=objective.flux2_loss,
        vae_class="AutoencoderKLFlux2",
        latent_norm=batch_norm,
        sequence_length=512,
        guidance=True,
    ),
)

BY_PIPELINE = {family.pipeline: family for family in FAMILIES}
BY_NAME = {family.name: family for family in FAMILIES}


def supported() -> str:
    """The supported pipelines, for messages."""
    names = [f"{f.pipeline} ({f.label})" for f in FAMILIES]
    return ", ".join(names[:-1]) + " and " + names[-1]


def family_named(name: str) -> DiffusionFamily:
    return BY_NAME[name]
