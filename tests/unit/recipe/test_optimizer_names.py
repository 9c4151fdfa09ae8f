"""finetune.recipe.optimizers: train.optimizer's choices are transformers' optimizer names (minus the ones
refused, each with its reason) plus adamw and muon; validation names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from transformers.training_args import OptimizerNames

from finetune.errors import RecipeError
from finetune.recipe import load_recipe, optimizers, recipe_warnings, validate_recipe

MINIMAL = {
    "model": {"model_path": "org/base"},
    "data": {"datasets": [{"path": "data/a.jsonl", "type": "alpaca"}]},
    "train": {"output_dir": "out"},
}


def test_the_torch_free_list_is_transformers_list_minus_the_refused():
    theirs = {name.value for name in OptimizerNames}
    assert set(optimizers.TRANSFORMERS_OPTIMIZERS) == theirs - set(optimizers.REFUSED)
    assert set(optimizers.REFUSED) <= theirs
    assert len(optimizers.OPTIMIZERS) == len(set(optimizers.OPTIMIZERS))


def test_every_package_entry_is_transformers_own_dependency():
    """The package named for a missing optimizer is the one transformers imports for it."""
    from transformers import trainer_optimizer

    source = Path(trainer_optimizer.__file__).read_text()
    for name, package in optimizers.PACKAGES.items():
        assert name in optimizers.TRANSFORMERS_OPTIMIZERS
        assert f"import {package.module}" in source or f"from {package.module}" in source, name


def _recipe(**train):
    return validate_recipe({**MINIMAL, "train": {**MINIMAL["train"], **train}})


def _refused(tmp_path, **train) -> str:
    """The RecipeError message `finetune validate` prints for a recipe with these train fields."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "train": {**MINIMAL["train"], **train}}))
    with pytest.raises(RecipeError) as error:
        load_recipe(path)
    return str(error.value)


@pytest.mark.parametrize(
    "name", ["paged_adamw_8bit", "adafactor", "lion_32bit", "muon", "schedule_free_adamw"]
)
def test_transformers_and_own_names_validate(name):
    style = {"lr_decay_style": "constant"} if "schedule_free" in name else {}
    assert _recipe(optimizer=name, **style).train.optimizer == name


def test_a_refused_name_says_why(tmp_path):
    message = _refused(tmp_path, optimizer="lomo")
    assert (
        "train.optimizer" in message and "lomo is not supported: it fuses the update into backward" in message
    )


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        (
            {"optimizer": "galore_adamw"},
            "galore_adamw projects the gradients of the modules it names: set optim_target_modules",
        ),
        (
            {"optimizer": "schedule_free_adamw", "lr_decay_style": "cosine"},
            "replaces the LR schedule (its warmup is lr_warmup_ratio): set lr_decay_style: constant",
        ),
        (
            {"optimizer": "muon", "optim_args": {"rank": 4}},
            "muon reads momentum, nesterov, ns_steps, adjust_lr_fn, not rank",
        ),
        ({"optimizer": "sgd", "optim_args": {"momentum": "0.5,x=1"}}, "cannot hold a comma"),
    ],
)
def test_optimizer_combinations_that_cannot_work_are_errors(tmp_path, train, expected):
    assert expected in _refused(tmp_path, **train)


def test_a_missing_package_is_a_warning_at_validate(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "galore_torch" else real(n, *a)
    )
    recipe = _recipe(optimizer="galore_adamw", optim_target_modules="all-linear")
    assert any("pip install galore-torch" in line for line in recipe_warnings(recipe))
