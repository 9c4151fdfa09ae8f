"""The optimizers `train.optimizer` accepts, torch-free (finetune validate imports no torch).

Two are finetune's own: `adamw` (torch's AdamW, fused on CUDA; the default) and `muon` (torch's Muon on
the 2-D hidden weight matrices, AdamW on the rest). Every other name is one of transformers'
`OptimizerNames`, built by transformers' own table (`Trainer.get_optimizer_cls_and_kwargs`), so its
defaults and `optim_args` are transformers'. `tests/unit/recipe/test_optimizer_names.py` checks that
`TRANSFORMERS_OPTIMIZERS` plus `REFUSED` is exactly transformers' list, so the two cannot drift.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

OWN_OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")

TRANSFORMERS_OPTIMIZERS: tuple[str, ...] = (
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "adamw_anyprecision",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ademamix",
    "sgd",
    "adagrad",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "stable_adamw",
)

_LAYERWISE = (
    "steps each parameter inside backward (a gradient hook), so gradient accumulation, clipping, the "
    "nonfinite-step check and checkpoints of its state would all be skipped; use {base} (the same "
    "optimizer, stepped once per accumulation window)"
)
_LOMO = (
    "fuses the update into backward (its own fused_backward), so gradient accumulation, clipping and "
    "checkpoints of its state would be skipped; for low optimizer memory use adafactor, adamw_8bit or "
    "galore_adamw"
)
REFUSED: dict[str, str] = {
    "adamw_torch_xla": "runs on TPUs through torch_xla, which finetune does not launch; use adamw",
    "adamw_torch_npu_fused": "runs on Ascend NPUs through torch_npu, which finetune does not launch; use adamw",
    "galore_adamw_layerwise": _LAYERWISE.format(base="galore_adamw"),
    "galore_adamw_8bit_layerwise": _LAYERWISE.format(base="galore_adamw_8bit"),
    "galore_adafactor_layerwise": _LAYERWISE.format(base="galore_adafactor"),
    "apollo_adamw_layerwise": _LAYERWISE.format(base="apollo_adamw"),
    "lomo": _LOMO,
    "adalomo": _LOMO,
}
"""transformers' optimizer names that finetune's loop cannot run as they are meant, and why."""

OPTIMIZERS: tuple[str, ...] = OWN_OPTIMIZERS + TRANSFORMERS_OPTIMIZERS

LOW_RANK_OPTIMIZERS: tuple[str, ...] = tuple(
    n for n in TRANSFORMERS_OPTIMIZERS if n.startswith(("galore_", "apollo_"))
)
"""Optimizers that project the gradients of `train.optim_target_modules` (transformers needs them)."""

SCHEDULE_FREE_OPTIMIZERS: tuple[str, ...] = tuple(n for n in TRANSFORMERS_OPTIMIZERS if "schedule_free" in n)
"""Optimizers that replace the LR schedule (they need lr_decay_style: constant) and keep two weight
copies: the engine switches them to eval mode (optimizer.eval()) for evaluation and saving."""


MUON_ARGS: tuple[str, ...] = ("momentum", "nesterov", "ns_steps", "adjust_lr_fn")
"""The `train.optim_args` torch's Muon takes here (its lr and weight_decay are the train section's)."""


class Package(NamedTuple):
    module: str  # what importlib finds
    install: str  # the command that installs it


_BITSANDBYTES = Package("bitsandbytes", "pip install -e '.[qlora]'")
PACKAGES: dict[str, Package] = {
    **{
        n: _BITSANDBYTES
        for n in TRANSFORMERS_OPTIMIZERS
        if n.startswith(("paged_", "lion_", "rmsprop_bnb", "ademamix"))
        or n in ("adamw_bnb_8bit", "adamw_8bit")
    },
    **{n: Package("galore_torch", "pip install galore-torch") for n in LOW_RANK_OPTIMIZERS if "galore" in n},
    "apollo_adamw": Package("apollo_torch", "pip install apollo-torch"),
    **{n: Package("schedulefree", "pip install schedulefree") for n in SCHEDULE_FREE_OPTIMIZERS},
    "grokadamw": Package("grokadamw", "pip install grokadamw"),
    "stable_adamw": Package("optimi", "pip install torch-optimi"),
    "adamw_torch_4bit": Package("torchao", "pip install torchao"),
    "adamw_torch_8bit": Package("torchao", "pip install torchao"),
    "adamw_anyprecision": Package(
        "torchdistx", "pip install git+https://github.com/pytorch/torchdistx (builds against your torch)"
    ),
}
"""The package each optimizer needs beyond torch and transformers."""


def missing_package(name: str) -> str | None:
    """The install command for optimizer `name`'s package when it is not installed here, else None.

    >>> missing_package("adamw") is None
    True
    """
    package = PACKAGES.get(name)
    if package is None or importlib.util.find_spec(package.module) is not None:
        return None
    return package.install


def describe() -> str:
    """The choices, for the field's description (and so for `finetune validate --explain`)."""
    return (
        "adamw (torch AdamW, fused on CUDA), muon (torch's Muon on 2-D hidden weight matrices, AdamW on "
        "embeddings, output head, norms and biases; see docs/training.md), or one of transformers' optimizers, "
        "built by transformers with its defaults: "
        + ", ".join(TRANSFORMERS_OPTIMIZERS)
        + ". Not accepted: "
        + ", ".join(REFUSED)
        + " (the error says why)."
    )
