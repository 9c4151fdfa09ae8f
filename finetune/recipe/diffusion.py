"""The `diffusion` section (model.kind: diffusion) and the rules that tie it to the other sections."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

from pydantic import Field

from finetune.recipe.base import FREE_ON_RESUME, Problem, _Section

# LoRA targets of a diffusion recipe when lora.lora_target_modules is not set: the attention
# projections, as in diffusers' LoRA examples. UNets (SD 1.x/2.x, SDXL) have only the first four;
# SD3's joint attention also projects the text stream (add_*_proj, to_add_out), and the eight are
# the defaults of diffusers' train_dreambooth_lora_sd3.py. (Names match as suffixes: on SD3.5's
# dual-attention blocks the first four also adapt `attn2`, which that script leaves out.) Flux's
# double-stream blocks have the same eight and its single-stream blocks attn.to_q/k/v, all adapted;
# diffusers' train_dreambooth_lora_flux.py also adapts the feed-forward layers (ff.net.0.proj,
# ff.net.2, ff_context.net.*), which recipes/diffusion/flux_lora.yaml lists (UNets have ff.net.* too,
# so they cannot join this family-independent default).
DIFFUSION_DEFAULT_LORA_TARGETS = [
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "add_k_proj",
    "add_q_proj",
    "add_v_proj",
    "to_add_out",
]


class DiffusionSection(_Section):
    """Text-to-image LoRA / DreamBooth settings (model.kind: diffusion; base pipeline = model.model_path)."""

    fixed_on_resume: ClassVar[bool] = True  # every field, except those marked FREE_ON_RESUME

    resolution: int = Field(
        512, ge=8, description="Target side in pixels: buckets hold about resolution^2 pixels."
    )
    aspect_ratio_buckets: bool = Field(
        True,
        description="Batch images of similar shape together at their bucket's resolution (about "
        "resolution^2 pixels); false: every image is resized and cropped to resolution x resolution.",
    )
    center_crop: bool = Field(
        False,
        description="Crop the resized image at its centre; false: a random crop, drawn once per image "
        "at prepare time from train.seed (the latents are cached).",
    )
    random_flip: bool = Field(
        False,
        description="Horizontal flip: latents of the flipped image are cached too and each epoch uses "
        "one of the two per image, drawn from (train.seed, epoch, image).",
    )
    min_image_side: int | None = Field(
        None,
        ge=1,
        description="Images whose shorter side is below this many pixels are dropped (counted as "
        "too_small in the manifest); null = half of resolution.",
    )
    caption_column: str = Field(
        "text",
        description="images: caption field of metadata.jsonl / metadata.csv rows or of the Hub dataset "
        "(a .txt file next to an image is used when there is no metadata file).",
    )
    image_column: str = Field("image", description="images from the Hub: the image column.")
    instance_prompt: str | None = Field(
        None, description="dreambooth: the prompt of every instance image, e.g. 'a photo of sks dog'."
    )
    with_prior_preservation: bool = Field(
        False, description="DreamBooth prior preservation: also train on class images (class_prompt)."
    )
    class_data_dir: str | None = Field(
        None,
        description="Folder of class images; missing ones (up to num_class_images) are generated with "
        "the base pipeline at prepare time and saved there.",
    )
    class_prompt: str | None = Field(None, description="Prompt of the class images, e.g. 'a photo of a dog'.")
    num_class_images: int = Field(100, ge=1, description="Class images used for prior preservation.")
    prior_loss_weight: float = Field(1.0, ge=0, description="Weight of the class-image (prior) loss.")
    class_generation_steps: int = Field(
        25, ge=1, description="Inference steps when generating missing class images."
    )
    vae_path: str | None = Field(
        None,
        description="A separate VAE (folder or Hub id), e.g. an fp16-safe SDXL VAE; null = the "
        "pipeline's own vae/.",
    )
    encode_batch_size: int = Field(
        8, ge=1, description="Images per VAE / text-encoder batch when caching latents."
    )
    noise_offset: float = Field(
        0.0, ge=0, description="Offset noise scale (0 = off): noise += offset * N(0, 1) per channel."
    )
    snr_gamma: float | None = Field(
        None,
        gt=0,
        description="Min-SNR loss weighting gamma (5.0 is the paper's value); null = off. "
        "Epsilon / v-prediction only (flow matching: weighting_scheme).",
    )
    prediction_type: Literal["epsilon", "v_prediction", "flow_matching"] | None = Field(
        None,
        description="What the denoiser predicts; null = what the pipeline's scheduler defines "
        "(its prediction_type for UNets; flow_matching for SD3, Flux, Qwen-Image and Flux.2, whose "
        "FlowMatchEulerDiscreteScheduler "
        "gives the noise levels: input (1 - sigma) * latents + sigma * noise, target noise - latents).",
    )
    weighting_scheme: Literal["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"] = Field(
        "logit_normal",
        description="Flow matching (SD3, Flux, Qwen-Image, Flux.2) only, as diffusers' DreamBooth LoRA scripts: "
        "logit_normal / mode draw "
        "timesteps from that density (SD3 paper), sigma_sqrt / cosmap draw them uniformly and weight "
        "the loss; none = uniform, unweighted.",
    )
    logit_mean: float = Field(0.0, description="weighting_scheme logit_normal: mean of the normal.")
    logit_std: float = Field(1.0, gt=0, description="weighting_scheme logit_normal: std of the normal.")
    mode_scale: float = Field(1.29, description="weighting_scheme mode: its scale parameter.")
    max_sequence_length: int | None = Field(
        None,
        ge=1,
        le=512,
        description="SD3, Flux, Qwen-Image and Flux.2: text tokens per caption (SD3, Flux: T5's; Qwen-Image: "
        "at most this many, each caption stored unpadded), also used for validation images; null = the "
        "pipeline's default (SD3: 256, Flux, Qwen-Image and Flux.2: 512). The cache holds (77 + this) x 4096 "
        "floats per image for SD3, this x 4096 for Flux, this x 3 x the Qwen3 width for Flux.2.",
    )
    guidance_scale: float = Field(
        3.5,
        ge=0,
        description="Flux and Flux.2 only: the embedded guidance value a guidance-distilled transformer "
        "(FLUX.1-dev) "
        "is trained with, as diffusers' Flux scripts (3.5); ignored, with a message, by transformers "
        "without guidance embeddings (FLUX.1-schnell), where a non-default value is an error.",
    )
    adapter: Literal["lora", "lokr", "loha", "full"] = Field(
        "lora",
        description="What trains on the denoiser (UNet or transformer): lora (saved in diffusers' format, "
        "pipeline.load_lora_weights loads it), lokr or loha (PEFT's LoKrConfig / LoHaConfig with lora.lora_rank, "
        "lora_alpha, lora_dropout and lora_target_modules; saved in PEFT's format under output_dir/<denoiser>/, "
        "loaded with peft.PeftModel.from_pretrained(pipe.<denoiser>, that folder): diffusers' "
        "load_lora_weights reads LoRA only), or full (every weight of the denoiser trains; the final save is the "
        "whole pipeline folder, output_dir/pipeline, with the trained (EMA with use_ema) denoiser).",
    )
    train_text_encoder: bool = Field(
        False,
        description="Also train LoRA on the CLIP text encoder(s) (SD 1.x/2.x: text_encoder; SDXL: both; Flux: "
        "the CLIP text_encoder only, as diffusers' train_dreambooth_lora_flux.py, its T5 stays frozen and "
        "cached), with lora.lora_rank / lora_alpha / lora_dropout on q_proj, k_proj, v_proj and out_proj. The "
        "CLIP embeddings are then computed at every step (the cached latents, and Flux's T5 embeddings, are "
        "still used). Saved in the same pytorch_lora_weights.safetensors (load_lora_weights loads both). "
        "Needs adapter: lora; not for SD3.",
    )
    text_encoder_lr: float | None = Field(
        None,
        gt=0,
        description="train_text_encoder: the text encoders' learning rate (diffusers' scripts: "
        "--text_encoder_lr, e.g. 5e-6); null = train.lr. Follows train.lr's schedule.",
    )
    use_ema: bool = Field(
        False,
        description="Keep an EMA of the trained weights (diffusers EMAModel: the adapters', or the whole "
        "denoiser's with adapter: full); checkpoints hold it and the final weights and samples use it.",
    )
    ema_decay: float = Field(0.9999, gt=0, lt=1, description="EMA decay.")
    validation_prompts: list[str] = Field(
        default_factory=list,
        description="Prompts sampled every validation_steps and at the end (output_dir/samples/).",
        **FREE_ON_RESUME,
    )
    validation_steps: int | None = Field(
        None,
        ge=1,
        description="Sample the validation prompts every N optimizer steps; null = only at the end.",
        **FREE_ON_RESUME,
    )
    num_validation_images: int = Field(
        2, ge=1, description="Images generated per validation prompt.", **FREE_ON_RESUME
    )
    validation_inference_steps: int = Field(
        25, ge=1, description="Denoising steps per validation image.", **FREE_ON_RESUME
    )
    validation_guidance_scale: float = Field(
        7.5,
        ge=0,
        description="Classifier-free guidance scale (Flux: the pipeline's embedded guidance_scale, "
        "3.5 for FLUX.1-dev; no effect on FLUX.1-schnell).",
        **FREE_ON_RESUME,
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        prior = ("with_prior_preservation", "class_data_dir", "class_prompt")
        if ok(*prior) and self.with_prior_preservation:
            for name in ("class_data_dir", "class_prompt"):
                if not getattr(self, name):
                    problems.append(
                        (name, None, "with_prior_preservation needs class_data_dir and class_prompt")
                    )
        if (
            ok("validation_steps", "validation_prompts")
            and self.validation_steps
            and not self.validation_prompts
        ):
            problems.append(
                ("validation_steps", self.validation_steps, "set validation_prompts to sample every N steps")
            )
        problems += self._objective_problems(ok)
        problems += self._training_problems(ok)
        return problems

    def _training_problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """What trains: text-encoder LoRA needs a LoRA denoiser adapter (one diffusers LoRA file holds
        both); text_encoder_lr needs train_text_encoder. (SD3 is refused once the pipeline is known.)"""
        problems: list[Problem] = []
        if ok("train_text_encoder", "adapter") and self.train_text_encoder and self.adapter != "lora":
            problems.append(
                (
                    "train_text_encoder",
                    True,
                    f"trains text-encoder LoRA saved beside the denoiser's LoRA in diffusers' format, which "
                    f"adapter {self.adapter} does not write: set adapter: lora or train_text_encoder: false",
                )
            )
        if (
            ok("text_encoder_lr", "train_text_encoder")
            and self.text_encoder_lr
            and not self.train_text_encoder
        ):
            problems.append(
                ("text_encoder_lr", self.text_encoder_lr, "does nothing without train_text_encoder: true")
            )
        return problems

    def _objective_problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """Loss settings that contradict prediction_type or weighting_scheme (what the pipeline's
        family rules out when prediction_type is null is checked at prepare time)."""
        problems: list[Problem] = []
        flow_fields = (
            "weighting_scheme",
            "logit_mean",
            "logit_std",
            "mode_scale",
            "max_sequence_length",
            "guidance_scale",
        )
        if ok("prediction_type", "snr_gamma", "noise_offset", *flow_fields):
            if self.prediction_type == "flow_matching":
                if self.snr_gamma is not None:
                    problems.append(
                        (
                            "snr_gamma",
                            self.snr_gamma,
                            "Min-SNR weighting is for epsilon / v_prediction; flow matching weights timesteps "
                            "with weighting_scheme: remove snr_gamma",
                        )
                    )
                if self.noise_offset:
                    problems.append(
                        (
                            "noise_offset",
                            self.noise_offset,
                            "offset noise does not apply to flow matching: set 0",
                        )
                    )
            elif self.prediction_type is not None:
                for name in flow_fields:
                    if getattr(self, name) != type(self).model_fields[name].get_default():
                        problems.append(
                            (
                                name,
                                getattr(self, name),
                                f"applies to flow matching (SD3, Flux) only, not prediction_type "
                                f"{self.prediction_type}",
                            )
                        )
        if ok("weighting_scheme", "logit_mean", "logit_std", "mode_scale"):
            for name, scheme in (
                ("logit_mean", "logit_normal"),
                ("logit_std", "logit_normal"),
                ("mode_scale", "mode"),
            ):
                value = getattr(self, name)
                if self.weighting_scheme != scheme and value != type(self).model_fields[name].get_default():
                    problems.append(
                        (
                            name,
                            value,
                            f"is read by weighting_scheme {scheme} only (it is {self.weighting_scheme})",
                        )
                    )
        return problems
