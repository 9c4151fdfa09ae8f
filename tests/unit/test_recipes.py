"""Every recipe shipped under recipes/ validates, and so does its resolved form."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from finetune.accelerate_config import resolve_accelerate_config
from finetune.recipe import load_recipe, recipe_to_dict, validate_recipe

REPO_ROOT = Path(__file__).resolve().parents[2]
# lm_eval_tasks/ folders hold lm-eval task YAMLs (eval.lm_eval.include_path), not recipes.
RECIPES = sorted(
    p
    for pattern in ("*.yaml", "*.yml")
    for p in (REPO_ROOT / "recipes").rglob(pattern)
    if "lm_eval_tasks" not in p.parts
)
LM_EVAL_TASKS = sorted((REPO_ROOT / "recipes").rglob("lm_eval_tasks/*.yaml"))


def test_recipes_are_found() -> None:
    assert REPO_ROOT / "recipes" / "demo" / "tiny_sft_cpu.yaml" in RECIPES


@pytest.mark.parametrize("path", LM_EVAL_TASKS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shipped_lm_eval_tasks_load_offline_in_lm_eval(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shipped lm-eval task loads through lm-eval's own TaskManager from the repository root (its
    data_files are relative to it), offline, with its rows read."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'finetune[eval]'")
    from finetune.evaluation.harness import HarnessSettings, check_tasks, offline

    monkeypatch.chdir(REPO_ROOT)
    settings = HarnessSettings(tasks=(path.stem,), include_path=(str(path.parent.relative_to(REPO_ROOT)),))
    manager, specs = check_tasks(settings)
    with offline(True):
        task = manager.load(specs)["tasks"][path.stem]
    docs = list(task.test_docs())
    assert docs, f"{path}: the test split is empty"
    assert "####" in task.doc_to_target(docs[0])  # GSM8K-format answers, as the task's filters expect


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
