"""The parts of diffusion.train_text_encoder and diffusion.adapter, on tiny pipelines in this process:
text-encoder LoRA gives the cache's embeddings at init and gradients after, and its file round-trips
through diffusers' format; LoKr / LoHa folders load back through PEFT itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.diffusion.model import encode_prompts, load_denoiser, load_text_encoders, pipeline_info

CAPTIONS = ["a red square", "a blue square"]


def _trained_encoders(pipeline: Path, family: str):
    from finetune.diffusion.text_encoder import TRAINED_ENCODERS, add_text_encoder_lora

    info = pipeline_info(str(pipeline))
    tokenizers, encoders = load_text_encoders(info)
    trained = {}
    for name, encoder in zip(info.text_encoder_names, encoders, strict=True):
        if name in TRAINED_ENCODERS[family]:
            add_text_encoder_lora(encoder, rank=4, alpha=4, dropout=0.0)
            trained[name] = encoder
    return info, tokenizers, encoders, trained


@pytest.mark.parametrize("family", ["sd", "sdxl", "flux"])
def test_trainable_embeds_equal_the_cache_at_init_and_carry_gradients(pipeline: Path, family: str) -> None:
    from finetune.diffusion.text_encoder import trainable_embeds

    _, tokenizers, encoders, trained = _trained_encoders(pipeline, family)
    cached = encode_prompts(tokenizers, encoders, CAPTIONS, family, max_sequence_length=16)
    batch = {"latent_mean": torch.zeros(2, 4, 4, 4), **cached}
    embeds = trainable_embeds(family, tokenizers, encoders, CAPTIONS, batch)
    assert sorted(embeds) == sorted(cached)
    for key, value in cached.items():  # LoRA's B starts at zero: the pipeline's own encode_prompt
        torch.testing.assert_close(embeds[key], value, rtol=0, atol=1e-5, msg=key)
    sum(value.square().sum() for value in embeds.values()).backward()
    # Every trained encoder gets gradients (SDXL reads penultimate hidden states, so the first
    # encoder's last layer gets none, as in diffusers' script).
    for name, encoder in trained.items():
        grads = [p.grad for n, p in encoder.named_parameters() if "lora_B" in n]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), name


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_text_encoder_lora_round_trips_through_the_diffusers_file(
    pipeline: Path, family: str, tmp_path: Path
) -> None:
    from finetune.diffusion.model import add_lora, save_lora
    from finetune.diffusion.text_encoder import load_text_encoder_lora, text_encoder_lora_layers

    info, _, _, trained = _trained_encoders(pipeline, family)
    for encoder in trained.values():
        for name, param in encoder.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)
    unet = load_denoiser(info, torch.float32)
    add_lora(unet, rank=4, alpha=4, dropout=0.0, targets=["to_q"], gradient_checkpointing=False)
    save_lora(info, unet, tmp_path, **text_encoder_lora_layers(trained, family))
    _, _, _, fresh = _trained_encoders(pipeline, family)
    load_text_encoder_lora(fresh, tmp_path)
    for name, encoder in trained.items():
        want = {k: v for k, v in encoder.state_dict().items() if "lora" in k}
        got = fresh[name].state_dict()
        assert want and all(torch.equal(got[k], v) for k, v in want.items()), name


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_folders_load_back_through_peft(tiny_sd: Path, kind: str, tmp_path: Path) -> None:
    from peft import PeftModel

    from finetune.diffusion.adapters import add_peft_adapter, load_peft_adapter, save_peft_adapter

    info = pipeline_info(str(tiny_sd))
    unet = load_denoiser(info, torch.float32)
    count = add_peft_adapter(
        unet, kind, rank=4, alpha=4, dropout=0.0, targets=["to_q", "to_v"], gradient_checkpointing=False
    )
    assert count > 0
    with torch.no_grad():  # a trained-looking adapter: every adapter weight moved
        for param in unet.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn_like(param))
    save_peft_adapter(unet, tmp_path / "unet")
    inputs = (torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 16, 32))
    with torch.no_grad():
        want = unet(*inputs).sample
        base = load_denoiser(info, torch.float32)(*inputs).sample
        ours = load_denoiser(info, torch.float32)
        load_peft_adapter(ours, tmp_path / "unet")
        peft_loaded = PeftModel.from_pretrained(load_denoiser(info, torch.float32), str(tmp_path / "unet"))
        assert (want - base).abs().max() > 1e-4
        torch.testing.assert_close(ours(*inputs).sample, want)
        torch.testing.assert_close(peft_loaded(*inputs).sample, want)
