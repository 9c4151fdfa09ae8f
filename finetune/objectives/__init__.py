"""Objectives: what is trained and how one micro-batch's loss is computed (the engine does the rest).

* `sft`: SFT of a causal LM on prepared token rows (full, LoRA, QLoRA).
* `preference`: DPO, IPO, SimPO, ORPO and KTO of a causal LM on prepared pairs (examples).
* `online`: online RL (GRPO and its DAPO / Dr. GRPO / BNPO loss types) of a causal LM on prompts, with
  rewards; `rollout`, its sample / score / pack / log-prob parts, open to any objective.
* `reward`: a reward model (a one-output score head) trained on prepared pairs with TRL's Bradley-Terry
  loss; a GRPO reward afterwards (finetune.generation.reward_model).
* `diffusion`: LoRA / DreamBooth on a diffusers pipeline's denoiser, from cached latents
  (model.kind: diffusion).
* `lm`: the causal-LM toolkit the LM objectives share (build, loader, save); `reference`: the
  reference model any objective can compare its policy with.

Which objectives exist, what they train on and what they read is the objective table,
finetune.recipe.objectives; each kind is one class implementing the interface in
finetune/engine/objective.py (built by `objective_for` from the whole recipe), which also owns its
held-out evaluation for `finetune eval` (`held_out(recipe, prepared)`, a static method).
"""

from __future__ import annotations

from finetune.recipe.objectives import OBJECTIVES


# The implementation of each objective kind of the table, imported on use: building one objective
# never imports another's dependencies (diffusers for an LLM run).
def _sft():
    from finetune.objectives.sft import SFTObjective

    return SFTObjective


def _preference():
    from finetune.objectives.preference import PreferenceObjective

    return PreferenceObjective


def _online():
    from finetune.objectives.online import OnlineObjective

    return OnlineObjective


def _reward():
    from finetune.objectives.reward import RewardObjective

    return RewardObjective


def _diffusion():
    from finetune.objectives.diffusion import DiffusionObjective

    return DiffusionObjective


IMPLEMENTATIONS = {
    "sft": _sft,
    "paired": _preference,
    "unpaired": _preference,
    "online": _online,
    "reward": _reward,
    "diffusion": _diffusion,
}


def objective_class(recipe):
    """The class of the objective a recipe asks for: model.kind diffusion, else train.objective's kind."""
    kind = "diffusion" if recipe.model.kind == "diffusion" else OBJECTIVES[recipe.train.objective].kind
    return IMPLEMENTATIONS[kind]()


def objective_for(recipe):
    """The objective a recipe asks for, built from the whole recipe."""
    return objective_class(recipe)(recipe)
