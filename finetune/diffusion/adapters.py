"""What trains on the denoiser besides LoRA (diffusion.adapter): LoKr and LoHa through PEFT, or every
weight (full fine-tuning), with how each is checkpointed and saved.

LoKr / LoHa: PEFT's LoKrConfig / LoHaConfig injected with diffusers' own `add_adapter` (any PEFT
config). diffusers' `load_lora_weights` reads LoRA only, so they are saved in PEFT's own format, a
folder `<denoiser>/` with adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(pipe.unet, folder)` (or `load_peft_adapter` here) loads back.

Full: the denoiser trains in fp32 (mixed precision computes in 16-bit); checkpoints hold the whole
denoiser (`save_pretrained`), and the final save is the whole pipeline folder with the trained
(EMA) denoiser, which `<Pipeline>.from_pretrained(output_dir/pipeline)` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.diffusion.model import attach_adapter
from finetune.errors import FinetuneError

PEFT_ADAPTERS = ("lokr", "loha")
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the model it wraps


def add_peft_adapter(
    denoiser: torch.nn.Module,
    kind: str,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    gradient_checkpointing: bool,
) -> int:
    """Freeze the denoiser, add a LoKr or LoHa adapter (lora.lora_dropout as its rank_dropout), keep its
    weights in fp32; returns the number of trainable parameters. PEFT's default init: the adapter starts
    as a no-op (LoKr's w2 / LoHa's hada_w1_b at zero)."""
    from peft import LoHaConfig, LoKrConfig

    cls = {"lokr": LoKrConfig, "loha": LoHaConfig}[kind]
    denoiser.requires_grad_(False)
    config = cls(r=rank, alpha=alpha, rank_dropout=dropout, target_modules=targets)
    return attach_adapter(denoiser, config, targets, gradient_checkpointing, "the denoiser")


def save_peft_adapter(denoiser: torch.nn.Module, folder: str | Path) -> Path:
    """PEFT's format: folder/adapter_config.json and folder/adapter_model.safetensors."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    denoiser.peft_config["default"].save_pretrained(str(folder))
    # Keys as PeftModel.save_pretrained writes them (the wrapped model under `base_model.model.`), so
    # PeftModel.from_pretrained(denoiser, folder) finds every weight.
    state = {
        PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(denoiser).items()
    }
    save_file(state, str(folder / "adapter_model.safetensors"))
    return folder


def load_peft_adapter(denoiser: torch.nn.Module, folder: str | Path) -> None:
    """Load a `save_peft_adapter` folder: into the same adapter when the denoiser has one (resume), else
    injected first from the folder's config (a fresh pipeline's denoiser)."""
    from peft import PeftConfig, inject_adapter_in_model
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "adapter_model.safetensors").is_file():
        raise FinetuneError(f"{folder} holds no adapter_model.safetensors (a LoKr / LoHa adapter folder)")
    if not getattr(denoiser, "peft_config", None):
        inject_adapter_in_model(PeftConfig.from_pretrained(str(folder)), denoiser)
    state = {
        k.removeprefix(PEFT_PREFIX): v
        for k, v in load_file(str(folder / "adapter_model.safetensors")).items()
    }
    result = set_peft_model_state_dict(denoiser, state)
    if getattr(result, "unexpected_keys", None):
        raise FinetuneError(
            f"the adapter in {folder} does not match the denoiser: {result.unexpected_keys[:5]}"
        )


def make_fully_trainable(denoiser: torch.nn.Module, *, gradient_checkpointing: bool) -> int:
    """Every weight of the denoiser trains (it was loaded in fp32); returns their number."""
    if any(p.dtype != torch.float32 for p in denoiser.parameters()):
        raise FinetuneError(
            "diffusion.adapter full: the denoiser must be loaded in fp32 (model.torch_dtype auto or fp32)"
        )
    denoiser.requires_grad_(True)
    if gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return sum(p.numel() for p in denoiser.parameters())


def save_denoiser(denoiser: torch.nn.Module, folder: str | Path) -> None:
    """The whole denoiser with diffusers' save_pretrained (a checkpoint of full fine-tuning)."""
    denoiser.save_pretrained(str(folder), safe_serialization=True)


def load_denoiser_weights(denoiser: torch.nn.Module, folder: str | Path) -> None:
    """Put `save_denoiser`'s weights back into the denoiser (resume). diffusers' from_pretrained reads the
    single or sharded files save_pretrained wrote (accelerate's loader knows transformers' file names
    only); the copy is then loaded into the training model, which keeps its hooks and checkpointing."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FinetuneError(
            f"{folder} holds no denoiser: this checkpoint was not written by full fine-tuning"
        )
    saved = type(denoiser).from_pretrained(str(folder), dtype=torch.float32)  # a second copy, briefly
    denoiser.load_state_dict(saved.state_dict(), strict=True)
