"""The parts of a diffusers pipeline that training needs, and LoRA on its denoiser.

Supported: the rows of finetune.diffusion.families. UNet pipelines: StableDiffusionPipeline (SD 1.x /
2.x, epsilon or v-prediction) and StableDiffusionXLPipeline (two text encoders, pooled embeddings and
size/crop time ids). Flow-matching transformer pipelines: StableDiffusion3Pipeline (SD3, CLIP-L +
CLIP-G + T5, a VAE with a shift factor), FluxPipeline (Flux: 2x2-packed latents, pooled CLIP + T5,
embedded guidance on guidance-distilled checkpoints), QwenImagePipeline (Qwen-Image: a Qwen2.5-VL text
encoder, a video VAE with per-channel latent statistics, 2x2-packed latents) and Flux2KleinPipeline
(Flux.2 [klein]: a Qwen3 text encoder, 2x2-patchified latents normalised by the VAE's BatchNorm
statistics). Other pipelines (Sana, PixArt, ...) are refused with a clear error. The denoiser (UNet or
transformer) is still called `unet` in the training loop's variables; `PipelineInfo.denoiser_name`
says which it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.diffusion.families import FAMILIES as TABLE
from finetune.diffusion.families import DiffusionFamily, family_named, supported, vae_factor
from finetune.errors import FinetuneError

# model_index.json `_class_name` -> family name (the rows of finetune.diffusion.families).
FAMILIES = {f.pipeline: f.name for f in TABLE}
SUPPORTED = supported()
# Families whose denoiser is trained with flow matching (the rest: epsilon / v-prediction).
FLOW_MATCHING_FAMILIES = tuple(f.name for f in TABLE if f.flow_matching)
# Text tokens per caption when diffusion.max_sequence_length is null: each pipeline's own default.
DEFAULT_SEQUENCE_LENGTH = {f.name: f.sequence_length for f in TABLE if f.sequence_length}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PipelineInfo:
    """Which pipeline `model.model_path` names: its family and where its parts are."""

    path: str
    revision: str | None
    class_name: str
    family: str  # a DiffusionFamily.name: "sd", "sdxl", "sd3", "flux", "qwenimage" or "flux2"
    vae_path: str | None = None  # a separate VAE (diffusion.vae_path), else the pipeline's vae/

    @property
    def spec(self) -> DiffusionFamily:
        """The family's row of the table."""
        return family_named(self.family)

    @property
    def pipeline_class(self):
        import diffusers

        return getattr(diffusers, self.class_name)

    @property
    def text_encoder_names(self) -> tuple[str, ...]:
        return self.spec.text_encoders

    @property
    def tokenizer_names(self) -> tuple[str, ...]:
        return self.spec.tokenizers

    @property
    def denoiser_name(self) -> str:
        """The pipeline component that is trained: `unet`, or `transformer` for the transformer families."""
        return self.spec.denoiser

    @property
    def flow_matching(self) -> bool:
        return self.spec.flow_matching

    def sequence_length(self, max_sequence_length: int | None) -> int | None:
        """Text tokens per caption: diffusion.max_sequence_length, or the pipeline's default when null;
        None for the families without one (SD, SDXL)."""
        default = self.spec.sequence_length
        if default is None:
            return None
        return max_sequence_length or default

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
            k in class_name
            for k in ("Flux", "StableDiffusion3", "QwenImage", "Sana", "PixArt", "Lumina", "HunyuanDiT")
        ):
            examples = ", ".join(f"{f.pipeline}, e.g. {f.example}" for f in TABLE if f.flow_matching)
            hint = (
                f"; {class_name} is a transformer-based pipeline that training does not support yet (the "
                f"supported transformer-based pipelines are {examples})"
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


# diffusion.* fields that only flow-matching training reads (a non-default value elsewhere is an error).
FLOW_MATCHING_FIELDS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "max_sequence_length")


