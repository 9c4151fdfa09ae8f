"""Objectives: what is trained and how one micro-batch's loss is computed (the engine does the rest).

* `causal_lm`: SFT of a causal LM on prepared token rows (full, LoRA, QLoRA).
* `diffusion`: LoRA / DreamBooth on a diffusers pipeline's denoiser, from cached latents.
* `preference`: DPO, IPO, SimPO, ORPO and KTO of a causal LM on prepared pairs (train.objective).

Each is a class built from the recipe by the entry point (`objective_for`) that implements the
interface described in finetune/engine/__init__.py.
"""

from __future__ import annotations


def objective_for(recipe):
    """The objective a recipe asks for (model.kind, then train.objective)."""
    if recipe.model.kind == "diffusion":
        from finetune.objectives.diffusion import DiffusionObjective

        return DiffusionObjective(recipe)
    if recipe.train.objective != "sft":
        from finetune.objectives.preference import PreferenceObjective

        return PreferenceObjective(recipe)
    from finetune.objectives.causal_lm import CausalLMObjective

    return CausalLMObjective(recipe)
