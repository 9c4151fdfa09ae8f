"""The `reward` section: the settings of train.objective reward (a reward model trained on preference pairs).

The model is the base with a one-output score head (transformers' AutoModelForSequenceClassification,
num_labels 1); its loss is the Bradley-Terry loss of TRL's RewardTrainer. A pair's optional margin is
a data column (the preference entry's `field_margin`), not a setting here. Every field is fixed on
resume (it shapes the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import Field

from finetune.recipe.base import Problem, _Section
from finetune.recipe.lora import DATA_DRIVEN


class RewardSection(_Section):
    fixed_on_resume: ClassVar[bool] = True

    center_rewards_coefficient: float = Field(
        0.0,
        ge=0,
        description="Weight of the penalty on the mean of (r_chosen + r_rejected)^2, which keeps the rewards "
        "centred on 0 (Eisenstein et al. 2023; TRL's center_rewards_coefficient, 0.01 is typical; 0 = off).",
    )


def reward_problems(recipe: Any, ok: Callable[..., bool]) -> list[Problem]:
    """What train.objective reward cannot do, and the margin column's rules: a reward model scores, it
    does not generate (no eval.generation_sets); its scores are read by a forward hook, which torch.compile
    does not reliably run (no model.enable_compile); EVA and CorDA initialise from the causal LM's training
    batches, which a reward model's are not; `field_margin` is read by the reward objective only, and set
    on every preference entry or on none (pairs of all entries are batched together).

    >>> from types import SimpleNamespace as NS
    >>> recipe = NS(train=NS(objective="dpo"), data=NS(datasets=[NS(type="preference", field_margin="m")],
    ...     test_datasets=[]), eval=NS(generation_sets=[]), lora=NS(init_lora_weights=True))
    >>> reward_problems(recipe, lambda *paths: True)[0][0]
    'data.datasets.0.field_margin'
    """
    if not ok("train.objective"):
        return []
    reward = recipe.train.objective == "reward"
    problems: list[Problem] = []
    entries = [
        (f"data.{key}.{i}", entry)
        for key in ("datasets", "test_datasets")
        if ok(f"data.{key}")
        for i, entry in enumerate(getattr(recipe.data, key))
        if entry is not None and entry.type == "preference"
    ]
    with_margin = [path for path, entry in entries if entry.field_margin is not None]
    if not reward:
        problems += [
            (f"{path}.field_margin", entry.field_margin, "is read by train.objective reward only; remove it")
            for path, entry in entries
            if entry.field_margin is not None
        ]
    elif with_margin and len(with_margin) < len(entries):
        problems += [
            (
                f"{path}.field_margin",
                None,
                f"{with_margin[0]} has a margin column: set field_margin on every preference entry or on none "
                "(their pairs are batched together)",
            )
            for path, entry in entries
            if entry.field_margin is None
        ]
    if not reward:
        return problems
    if ok("eval.generation_sets") and recipe.eval.generation_sets:
        problems.append(
            (
                "eval.generation_sets",
                "...",
                "a reward model scores text, it does not generate: remove them (its held-out pairs are scored "
                "with data.val_set_size or data.test_datasets)",
            )
        )
    if ok("model.enable_compile") and recipe.model.enable_compile:
        problems.append(
            (
                "model.enable_compile",
                True,
                "a reward model's per-sequence scores are read from its score head by a forward hook, which a "
                "compiled graph does not reliably run: set it false",
            )
        )
    init = recipe.lora.init_lora_weights if ok("lora.init_lora_weights") else None
    if init in DATA_DRIVEN:
        problems.append(
            (
                "lora.init_lora_weights",
                init,
                "computes the adapter from a causal LM's training batches; train.objective reward trains a score "
                "head on pairs: use true, gaussian, pissa or olora",
            )
        )
    return problems
