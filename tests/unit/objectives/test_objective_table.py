"""The objective table (finetune.recipe.objectives) against what implements it: every entry has an
implementation (one class per kind, which owns its `finetune eval` path), a loss, a data type the recipe
knows, an advantage estimator where it is online, and settings the schema has."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from finetune.losses import policy_gradient as pg
from finetune.objectives import IMPLEMENTATIONS
from finetune.objectives.preference_scores import LOSSES
from finetune.recipe import DataSection, Recipe, TrainSection, validate_recipe
from finetune.recipe.grpo import GrpoSection
from finetune.recipe.objectives import OBJECTIVES, objective_settings, readers

SPECS = list(OBJECTIVES.values())


def _dataset_types() -> set[str]:
    entry = DataSection.model_fields["datasets"].annotation
    found: set[str] = set()

    def walk(annotation) -> None:
        if typing.get_origin(annotation) is typing.Literal:
            found.update(typing.get_args(annotation))
        for arg in typing.get_args(annotation):
            walk(arg)
        fields = getattr(annotation, "model_fields", {})
        if "type" in fields:
            walk(fields["type"].annotation)

    walk(entry)
    return found


def test_the_schema_offers_exactly_the_table():
    assert set(typing.get_args(TrainSection.model_fields["objective"].annotation)) == set(OBJECTIVES)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_objective_has_an_implementation_a_loss_data_and_an_eval_path(spec):
    assert spec.kind in IMPLEMENTATIONS
    implementation = IMPLEMENTATIONS[spec.kind]()
    assert callable(getattr(implementation, "loss", None))
    assert callable(getattr(implementation, "held_out", None)), f"{spec.name}: `finetune eval` has no path"
    if spec.kind in ("paired", "unpaired"):
        assert spec.name in LOSSES, f"{spec.name}: no loss in finetune.objectives.preference_scores.LOSSES"
    if spec.kind == "online":  # every loss type the section offers is one of the policy-gradient losses
        offered = typing.get_args(GrpoSection.model_fields["loss_type"].annotation)
        assert set(offered) == set(pg.UNITS)
        assert spec.estimator in pg.ESTIMATORS, f"{spec.name}: no advantage estimator {spec.estimator!r}"
        assert spec.section is not None
    else:
        assert spec.estimator is None
    assert spec.data_type is None or spec.data_type in _dataset_types()


@pytest.mark.parametrize("setting", objective_settings())
def test_every_objective_setting_is_a_recipe_field(setting):
    section, name = setting.split(".")
    annotation = Recipe.model_fields[section].annotation
    cls = next(a for a in (annotation, *typing.get_args(annotation)) if hasattr(a, "model_fields"))
    assert name in cls.model_fields
    assert readers(setting)


def test_losses_name_only_table_objectives():
    assert set(LOSSES) == {s.name for s in SPECS if s.kind in ("paired", "unpaired")}


def _recipe(objective: str, data_type: str, **preference) -> dict:
    recipe = {
        "model": {"model_path": "org/base"},
        "data": {"datasets": [{"path": "p.jsonl", "type": data_type}]},
        "train": {"output_dir": "out", "objective": objective, "micro_batch_size": 8},
        "preference": preference,
    }
    if OBJECTIVES[objective].section:
        recipe[OBJECTIVES[objective].section] = {"rewards": [{"name": "format", "pattern": "####"}]}
    return recipe


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_each_objective_takes_its_data_type_and_refuses_others(spec):
    wanted = spec.data_type or "completion"
    validate_recipe(_recipe(spec.name, wanted))
    other = "completion" if spec.data_type else "preference"
    with pytest.raises(ValidationError, match=r"data\.datasets\.0\.type"):
        validate_recipe(_recipe(spec.name, other))


def test_a_setting_of_another_objective_is_an_error_naming_its_readers():
    with pytest.raises(ValidationError, match=r"simpo_gamma: belongs to train.objective simpo, not 'dpo'"):
        validate_recipe(_recipe("dpo", "preference", simpo_gamma=1.0))
    validate_recipe(_recipe("simpo", "preference", simpo_gamma=1.0))
