"""Which recipe settings a resumed run may not change, read from the schema's marks.

A resumed run continues the checkpoint's optimizer state, LR schedule, data order and model: a new
lr or max_steps would be ignored or make the schedule jump. Each such field is marked in its section
(`Field(..., **FIXED_ON_RESUME)`, or a whole section with `fixed_on_resume = True` and exceptions
marked `**FREE_ON_RESUME`); the engine compares only what this module derives from those marks.

>>> rules = resume_rules()
>>> "lr" in rules["train"].fields and "eval_steps" not in rules["train"].fields
True
>>> rules["lora"].fields is None, "validation_prompts" in rules["diffusion"].free
(True, True)
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from pydantic import BaseModel

from finetune.recipe.base import _Section


@dataclass(frozen=True)
class SectionRule:
    """`fields`: the fixed fields of a section, or None for every field except `free`."""

    fields: tuple[str, ...] | None
    free: frozenset[str] = frozenset()


def _marked(field, value: bool) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("fixed_on_resume") is value


def fixed_fields(section: type[_Section]) -> set[str]:
    """The fields of `section` a resumed run may not change (its marks, or all but FREE_ON_RESUME)."""
    if section.fixed_on_resume:
        return {n for n, f in section.model_fields.items() if not _marked(f, False)}
    return {n for n, f in section.model_fields.items() if _marked(f, True)}


def _section_class(annotation) -> type[_Section] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, _Section):
            return candidate
    return None


def resume_rules(recipe_cls: type[BaseModel] | None = None) -> dict[str, SectionRule]:
    """{section name: its SectionRule} for every section with a fixed field."""
    if recipe_cls is None:
        from finetune.recipe.schema import Recipe

        recipe_cls = Recipe
    rules: dict[str, SectionRule] = {}
    for name, field in recipe_cls.model_fields.items():
        section = _section_class(field.annotation)
        if section is None:
            continue
        if section.fixed_on_resume:
            free = frozenset(n for n, f in section.model_fields.items() if _marked(f, False))
            rules[name] = SectionRule(None, free)
            continue
        fixed = tuple(n for n, f in section.model_fields.items() if _marked(f, True))
        if fixed:
            rules[name] = SectionRule(fixed)
    return rules


def _entries(before, after):
    """A checkpoint's dataset entries as the current schema writes them: before entries became one
    class per type, every entry listed every type's fields (at their defaults where unused); only the
    fields the current entry has are compared."""
    if not (isinstance(before, list) and isinstance(after, list) and len(before) == len(after)):
        return before
    if not all(isinstance(b, dict) and isinstance(a, dict) for b, a in zip(before, after, strict=True)):
        return before
    return [
        {k: b.get(k) for k in a} if b.get("type") == a.get("type") else b
        for b, a in zip(before, after, strict=True)
    ]


def changed_on_resume(saved: dict, now: dict) -> list[str]:
    """The fixed settings that differ between a checkpoint's resolved recipe and the recipe now, one
    line each (`section.field: old in the checkpoint, new now`)."""
    from finetune.recipe.moved import migrate

    saved, _ = migrate(saved)  # a checkpoint written before a setting moved compares at its new place
    changes = []
    for section, rule in resume_rules().items():
        before, after = saved.get(section) or {}, now.get(section) or {}
        names = rule.fields or sorted((set(before) | set(after)) - rule.free)
        for name in names:
            if _entries(before.get(name), after.get(name)) != after.get(name):
                changes.append(
                    f"{section}.{name}: {before.get(name)!r} in the checkpoint, {after.get(name)!r} now"
                )
    return changes
