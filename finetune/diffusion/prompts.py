"""Text-encoder outputs as each pipeline family computes them (float32, on the encoders' device).

One function per family (the `encode` of its row in finetune.diffusion.families), each with the
signature `(tokenizers, encoders, prompts, max_sequence_length) -> dict of tensors`. Where the
pipeline has an `encode_prompt`, a pipeline of the text encoders only is built and its own method is
called, so the cached embeddings are exactly what inference computes.
"""

from __future__ import annotations

import torch


def _parts(tokenizers: list, encoders: list) -> dict:
    """Pipeline keyword arguments for the text encoders and tokenizers, in the pipelines' naming."""
    names = ("text_encoder", "text_encoder_2", "text_encoder_3")[: len(encoders)]
    parts = dict(zip(names, encoders, strict=True))
    return parts | {n.replace("text_encoder", "tokenizer"): t for n, t in zip(names, tokenizers, strict=True)}


@torch.no_grad()
def encode_clip(tokenizers: list, encoders: list, prompts: list[str], max_sequence_length=None) -> dict:
    """SD: `prompt_embeds` = the last hidden state. SDXL: `prompt_embeds` = penultimate hidden states
    of both encoders concatenated, `pooled_prompt_embeds` = the second encoder's projected output
    (StableDiffusionXLPipeline.encode_prompt with clip_skip None)."""
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
        if len(encoders) == 1:  # SD
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
def encode_sd3(tokenizers: list, encoders: list, prompts: list[str], max_sequence_length: int) -> dict:
    """StableDiffusion3Pipeline.encode_prompt: `prompt_embeds` = both CLIPs' penultimate hidden states
    concatenated, zero-padded to T5's width, followed by T5's `max_sequence_length` hidden states;
    `pooled_prompt_embeds` = both CLIPs' projected outputs concatenated."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=None, scheduler=None, vae=None, **_parts(tokenizers, encoders)
    )
    prompt_embeds, _, pooled, _ = pipe.encode_prompt(
        prompts,
        None,
        None,
        device=encoders[0].device,
        do_classifier_free_guidance=False,
        max_sequence_length=max_sequence_length,
    )
    return {"prompt_embeds": prompt_embeds.float(), "pooled_prompt_embeds": pooled.float()}


@torch.no_grad()
def encode_flux(tokenizers: list, encoders: list, prompts: list[str], max_sequence_length: int) -> dict:
    """FluxPipeline.encode_prompt: `prompt_embeds` = T5's `max_sequence_length` hidden states,
    `pooled_prompt_embeds` = CLIP's pooled output (the text ids are zeros, made at training time)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(transformer=None, scheduler=None, vae=None, **_parts(tokenizers, encoders))
    prompt_embeds, pooled, _ = pipe.encode_prompt(
        prompts, None, device=encoders[0].device, max_sequence_length=max_sequence_length
    )
    return {"prompt_embeds": prompt_embeds.float(), "pooled_prompt_embeds": pooled.float()}


@torch.no_grad()
def encode_qwenimage(tokenizers: list, encoders: list, prompts: list[str], max_sequence_length: int) -> dict:
    """QwenImagePipeline.encode_prompt: Qwen2.5-VL's last hidden states of the caption in the
    pipeline's prompt template (its system prefix dropped), at most `max_sequence_length` tokens.

    Captions have their own lengths: `prompt_embeds` is padded to the longest of `prompts` and
    `prompt_lengths` says how many positions of each are real (the cache stores each unpadded; the
    loader pads a batch again and passes the mask, as train_dreambooth_lora_qwen_image.py does).
    """
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(transformer=None, scheduler=None, vae=None, **_parts(tokenizers, encoders))
    embeds, mask = pipe.encode_prompt(
        prompts, device=encoders[0].device, max_sequence_length=max_sequence_length
    )
    if mask is None:  # the pipeline drops an all-ones mask
        lengths = torch.full((embeds.shape[0],), embeds.shape[1], dtype=torch.long)
    else:
        lengths = mask.sum(dim=1).long().cpu()
    return {"prompt_embeds": embeds.float(), "prompt_lengths": lengths}


@torch.no_grad()
def encode_flux2(tokenizers: list, encoders: list, prompts: list[str], max_sequence_length: int) -> dict:
    """Flux2KleinPipeline.encode_prompt: Qwen3's hidden states of layers 9, 18 and 27 (its default
    `text_encoder_out_layers`) of the chat-templated caption padded to `max_sequence_length`, stacked
    along the features (the text ids are made at training time, as the pipeline makes them)."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline(transformer=None, scheduler=None, vae=None, **_parts(tokenizers, encoders))
    embeds, _ = pipe.encode_prompt(
        prompts, device=encoders[0].device, max_sequence_length=max_sequence_length
    )
    return {"prompt_embeds": embeds.float()}