def settings_problems(info: PipelineInfo, settings: Any) -> list[str]:
    """`diffusion.*` settings that this pipeline's family cannot use, as `path: reason` lines.

    What does not depend on the pipeline is checked with the recipe (finetune.recipe); this is
    the rest, known only once model_index.json has been read.
    """
    problems = []
    fields = type(settings).model_fields
    defaults = {name: fields[name].get_default() for name in FLOW_MATCHING_FIELDS}
    guidance_changed = settings.guidance_scale != fields["guidance_scale"].get_default()
    if guidance_changed and not info.spec.guidance:
        problems.append(
            f"diffusion.guidance_scale: the embedded guidance of guidance-distilled Flux / Flux.2 transformers; "
            f"{info.class_name} has none: remove it (sampling uses diffusion.validation_guidance_scale)"
        )
    elif guidance_changed and not guidance_embeds(info):
        problems.append(
            f"diffusion.guidance_scale: the transformer of {info.path} has no guidance embedding "
            "(config.guidance_embeds false, e.g. FLUX.1-schnell), so there is nothing to condition on: remove it"
        )
    if info.flow_matching:
        if settings.prediction_type not in (None, "flow_matching"):
            problems.append(
                f"diffusion.prediction_type: {info.class_name} is trained with flow matching, not "
                f"{settings.prediction_type}; set flow_matching or null"
            )
        if settings.snr_gamma is not None:
            problems.append(
                "diffusion.snr_gamma: Min-SNR weighting is for epsilon / v-prediction UNets; flow matching "
                "weights timesteps with diffusion.weighting_scheme: remove snr_gamma"
            )
        if settings.noise_offset:
            problems.append(
                "diffusion.noise_offset: offset noise is for epsilon / v-prediction UNets, not flow matching: set 0"
            )
    else:
        if settings.prediction_type == "flow_matching":
            problems.append(
                f"diffusion.prediction_type: {info.class_name} predicts epsilon or v_prediction, not "
                "flow_matching (null = its scheduler's)"
            )
        for name, default in defaults.items():
            if getattr(settings, name) != default:
                problems.append(
                    f"diffusion.{name}: applies to flow-matching pipelines ({_flow_labels()}) only, not to "
                    f"{info.class_name}: remove it"
                )
    return problems


def _flow_labels() -> str:
    return ", ".join(f.label for f in TABLE if f.flow_matching)


def _denoiser_config(info: PipelineInfo) -> dict:
    import diffusers

    cls = getattr(diffusers, info.spec.denoiser_class)
    return cls.load_config(info.path, subfolder=info.denoiser_name, revision=info.revision)


def guidance_embeds(info: PipelineInfo) -> bool:
    """Whether the pipeline's Flux or Flux.2 transformer is guidance-distilled (FLUX.1-dev: yes,
    schnell and FLUX.2 [klein]: no); False for the other families."""
    if not info.spec.guidance:
        return False
    return bool(_denoiser_config(info).get("guidance_embeds", False))


