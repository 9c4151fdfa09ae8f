"""Every recipe shipped under recipes/ validates, and so does its resolved form."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from finetune.accelerate_config import resolve_accelerate_config
from finetune.recipe import load_recipe, recipe_to_dict, validate_recipe

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for pattern in ("*.yaml", "*.yml") for p in (REPO_ROOT / "recipes").rglob(pattern))


def test_recipes_are_found() -> None:
    assert REPO_ROOT / "recipes" / "demo" / "tiny_sft_cpu.yaml" in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_recipe_validates(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # recipes name their files relative to the repository root
    model_path = str(yaml.safe_load(path.read_text())["model"].get("model_path"))
    if model_path.startswith("package://"):  # a model shipped in a Python package must be installed
        package = model_path.removeprefix("package://").split("/")[0]
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{model_path} needs the {package} package installed (see the recipe's header)")
    recipe = load_recipe(path)
    # The resolved recipe (written next to every run's outputs) must load back unchanged.
    assert validate_recipe(recipe_to_dict(recipe)) == recipe
    # Local files the recipe ships with must exist.
    for entry in [*recipe.data.datasets, *recipe.data.test_datasets]:
        if entry.path.startswith("recipes/"):
            assert (REPO_ROOT / entry.path).exists(), entry.path
    tokenizer = recipe.model.tokenizer_source
    if tokenizer and tokenizer.startswith("recipes/"):
        assert (REPO_ROOT / tokenizer).is_dir(), tokenizer
    if recipe.train.accelerate_config:
        assert resolve_accelerate_config(recipe.train.accelerate_config).is_file()
