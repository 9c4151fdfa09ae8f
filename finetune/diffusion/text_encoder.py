"""LoRA on a pipeline's CLIP text encoder(s), trained with the denoiser (diffusion.train_text_encoder).

As diffusers' train_dreambooth_lora.py, train_dreambooth_lora_sdxl.py and train_dreambooth_lora_flux.py
do with --train_text_encoder: LoRA on the attention projections (q, k, v, out) of SD's text encoder,
both SDXL encoders, and Flux's CLIP encoder only (its T5 stays frozen). The CLIP embeddings then change
with every update and are computed at every step from the caption; the cached latents (and Flux's
cached T5 embeddings, which a frozen T5 keeps) are still read from the prepared dataset.

The denoiser and the trained encoders are one module for the engine (`WithTextEncoders`): its
optimizer, accelerate's prepare and the checkpoints see every trained parameter, and calling it calls
the denoiser, so the loss functions of finetune.diffusion.objective are unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from finetune.errors import FinetuneError

# The modules diffusers' DreamBooth LoRA scripts adapt in a CLIP text encoder.
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
# Families whose CLIP encoders train, and which of the pipeline's encoders those are.
TRAINED_ENCODERS = {
    "sd": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
    "flux": ("text_encoder",),
}


class WithTextEncoders(torch.nn.Module):
    """The denoiser plus the text encoders that train with it; calling it calls the denoiser."""

    def __init__(self, denoiser: torch.nn.Module, encoders: dict[str, torch.nn.Module]):
        super().__init__()
        self.denoiser = denoiser
        self.text_encoders = torch.nn.ModuleDict(encoders)

    def forward(self, *args: Any, **kwargs: Any):
        return self.denoiser(*args, **kwargs)


def split(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """(denoiser, {pipeline name: trained text encoder}) of an unwrapped training model."""
    if isinstance(model, WithTextEncoders):
        return model.denoiser, dict(model.text_encoders)
    return model, {}


def trained_encoder_names(family: str, class_name: str) -> tuple[str, ...]:
    """The pipeline's text encoders that diffusion.train_text_encoder adapts; a clear error for SD3."""
    if family not in TRAINED_ENCODERS:
        raise FinetuneError(
            f"diffusion.train_text_encoder: not supported for {class_name} (text-encoder LoRA is trained for "
            "SD 1.x/2.x, SDXL and Flux, as diffusers' DreamBooth LoRA scripts do): set it false"
        )
    return TRAINED_ENCODERS[family]


def add_text_encoder_lora(encoder: torch.nn.Module, *, rank: int, alpha: float, dropout: float) -> int:
    """Freeze `encoder` and add LoRA (transformers' PEFT integration) on its attention projections, in
    fp32; returns the number of trainable parameters. Gaussian init as the diffusers scripts: B = 0, so
    the encoder starts unchanged."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig, inject_adapter_in_model

    encoder.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=TEXT_ENCODER_TARGETS,
    )
    # PEFT's own injection: transformers' `add_adapter` (what the diffusers scripts call) refuses PEFT
    # below 0.22, which transformers 5 asks for but PyPI does not have yet; it injects the same layers.
    inject_adapter_in_model(config, encoder, adapter_name="default")
    cast_training_params(encoder, dtype=torch.float32)
    encoder.train()
    return sum(p.numel() for p in encoder.parameters() if p.requires_grad)


def text_encoder_lora_layers(encoders: dict[str, torch.nn.Module], family: str) -> dict[str, Any]:
    """`save_lora_weights` keyword arguments for the trained encoders: `<name>_lora_layers` and
    `<name>_lora_adapter_metadata`. SD and SDXL in diffusers' naming, Flux in PEFT's, as each diffusers
    script writes them."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    out: dict[str, Any] = {}
    for name, encoder in encoders.items():
        state = get_peft_model_state_dict(encoder)
        out[f"{name}_lora_layers"] = state if family == "flux" else convert_state_dict_to_diffusers(state)
        out[f"{name}_lora_adapter_metadata"] = encoder.peft_config["default"].to_dict()
    return out


def load_text_encoder_lora(encoders: dict[str, torch.nn.Module], folder: str | Path) -> None:
    """Load the `<name>.*` weights of folder/pytorch_lora_weights.safetensors into encoders that have the
    same adapter (resume)."""
    from diffusers.utils import convert_state_dict_to_peft
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / "pytorch_lora_weights.safetensors"
    saved = load_file(str(path))
    for name, encoder in encoders.items():
        state = {k.removeprefix(f"{name}."): v for k, v in saved.items() if k.startswith(f"{name}.")}
        if not state:
            raise FinetuneError(
                f"{path} holds no {name}.* LoRA weights: it was not trained with train_text_encoder"
            )
        if not any(".lora_A." in k for k in state):  # diffusers' naming (SD, SDXL) -> PEFT's
            state = convert_state_dict_to_peft(state)
        result = set_peft_model_state_dict(encoder, state, adapter_name="default")
        if getattr(result, "unexpected_keys", None):
            raise FinetuneError(
                f"{path}: {name} LoRA does not match the adapter: {result.unexpected_keys[:5]}"
            )


def trainable_embeds(
    family: str, tokenizers: list, encoders: list, captions: list[str], batch: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The CLIP embeddings of `captions` through the trained encoders, with gradients, as the
    pipeline's own encode_prompt computes them (the same as the cache's at LoRA init).

    sd: `prompt_embeds`; sdxl: `prompt_embeds` and `pooled_prompt_embeds`; flux: CLIP's pooled output
    only, the T5 `prompt_embeds` staying the cached ones of `batch`. `tokenizers` / `encoders`: all of
    the pipeline's, in its order; an encoder that is not trained may be None (Flux's T5).
    """
    from diffusers import FluxPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

    device = batch["latent_mean"].device
    names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    parts = {n: e for n, e in zip(names, encoders, strict=False)}
    parts |= {n.replace("text_encoder", "tokenizer"): t for n, t in zip(names, tokenizers, strict=False)}
    if family == "sd":
        pipe = StableDiffusionPipeline(
            vae=None, unet=None, scheduler=None, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False, **parts,
        )  # fmt: skip
        embeds, _ = pipe.encode_prompt(captions, device, 1, False)
        return {"prompt_embeds": embeds.float()}
    if family == "sdxl":
        pipe = StableDiffusionXLPipeline(vae=None, unet=None, scheduler=None, **parts)
        embeds, _, pooled, _ = pipe.encode_prompt(
            captions, device=device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return {"prompt_embeds": embeds.float(), "pooled_prompt_embeds": pooled.float()}
    # Flux: only the CLIP part of FluxPipeline.encode_prompt (its `_get_clip_prompt_embeds`), since the
    # T5 part is frozen and cached; the public encode_prompt computes both or neither.
    pipe = FluxPipeline(transformer=None, scheduler=None, vae=None, **parts)
    pooled = pipe._get_clip_prompt_embeds(captions, 1, device)
    return {"prompt_embeds": batch["prompt_embeds"], "pooled_prompt_embeds": pooled.float()}