def check_settings(info: PipelineInfo, settings: Any) -> None:
    """Raise one RecipeError listing every `settings_problems` line."""
    from finetune.errors import RecipeError

    problems = settings_problems(info, settings)
    if problems:
        raise RecipeError(
            f"the diffusion settings do not fit {info.path} ({info.class_name}):\n  " + "\n  ".join(problems)
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


def load_denoiser(info: PipelineInfo, dtype: torch.dtype):
    """The model that training adapts: the UNet or the family's transformer (its `denoiser_class`)."""
    import diffusers

    cls = getattr(diffusers, info.spec.denoiser_class)
    return cls.from_pretrained(info.path, subfolder=info.denoiser_name, revision=info.revision, dtype=dtype)


def load_vae(info: PipelineInfo, device: torch.device | str = "cpu"):
    """The VAE (the family's `vae_class`) in fp32: latents are computed once, and SD/SDXL VAEs
    overflow in fp16."""
    import diffusers

    path, subfolder = info.vae_location()
    vae = getattr(diffusers, info.spec.vae_class).from_pretrained(
        path, subfolder=subfolder, revision=info.revision, dtype=torch.float32
    )
    return vae.to(device).eval().requires_grad_(False)


def load_text_encoders(info: PipelineInfo, device: torch.device | str = "cpu") -> tuple[list, list]:
    """(tokenizers, text encoders) in fp32, frozen: their outputs are cached once per caption."""
    import transformers
    from transformers import AutoTokenizer

    index = read_model_index(info.path, info.revision)
    tokenizers, encoders = [], []
    for name, tokenizer_name in zip(info.text_encoder_names, info.tokenizer_names, strict=True):
        if not index.get(name) or index[name][1] is None:
            raise FinetuneError(
                f"model.model_path: {info.path} has no {name} (model_index.json lists {index.get(name)}); "
                f"{info.class_name} training caches the outputs of all its text encoders: use the full pipeline"
            )
        tokenizers.append(
            AutoTokenizer.from_pretrained(info.path, subfolder=tokenizer_name, revision=info.revision)
        )
        cls = getattr(transformers, index[name][1])  # e.g. CLIPTextModel, CLIPTextModelWithProjection
        encoder = cls.from_pretrained(info.path, subfolder=name, revision=info.revision, dtype=torch.float32)
        encoders.append(encoder.to(device).eval().requires_grad_(False))
    return tokenizers, encoders


def load_noise_scheduler(info: PipelineInfo, prediction_type: str | None):
    """The training noise schedule, with an optional override of what the UNet predicts.

    UNets: DDPM with the pipeline scheduler's betas. SD3 and Flux: the pipeline's own
    FlowMatchEulerDiscreteScheduler (its `sigmas` give the noise levels: shifted by its `shift`, or
    unshifted when it shifts dynamically at inference, as Flux's does).
    """
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    if info.flow_matching:
        if prediction_type not in (None, "flow_matching"):
            raise FinetuneError(
                f"diffusion.prediction_type: {info.class_name} is trained with flow matching, not "
                f"{prediction_type}; set flow_matching or null"
            )
        return FlowMatchEulerDiscreteScheduler.from_pretrained(
            info.path, subfolder="scheduler", revision=info.revision
        )
    if prediction_type == "flow_matching":
        raise FinetuneError(
            f"diffusion.prediction_type: flow_matching is for flow-matching pipelines ({_flow_labels()}); {info.class_name} "
            "predicts epsilon or v_prediction (null = its scheduler's)"
        )
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
    """Image sides must be multiples of this: VAE downsampling x the denoiser's (UNet: its down blocks;
    SD3: its patch size; Flux, Qwen-Image, Flux.2: 2, the 2x2 patches their pipelines pack latents into).

    64 for SD and SDXL (8 x 8), 16 for SD3, Flux, Qwen-Image and Flux.2 (8 x 2). Read from the
    configs, so tiny test pipelines get their own value.
    """
    import diffusers

    path, subfolder = info.vae_location()
    vae_config = getattr(diffusers, info.spec.vae_class).load_config(
        path, subfolder=subfolder, revision=info.revision
    )
    return vae_factor(vae_config) * info.spec.denoiser_factor(_denoiser_config(info))


def max_pixel_side(info: PipelineInfo) -> int | None:
    """The longest image side the denoiser accepts, in pixels; None when unbounded (UNets, the rotary
    position embeddings of Flux, Qwen-Image and Flux.2).

    SD3's transformer crops a fixed position-embedding grid of `pos_embed_max_size` patches per side.
    """
    field = info.spec.max_side_config
    if field is None:
        return None
    return _denoiser_config(info)[field] * pixel_multiple(info)


def encode_prompts(
    tokenizers: list,
    encoders: list,
    prompts: list[str],
    family: str,
    *,
    max_sequence_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Text-encoder outputs as the family's pipeline computes them (finetune.diffusion.prompts: float32,
    on the encoders' device); `max_sequence_length` null: the family's default."""
    spec = family_named(family)
    length = (max_sequence_length or spec.sequence_length) if spec.sequence_length else None
    return spec.encode(tokenizers, encoders, prompts, length)


@torch.no_grad()
def encode_pixels(vae, pixels: torch.Tensor, *, video: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latent distribution for pixels in [-1, 1], unscaled, float32.

    `video`: a video VAE (Qwen-Image's) encodes the images as one-frame videos; the frame axis is
    dropped from its latents (QwenImagePipeline adds it back before decoding).
    """
    pixels = pixels.to(vae.device, torch.float32)
    dist = vae.encode(pixels.unsqueeze(2) if video else pixels).latent_dist
    mean, std = dist.mean.float(), dist.std.float()
    return (mean.squeeze(2), std.squeeze(2)) if video else (mean, std)


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
    from peft import LoraConfig

    unet.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=lora_target_names(unet, targets),
    )
    return attach_adapter(unet, config, targets, gradient_checkpointing, "the UNet")


def attach_adapter(
    denoiser: torch.nn.Module, config, targets, gradient_checkpointing: bool, what: str
) -> int:
    """Add a PEFT adapter `config` to a frozen denoiser (diffusers' PEFT integration), its weights in
    fp32, gradient checkpointing if asked; returns the number of trainable parameters. `what` names the
    denoiser in the error when `targets` matched nothing. LoRA (add_lora) and LoKr/LoHa
    (diffusion.adapters) share it."""
    from diffusers.training_utils import cast_training_params

    try:
        denoiser.add_adapter(config)
    except ValueError as exc:
        raise FinetuneError(f"lora.lora_target_modules: {exc}") from exc
    cast_training_params(denoiser, dtype=torch.float32)
    if gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    if trainable == 0:
        raise FinetuneError(f"lora.lora_target_modules: {targets} matched no module of {what}")
    return trainable


def lora_state_dict(unet: torch.nn.Module, family: str = "sd") -> dict[str, torch.Tensor]:
    """The denoiser's LoRA weights as diffusers' training scripts save them.

    UNets: converted to the diffusers naming (train_text_to_image_lora*.py); transformers: the PEFT
    naming, as train_dreambooth_lora_{sd3,flux,qwen_image,flux2_klein}.py write (all load with
    `load_lora_weights`).
    """
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(unet)
    return state if family_named(family).denoiser == "transformer" else convert_state_dict_to_diffusers(state)


def save_lora(info: PipelineInfo, unet: torch.nn.Module, folder: str | Path, **kwargs: Any) -> None:
    """`pytorch_lora_weights.safetensors` (+ the adapter config as metadata, so alpha != rank loads right).

    Keys are prefixed with the denoiser's name (`unet.` or `transformer.`), as
    `pipeline.load_lora_weights(folder)` expects.
    """
    name = info.denoiser_name
    info.pipeline_class.save_lora_weights(
        str(folder),
        **{
            f"{name}_lora_layers": lora_state_dict(unet, info.family),
            f"{name}_lora_adapter_metadata": unet.peft_config["default"].to_dict(),
        },
        safe_serialization=True,
        **kwargs,
    )


def load_lora_into_unet(unet: torch.nn.Module, folder: str | Path, prefix: str = "unet") -> None:
    """Load weights written by `save_lora` into a denoiser that already has the same adapter (resume).

    `prefix`: the denoiser's name in the file (`PipelineInfo.denoiser_name`).
    """
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / "pytorch_lora_weights.safetensors"))
    state = {k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")}
    if not state:
        raise FinetuneError(f"{folder}/pytorch_lora_weights.safetensors holds no {prefix}.* LoRA weights")
    result = set_peft_model_state_dict(unet, convert_unet_state_dict_to_peft(state), adapter_name="default")
    if result is not None and getattr(result, "unexpected_keys", None):
        raise FinetuneError(
            f"LoRA checkpoint in {folder} does not match the adapter: {result.unexpected_keys[:5]}"
        )
