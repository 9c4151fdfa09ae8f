"""train.gradient_checkpointing on a UNet with LoRA: the same loss and LoRA gradients as without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

from finetune.diffusion.model import add_lora, load_noise_scheduler, load_unet, pipeline_info
from finetune.diffusion.objective import diffusion_loss


def _batch(sdxl: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = {
        "latent_mean": torch.randn(2, 4, 8, 8, generator=g),
        "latent_std": torch.rand(2, 4, 8, 8, generator=g) * 0.1,
        "prompt_embeds": torch.randn(2, 16, 64 if sdxl else 32, generator=g),
        "is_prior": torch.tensor([False, False]),
    }
    if sdxl:
        batch["pooled_prompt_embeds"] = torch.randn(2, 32, generator=g)
        batch["time_ids"] = torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 2)
    return batch


def _loss_and_grads(path: Path, *, checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
    info = pipeline_info(str(path))
    unet = load_unet(info, torch.float32)
    torch.manual_seed(1)  # the same LoRA initialisation in both runs
    add_lora(unet, rank=4, alpha=8, dropout=0.1, targets="all-linear", gradient_checkpointing=checkpointing)
    assert unet.is_gradient_checkpointing is checkpointing
    unet.train()
    torch.manual_seed(2)  # the same latents, noise, timesteps and dropout masks
    loss = diffusion_loss(
        unet, load_noise_scheduler(info, None), _batch(info.family == "sdxl"), scaling_factor=0.18215
    )
    loss.backward()
    grads = {name: p.grad.clone() for name, p in unet.named_parameters() if p.requires_grad}
    return loss.item(), grads


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(
    family: str, pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_loss, plain_grads = _loss_and_grads(pipeline, checkpointing=False)

    calls = []
    real = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    loss, grads = _loss_and_grads(pipeline, checkpointing=True)
    # Non-reentrant checkpoints: the LoRA weights get gradients although the blocks' inputs need none.
    assert calls and set(calls) == {False}
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    assert grads.keys() == plain_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(grad.abs().max() > 0 for grad in grads.values())
