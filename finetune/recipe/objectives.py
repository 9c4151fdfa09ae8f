"""The objectives a recipe can name in `train.objective`: one table, torch-free.

Everything that needs to know about an objective asks this table instead of keeping its own list:
the recipe validator (which dataset types it trains on, which settings it reads), `objective_for`
(which implementation runs it), `finetune eval` (whether the base model is its reference) and the
error messages. Adding an objective starts here (docs/CONTRIBUTING.md walks through the rest).

>>> OBJECTIVES["dpo"].kind, OBJECTIVES["dpo"].data_type, OBJECTIVES["dpo"].reference
('paired', 'preference', True)
>>> readers("preference.simpo_gamma")
('simpo',)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["sft", "paired", "unpaired", "online", "reward"]


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: what it trains on and what it reads.

    `kind` picks the implementation (finetune.objectives.objective_for): sft (next-token loss on
    any text type), paired (preference pairs: chosen and rejected completions of one prompt),
    unpaired (single completions labelled desirable or not), online (completions sampled from the
    model during training, scored by rewards), reward (a reward model: a score head trained on
    preference pairs). `data_type` is the dataset entry type it trains on
    (None: any text type). `unit` is what its loss is averaged over. `reference`: the loss compares
    the policy with a reference model (the base with adapters disabled, a frozen copy, or
    precomputed log-probs; grpo: only with grpo.beta > 0). `settings` are the recipe fields
    (section.field) only it reads: a non-default value under another objective is an error.
    `section` is the recipe section that holds all of its settings; only objectives that name it may
    have it (the online objectives share theirs). `estimator` (online objectives) names the advantage
    estimator of finetune.losses.policy_gradient.ESTIMATORS that turns rewards into advantages.
    `section_defaults` are the variant's defaults for fields of its section (filled in where the user
    wrote nothing, finetune.recipe.defaults; the resolved recipe shows them).
    """

    name: str
    kind: Kind
    data_type: str | None
    unit: Literal["tokens", "pairs", "examples", "completions"]
    reference: bool
    settings: tuple[str, ...]
    summary: str
    section: str | None = None
    estimator: str | None = None
    section_defaults: tuple[tuple[str, object], ...] = ()


_PREFERENCE = "preference"
OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        ObjectiveSpec(
            "sft", "sft", None, "tokens", False, ("train.loss_chunk_size",),
            "next-token cross-entropy on the trained tokens",
        ),
        ObjectiveSpec(
            "dpo", "paired", _PREFERENCE, "pairs", True,
            ("preference.beta", "preference.label_smoothing", "preference.dpo_smoothing",
             "preference.precompute_ref_log_probs"),
            "Direct Preference Optimization (Rafailov et al. 2023)",
        ),
        ObjectiveSpec(
            "ipo", "paired", _PREFERENCE, "pairs", True,
            ("preference.beta", "preference.precompute_ref_log_probs"),
            "Identity Preference Optimization (Azar et al. 2023)",
        ),
        ObjectiveSpec(
            "simpo", "paired", _PREFERENCE, "pairs", False,
            ("preference.beta", "preference.label_smoothing", "preference.simpo_gamma"),
            "Simple Preference Optimization, reference-free (Meng et al. 2024)",
        ),
        ObjectiveSpec(
            "orpo", "paired", _PREFERENCE, "pairs", False,
            ("preference.beta", "preference.orpo_nll_reduction"),
            "Odds-Ratio Preference Optimization, reference-free (Hong et al. 2024)",
        ),
        ObjectiveSpec(
            "kto", "unpaired", "kto", "examples", True,
            ("preference.beta", "preference.kto_desirable_weight", "preference.kto_undesirable_weight",
             "preference.precompute_ref_log_probs"),
            "Kahneman-Tversky Optimization on examples labelled desirable or not (Ethayarajh et al. 2024)",
        ),
        ObjectiveSpec(
            "grpo", "online", "prompt", "completions", False, (),
            "Group Relative Policy Optimization with verifiable rewards (Shao et al. 2024), and TRL's "
            "DAPO / Dr. GRPO / BNPO loss types",
            section="grpo", estimator="group",
        ),
        ObjectiveSpec(
            "rloo", "online", "prompt", "completions", False, (),
            "REINFORCE Leave-One-Out (Ahmadian et al. 2024): each reward against the mean of the others of its "
            "group, one clipped ratio per completion, the KL to the reference paid out of the reward (TRL's "
            "RLOOTrainer)",
            section="grpo", estimator="leave_one_out",
            section_defaults=(("loss_type", "rloo"), ("scale_rewards", "none"), ("kl_in_reward", True)),
        ),
        ObjectiveSpec(
            "reinforce_pp", "online", "prompt", "completions", False, (),
            "REINFORCE++-baseline (Hu et al. 2025, OpenRLHF's reinforce_baseline): each reward against its "
            "group's mean, whitened over the step's completion tokens, PPO's clipped token loss, the KL to the "
            "reference paid out of the reward",
            section="grpo", estimator="whitened",
            section_defaults=(("scale_rewards", "batch"), ("kl_in_reward", True)),
        ),
        ObjectiveSpec(
            "reward", "reward", _PREFERENCE, "pairs", False, ("reward.center_rewards_coefficient",),
            "A reward model: a one-output score head on the base, trained on preference pairs with the "
            "Bradley-Terry loss (TRL's RewardTrainer); a GRPO reward afterwards (grpo.rewards[].model)",
        ),
    )
}  # fmt: skip

ObjectiveName = Literal[tuple(OBJECTIVES)]  # type: ignore[valid-type]
"""The names of OBJECTIVES, as the schema's type of train.objective."""


def readers(setting: str) -> tuple[str, ...]:
    """The objectives that read `setting` (a `section.field` path), in table order."""
    return tuple(name for name, spec in OBJECTIVES.items() if setting in spec.settings)


def objective_settings() -> tuple[str, ...]:
    """Every setting some objective reads (and the others must leave at its default)."""
    return tuple(dict.fromkeys(s for spec in OBJECTIVES.values() for s in spec.settings))


def describe(names: tuple[str, ...] | list[str]) -> str:
    """`a, b or c` for messages.

    >>> describe(["dpo", "ipo", "kto"])
    'dpo, ipo or kto'
    """
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def sharing_section(section: str) -> tuple[str, ...]:
    """The objectives whose settings live in recipe section `section`."""
    return tuple(name for name, spec in OBJECTIVES.items() if spec.section == section)


def trained_on(data_type: str) -> tuple[str, ...]:
    """The objectives that train on dataset entries of `data_type`."""
    return tuple(name for name, spec in OBJECTIVES.items() if spec.data_type == data_type)
