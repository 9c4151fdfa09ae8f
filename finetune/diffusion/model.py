"""The parts of a diffusers pipeline that training needs, and LoRA on the UNet.

Supported: UNet pipelines, i.e. StableDiffusionPipeline (SD 1.x / 2.x, epsilon or v-prediction) and
StableDiffusionXLPipeline (two text encoders, pooled embeddings and size/crop time ids). Transformer
pipelines (SD3, Flux, ...) are refused with a clear error: their flow-matching objective and LoRA
layout are not implemented here yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.errors import FinetuneError

# model_index.json `_class_name` -> family.
FAMILIES = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl"}
SUPPORTED = "StableDiffusionPipeline (SD 1.x/2.x) and StableDiffusionXLPipeline (SDXL)"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PipelineInfo:
    """Which pipeline `model.model_path` names: its family and where its parts are."""

    path: str
    revision: str | None
    class_name: str
    family: str  # "sd" or "sdxl"
    vae_path: str | None = None  # a separate VAE (diffusion.vae_path), else the pipeline's vae/

    @property
    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self.class_name)

    @property
    def text_encoder_names(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2") if self.family == "sdxl" else ("text_encoder",)

    def vae_location(self) -> tuple[str, str | None]:
        """(path, subfolder) of the VAE."""
        return (self.vae_path, None) if self.vae_path else (self.path, "vae")


def read_model_index(model_path: str, revision: str | None) -> dict:
    """model_index.json of a local diffusers folder or a Hub repo."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        index = local / "model_index.json"
        if not index.is_file():
            raise FinetuneError(
                f"model.model_path: {local} has no model_index.json: point it at a diffusers pipeline folder "
                "(saved with pipeline.save_pretrained) or a Hub id such as stable-diffusion-v1-5/stable-diffusion-v1-5"
            )
        return json.loads(index.read_text(encoding="utf-8"))
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(model_path, "model_index.json", revision=revision)
    except Exception as exc:
        raise FinetuneError(
            f"model.model_path: cannot read model_index.json of {model_path!r} (revision {revision or 'main'}): "
            f"{type(exc).__name__}: {exc}. Use a local diffusers folder or check the id and the network."
        ) from exc
    return json.loads(Path(path).read_text(encoding="utf-8"))


def pipeline_info(model_path: str, revision: str | None = None, vae_path: str | None = None) -> PipelineInfo:
    """Detect the pipeline family from model_index.json; refuse what training does not support."""
    class_name = read_model_index(model_path, revision).get("_class_name", "")
    family = FAMILIES.get(class_name)
    if family is None:
        base = class_name.removesuffix("Img2ImgPipeline").removesuffix("InpaintPipeline") + "Pipeline"
        if base in FAMILIES and base != class_name:
            hint = f"; it is a {class_name}: use the text-to-image {base} of the same weights"
        elif any(
            k in class_name for k in ("Flux", "StableDiffusion3", "Sana", "PixArt", "Lumina", "HunyuanDiT")
        ):
            hint = (
                f"; {class_name} is a transformer-based pipeline: its flow-matching objective and LoRA "
                "layout are not supported yet"
            )
        else:
            hint = ""
        raise FinetuneError(
            f"model.model_path: {model_path} is a {class_name or 'pipeline without _class_name'}; diffusion "
            f"fine-tuning supports {SUPPORTED}{hint}"
        )
    return PipelineInfo(
        path=model_path, revision=revision, class_name=class_name, family=family, vae_path=vae_path
    )


def weight_dtype(torch_dtype: str, mixed_precision: str) -> torch.dtype:
    """dtype of the frozen weights (UNet base, text encoders at sampling time).

    auto: the mixed-precision dtype (frozen weights need no fp32 master copy; the trained LoRA
    parameters are kept in fp32 by `add_lora`), fp32 without mixed precision.
    """
    if torch_dtype != "auto":
        return _DTYPES[torch_dtype]
    return _DTYPES.get(mixed_precision, torch.float32)


def load_unet(info: PipelineInfo, dtype: torch.dtype):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(
        info.path, subfolder="unet", revision=info.revision, dtype=dtype
    )


def load_vae(info: PipelineInfo, device: torch.device | str = "cpu"):
    """The VAE in fp32: latents are computed once, and SD/SDXL VAEs overflow in fp16."""
    from diffusers import AutoencoderKL

    path, subfolder = info.vae_location()
    vae = AutoencoderKL.from_pretrained(
        path, subfolder=subfolder, revision=info.revision, dtype=torch.float32
    )
    return vae.to(device).eval().requires_grad_(False)


def load_text_encoders(info: PipelineInfo, device: torch.device | str = "cpu") -> tuple[list, list]:
    """(tokenizers, text encoders) in fp32, frozen: their outputs are cached once per caption."""
    import transformers
    from transformers import AutoTokenizer

    index = read_model_index(info.path, info.revision)
    tokenizers, encoders = [], []
    for i, name in enumerate(info.text_encoder_names):
        tokenizer_name = "tokenizer" if i == 0 else "tokenizer_2"
        tokenizers.append(
            AutoTokenizer.from_pretrained(info.path, subfolder=tokenizer_name, revision=info.revision)
        )
        cls = getattr(transformers, index[name][1])  # e.g. CLIPTextModel, CLIPTextModelWithProjection
        encoder = cls.from_pretrained(info.path, subfolder=name, revision=info.revision, dtype=torch.float32)
        encoders.append(encoder.to(device).eval().requires_grad_(False))
    return tokenizers, encoders


