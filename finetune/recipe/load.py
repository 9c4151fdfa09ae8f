"""Loading a recipe: YAML -> overrides -> defaults -> validation, with every problem reported at once."""

from __future__ import annotations

import functools
import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from finetune.errors import RecipeError
from finetune.recipe.base import Problem, _Section, tagged_members, union_member
from finetune.recipe.defaults import resolve_defaults
from finetune.recipe.schema import Recipe


def _overlaps(name: str, bad: str) -> bool:
    """Whether the field `name` is, contains or lies inside the invalid path `bad`."""
    return not bad or name == bad or name.startswith(bad + ".") or bad.startswith(name + ".")


@functools.cache
def _field_adapter(cls: type[BaseModel], name: str) -> TypeAdapter:
    field = cls.model_fields[name]
    return TypeAdapter(Annotated[field.annotation, field])


def _model_class(annotation: Any) -> type[_Section] | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional section
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Section) else None


def _salvage(cls: type[_Section], data: Any, errors: list[tuple[tuple, str]]) -> tuple[Any, set[str], list]:
    """Validate what can be validated of a section that failed, and run the rules pydantic skipped.

    pydantic runs a model's after-validators only when all its fields validated, so a typo in
    `train` would hide `lr_min > lr` until the next run. This walks the failed section with its
    errors (`(loc, type)`, loc relative to `data`), builds a partial instance from the fields that
    did validate, and runs `_problems` with `ok` false for the invalid ones. Returns (partial
    instance or None, dotted paths of the invalid fields, problems not reported yet).
    """
    if not isinstance(data, dict) or any(not loc and kind != "combination" for loc, kind in errors):
        return None, {""}, []
    values: dict[str, Any] = {}
    bad = {name for name, field in cls.model_fields.items() if field.is_required() and name not in data}
    problems: list[Problem] = []

    def adopt(prefix: str, sub_bad: set[str], sub_problems: list[Problem]) -> None:
        bad.update(f"{prefix}.{b}" if b else prefix for b in sub_bad)
        problems.extend((f"{prefix}.{path}", value, msg) for path, value, msg in sub_problems)

    for name, value in data.items():
        field = cls.model_fields.get(name)
        sub = [(loc[1:], kind) for loc, kind in errors if loc and loc[0] == name]
        annotation = field.annotation if field else None
        item_type = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None
        if field is None:
            bad.add(name)
        elif not sub:
            try:
                values[name] = _field_adapter(cls, name).validate_python(value)
            except ValidationError:
                bad.add(name)
        elif _model_class(annotation):
            values[name], sub_bad, sub_problems = _salvage(_model_class(annotation), value, sub)
            adopt(name, sub_bad, sub_problems)
        elif (
            (_model_class(item_type) or tagged_members(item_type))
            and isinstance(value, list)
            and all(loc and isinstance(loc[0], int) for loc, _ in sub)
        ):
            items = []
            for i, item in enumerate(value):
                item_errors = [(loc[1:], kind) for loc, kind in sub if loc[0] == i]
                instance, sub_bad, sub_problems = _salvage_item(item_type, item, item_errors)
                items.append(instance)
                adopt(f"{name}.{i}", sub_bad, sub_problems)
            values[name] = items
        else:
            bad.add(name)
    instance = cls.model_construct(**{k: v for k, v in values.items() if v is not None or k not in bad})
    if not any(not loc for loc, _ in errors):  # else its rules ran, and their problems are reported
        problems += instance._problems(lambda *names: not any(_overlaps(n, b) for n in names for b in bad))
    return instance, bad, problems


