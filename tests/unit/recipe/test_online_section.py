"""The online-RL section (`grpo`, shared by every online objective): the variants' defaults from the
objective table, and the rules that span its fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from finetune.recipe.defaults import resolve_defaults
from finetune.recipe.grpo import GrpoSection

REWARDS = [{"name": "length"}]


def test_a_variant_fills_its_section_defaults_and_keeps_what_the_user_wrote():
    written = {"train": {"objective": "rloo"}, "grpo": {"scale_rewards": "batch"}}
    assert resolve_defaults(written)["grpo"] == {
        "scale_rewards": "batch",
        "loss_type": "rloo",
        "kl_in_reward": True,
    }
    assert (
        resolve_defaults({"train": {"objective": "grpo"}, "grpo": {}})["grpo"] == {}
    )  # grpo's are the fields'
    assert "grpo" not in resolve_defaults({"train": {"objective": "rloo"}})  # a missing section is reported


@pytest.mark.parametrize(
    "fields, path, says",
    [
        ({"loss_type": "rloo", "beta": 0.1}, "kl_in_reward", "has no per-token KL term"),
        (
            {"loss_type": "rloo", "generation_backend": "vllm"},
            "vllm_importance_sampling_mode",
            "sequence_truncate",
        ),
        (
            {"vllm_importance_sampling_cap": 2.0},
            "vllm_importance_sampling_cap",
            "generation_backend: vllm only",
        ),
    ],
)
def test_settings_that_cannot_work_together_are_errors(fields, path, says):
    with pytest.raises(ValidationError, match=rf"{path}(.|\n)*{says}"):
        GrpoSection(rewards=REWARDS, **fields)


def test_valid_variants_pass():
    GrpoSection(rewards=REWARDS, loss_type="rloo", beta=0.1, kl_in_reward=True)
    GrpoSection(
        rewards=REWARDS,
        loss_type="rloo",
        generation_backend="vllm",
        vllm_importance_sampling_mode="sequence_mask",
    )
    GrpoSection(
        rewards=REWARDS, loss_type="dapo", beta=0.1, kl_in_reward=True
    )  # GRPO may pay its KL in the reward too


def test_validate_names_a_reward_file_that_does_not_exist(tmp_path):
    """`function: nope.py:f` is found beside the recipe or in the current folder; neither: a recipe error
    at validate, without importing anything."""
    import shutil
    from pathlib import Path

    from finetune.errors import RecipeError
    from finetune.recipe import load_recipe

    demo = Path(__file__).resolve().parents[3] / "recipes" / "demo"
    recipe = tmp_path / "grpo.yaml"
    shutil.copy(demo / "tiny_grpo_cpu.yaml", recipe)
    with pytest.raises(
        RecipeError, match=r"grpo\.rewards\[0\]\.function: got 'nope\.py:f': the file nope\.py does not exist"
    ):
        load_recipe(recipe, ["--grpo.rewards", "[{function: nope.py:f}]"])
    (tmp_path / "mine.py").write_text("def f(completions, rows):\n    return [0.0] * len(completions)\n")
    assert (
        load_recipe(recipe, ["--grpo.rewards", "[{function: mine.py:f}]"]).grpo.rewards[0].function
        == "mine.py:f"
    )