def load_noise_scheduler(info: PipelineInfo, prediction_type: str | None):
    """The training noise schedule (DDPM with the pipeline scheduler's betas), with an optional override."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_pretrained(info.path, subfolder="scheduler", revision=info.revision)
    if prediction_type is not None:
        scheduler.register_to_config(prediction_type=prediction_type)
    if scheduler.config.prediction_type not in ("epsilon", "v_prediction"):
        raise FinetuneError(
            f"the scheduler of {info.path} predicts {scheduler.config.prediction_type!r}; training supports "
            "epsilon and v_prediction (set diffusion.prediction_type)"
        )
    return scheduler


def pixel_multiple(info: PipelineInfo) -> int:
    """Image sides must be multiples of this: VAE downsampling x UNet downsampling.

    64 for SD and SDXL (8 x 8). Read from the configs, so tiny test pipelines get their own value.
    """
    from diffusers import AutoencoderKL, UNet2DConditionModel

    path, subfolder = info.vae_location()
    vae_config = AutoencoderKL.load_config(path, subfolder=subfolder, revision=info.revision)
    unet_config = UNet2DConditionModel.load_config(info.path, subfolder="unet", revision=info.revision)
    vae_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
    unet_factor = 2 ** (len(unet_config["down_block_types"]) - 1)
    return vae_factor * unet_factor


@torch.no_grad()
def encode_prompts(
    tokenizers: list, encoders: list, prompts: list[str], family: str
) -> dict[str, torch.Tensor]:
    """Text-encoder outputs as the pipelines compute them (float32, on the encoders' device).

    sd: `prompt_embeds` = last hidden state. sdxl: `prompt_embeds` = penultimate hidden states of
    both encoders concatenated, `pooled_prompt_embeds` = the second encoder's projected output
    (StableDiffusionXLPipeline.encode_prompt with clip_skip None).
    """
    out: dict[str, torch.Tensor] = {}
    hidden = []
    for tokenizer, encoder in zip(tokenizers, encoders, strict=True):
        ids = tokenizer(
            prompts,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(encoder.device)
        if family == "sd":
            mask = None
            if getattr(encoder.config, "use_attention_mask", False):
                mask = (ids != tokenizer.pad_token_id).long()
            return {"prompt_embeds": encoder(ids, attention_mask=mask)[0].float()}
        result = encoder(ids, output_hidden_states=True)
        hidden.append(result.hidden_states[-2])
        out["pooled_prompt_embeds"] = result[0].float()  # the last encoder's pooled output wins
    out["prompt_embeds"] = torch.cat(hidden, dim=-1).float()
    return out


@torch.no_grad()
def encode_pixels(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latent distribution for pixels in [-1, 1], unscaled, float32."""
    dist = vae.encode(pixels.to(vae.device, torch.float32)).latent_dist
    return dist.mean.float(), dist.std.float()


def lora_target_names(unet: torch.nn.Module, targets: list[str] | str) -> list[str]:
    """The module names to adapt: the recipe's list, or every Linear of the UNet for `all-linear`.

    PEFT's own `all-linear` shortcut only knows transformers models, so it is expanded here.
    """
    if targets != "all-linear":
        return list(targets)
    return sorted(name for name, module in unet.named_modules() if isinstance(module, torch.nn.Linear))


def add_lora(
    unet: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str] | str,
    gradient_checkpointing: bool,
) -> int:
    """Freeze the UNet, add a LoRA adapter (diffusers' PEFT integration), keep its weights in fp32.

    Returns the number of trainable parameters. fp32 LoRA weights are what fp16 loss scaling needs
    (GradScaler refuses fp16 gradients) and keep bf16 updates from rounding away.
    """
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    unet.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=lora_target_names(unet, targets),
    )
    try:
        unet.add_adapter(config)
    except ValueError as exc:
        raise FinetuneError(f"lora.lora_target_modules: {exc}") from exc
    cast_training_params(unet, dtype=torch.float32)
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    trainable = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    if trainable == 0:
        raise FinetuneError(f"lora.lora_target_modules: {targets} matched no module of the UNet")
    return trainable


def lora_state_dict(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The UNet's LoRA weights in the diffusers format (what save_lora_weights writes)."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))


def save_lora(info: PipelineInfo, unet: torch.nn.Module, folder: str | Path, **kwargs: Any) -> None:
    """`pytorch_lora_weights.safetensors` (+ the adapter config as metadata, so alpha != rank loads right)."""
    info.pipeline_class.save_lora_weights(
        str(folder),
        unet_lora_layers=lora_state_dict(unet),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        safe_serialization=True,
        **kwargs,
    )


def load_lora_into_unet(unet: torch.nn.Module, folder: str | Path) -> None:
    """Load weights written by `save_lora` into a UNet that already has the same adapter (resume)."""
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / "pytorch_lora_weights.safetensors"))
    state = {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}
    result = set_peft_model_state_dict(unet, convert_unet_state_dict_to_peft(state), adapter_name="default")
    if result is not None and getattr(result, "unexpected_keys", None):
        raise FinetuneError(
            f"LoRA checkpoint in {folder} does not match the adapter: {result.unexpected_keys[:5]}"
        )