def _salvage_item(item_type: Any, item: Any, errors: list[tuple[tuple, str]]) -> tuple[Any, set[str], list]:
    """`_salvage` of one list item: a model, or the member of a tagged union (a dataset entry, whose
    errors carry the member's tag first) that the item validates as."""
    item_cls = _model_class(item_type)
    if item_cls is None:
        item_cls = union_member(item_type, item)
        if item_cls is None or any(not loc for loc, _ in errors):  # not a mapping: nothing to salvage
            return None, {""}, []
        errors = [(loc[1:], kind) for loc, kind in errors]
    if not errors:
        return item_cls.model_validate(item), set(), []
    return _salvage(item_cls, item, errors)


# ---------------------------------------------------------------------------------------- loading


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `--section.field value` overrides and validate.

    The steps, in order: read the YAML, apply the overrides, fill the defaults that depend on other
    fields (finetune.recipe.defaults), validate. Raises RecipeError with every problem listed (path,
    bad value, what is allowed, and where it came from: the recipe line or the override).
    """
    from finetune.recipe.errors import format_validation_error
    from finetune.recipe.moved import migrate, migrate_override_args
    from finetune.recipe.overrides import apply_valid_overrides, override_paths
    from finetune.recipe.yaml_io import key_lines, read_yaml

    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with sections model, data, train, lora, hub")
    data, moved = migrate(data)
    overrides, moved_overrides = migrate_override_args(list(overrides))
    data, bad_overrides, applied = apply_valid_overrides(data, overrides, Recipe)
    data = resolve_defaults(data)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        _, _, skipped = _salvage(Recipe, data, [(tuple(e["loc"]), e["type"]) for e in exc.errors()])
        message = format_validation_error(
            exc,
            Recipe,
            source=str(path),
            lines=key_lines(Path(path).read_text(encoding="utf-8")),
            extra=skipped,
            origins=override_paths(applied, Recipe),
        )
        if bad_overrides:
            message += "\n" + "\n".join(f"  - {problem}" for problem in bad_overrides)
        raise RecipeError(message) from None
    if len(bad_overrides) == 1:
        raise RecipeError(bad_overrides[0])
    if bad_overrides:
        raise RecipeError(
            f"{len(bad_overrides)} bad overrides:\n" + "\n".join(f"  - {p}" for p in bad_overrides)
        )
    from finetune.recipe.grpo import function_file_problems

    missing = function_file_problems(recipe.grpo, Path(path).resolve().parent)
    if missing:
        raise RecipeError(
            f"{path}: {len(missing)} problem(s):\n" + "\n".join(f"  - {problem}" for problem in missing)
        )
    recipe.moved_settings = [*moved, *moved_overrides]
    recipe._source_path = str(Path(path).resolve())
    from finetune.recipe.tools import function_problems

    unusable = function_problems(recipe, Path(path).resolve().parent)  # read, not imported
    if unusable:
        raise RecipeError(f"{path}: {len(unusable)} problem(s):\n" + "\n".join(f"  - {p}" for p in unusable))
    return recipe


def recipe_warnings(recipe: Recipe) -> list[str]:
    """What the recipe asks for that works but is probably not what was meant, one line each
    (`path: message`), from every section's `_warnings` and the cross-section ones."""
    found: list[str] = list(recipe.moved_settings)

    def walk(node: BaseModel, prefix: str) -> None:
        found.extend(f"{prefix}{path} ({value!r}): {message}" for path, value, message in node._warnings())
        for name in type(node).model_fields:
            value = getattr(node, name)
            if isinstance(value, _Section):
                walk(value, f"{prefix}{name}.")
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, _Section):
                        walk(item, f"{prefix}{name}[{i}].")

    walk(recipe, "")
    return found


def validate_recipe(data: dict[str, Any]) -> Recipe:
    """A recipe from a mapping already in memory: moved settings and defaults filled in, then validated
    (raises pydantic's ValidationError; `load_recipe` formats it for people)."""
    from finetune.recipe.moved import migrate

    data, moved = migrate(data)
    recipe = Recipe.model_validate(resolve_defaults(data))
    recipe.moved_settings = moved
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data (every default filled in), for recipe.resolved.yaml."""
    return recipe.model_dump(mode="json")
