"""Settings that moved (train.beta -> preference.beta, ...): read at the old place with a warning,
from the YAML, from overrides and from a checkpoint's resolved recipe; both places at once is an error."""

from __future__ import annotations

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import load_recipe, recipe_warnings
from finetune.recipe.moved import MOVED
from finetune.recipe.resume import changed_on_resume

RECIPE = {
    "model": {"model_path": "org/base"},
    "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
    "train": {"output_dir": "out", "objective": "dpo"},
}


def _write(tmp_path, data: dict):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_old_place_in_the_yaml_is_read_with_a_warning(tmp_path):
    data = {**RECIPE, "train": {**RECIPE["train"], "beta": 0.3, "precompute_ref_log_probs": True}}
    recipe = load_recipe(_write(tmp_path, data))
    assert recipe.preference.beta == 0.3 and recipe.preference.precompute_ref_log_probs is True
    warnings = recipe_warnings(recipe)
    assert "train.beta moved to preference.beta: write it there (read from train this time)" in warnings
    assert any("precompute_ref_log_probs" in w for w in warnings)
    assert "beta" not in recipe.model_dump()["train"]


def test_an_old_override_is_read_with_a_warning(tmp_path):
    recipe = load_recipe(_write(tmp_path, RECIPE), ["--train.beta", "0.4", "--train.label_smoothing=0.1"])
    assert (recipe.preference.beta, recipe.preference.label_smoothing) == (0.4, 0.1)
    assert any(w.startswith("--train.beta moved to --preference.beta") for w in recipe_warnings(recipe))


def test_both_places_is_an_error(tmp_path):
    data = {**RECIPE, "train": {**RECIPE["train"], "beta": 0.3}, "preference": {"beta": 0.2}}
    with pytest.raises(RecipeError, match=r"train\.beta and preference\.beta are both set"):
        load_recipe(_write(tmp_path, data))


def test_a_new_recipe_has_no_notes(tmp_path):
    recipe = load_recipe(_write(tmp_path, {**RECIPE, "preference": {"beta": 0.2}}))
    assert recipe.moved_settings == [] and recipe.preference.beta == 0.2


def test_a_checkpoint_written_before_the_move_resumes_when_nothing_changed(tmp_path):
    recipe = load_recipe(_write(tmp_path, {**RECIPE, "preference": {"beta": 0.2}}))
    now = recipe.model_dump(mode="json")
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in now.items()}
    old["train"].update(old.pop("preference"))  # how a checkpoint's resolved recipe looked before
    assert changed_on_resume(old, now) == []
    old["train"]["beta"] = 0.5
    assert changed_on_resume(old, now) == ["preference.beta: 0.5 in the checkpoint, 0.2 now"]


def test_every_move_lands_on_a_field_of_the_new_section():
    from finetune.recipe import Recipe

    for old, new in MOVED.items():
        section, name = new.split(".")
        assert name in Recipe.model_fields[section].annotation.model_fields, old
