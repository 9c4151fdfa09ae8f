"""The recipe reference (docs/reference.md), generated from the schema itself.

Every section of `Recipe` becomes a table of its fields: name, type (with its allowed range), default
and the field's own description, the same text `finetune validate --explain` prints. A field that holds
a model (`model.special_tokens`) or a list of models (`data.datasets`, `eval.generation_sets`) gets its
own table below its section. A union of models discriminated by a field (dataset entries on `type`)
gets one table per member, after a table of the fields every member shares. Nothing here names a
section or a field: the page follows whatever the schema is when it runs, and tests/unit/test_docs.py
fails when docs/reference.md is behind it.

Run `make docs`, or `python -m finetune.recipe.reference docs/reference.md`; `--check` only compares.
Torch-free: this imports pydantic and the recipe package, nothing else.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

REGENERATE = "make docs  (or: python -m finetune.recipe.reference docs/reference.md)"
HEADER = (
    "# Recipe reference\n\n"
    "<!-- Generated from finetune/recipe by `make docs`; edit the field descriptions there, not this file. -->\n\n"
    "Every field of a recipe, section by section, with its type, default and description, as the schema "
    "defines them. `finetune validate recipe.yaml --explain` prints the same descriptions next to a resolved "
    "recipe. How a recipe is written, overridden and checked: [recipes.md](recipes.md). *Fixed on resume* "
    "marks a setting a resumed run may not change (it continues the checkpoint's optimizer, schedule, data "
    "order and model): [checkpoints.md](checkpoints.md).\n"
)

_UNION_TYPES = (typing.Union, types.UnionType)
# pydantic's constraint metadata (annotated_types) -> how the type column says it
_BOUNDS = (("ge", ">= "), ("gt", "> "), ("le", "<= "), ("lt", "< "), ("min_length", "at least "))


def reference_markdown(recipe_cls: type[BaseModel] | None = None) -> str:
    """The whole reference page for `recipe_cls` (default: finetune.recipe.schema.Recipe)."""
    if recipe_cls is None:
        from finetune.recipe.schema import Recipe

        recipe_cls = Recipe
    parts = [HEADER]
    sections = [(name, field) for name, field in recipe_cls.model_fields.items()]
    parts.append(
        "Sections: " + ", ".join(f"[`{name}`](#{heading_anchor(name)})" for name, _ in sections) + ".\n"
    )
    seen: dict[tuple, str] = {}
    for name, field in sections:
        models = _models_in(field.annotation)
        parts.append(f"## {name}\n")
        if field.description:
            parts.append(field.description + (" Required." if field.is_required() else "") + "\n")
        if not models:  # a plain value at the top level
            parts.append(_table([(name, field)]))
            continue
        for model in models:
            parts.extend(_model_tables(model, name, seen))
    return "\n".join(parts).rstrip("\n") + "\n"


def _model_tables(model: type[BaseModel], path: str, seen: dict[tuple, str]) -> list[str]:
    """The table of `model`'s fields at `path`, then one table per nested model or union below it
    (a model or union already shown at another path is a link to it: `seen`)."""
    out: list[str] = []
    doc = _own_doc(model)
    if doc:
        out.append(doc + "\n")
    out.append(_table(list(model.model_fields.items()), fixed=_fixed_on_resume(model)))
    out.extend(_nested_tables(model, path, seen))
    return out


def _nested_tables(model: type[BaseModel], path: str, seen: dict[tuple, str]) -> list[str]:
    """One table per field of `model` that holds a model or a union of models."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        models = _models_in(field.annotation)
        if not models:
            continue
        child = f"{path}.{name}" + ("[]" if _is_list(field.annotation) else "")
        key = tuple(models)
        if key in seen:
            out.append(f"### {child}\n")
            out.append(f"The same as [{seen[key]}](#{heading_anchor(seen[key])}).\n")
            continue
        seen[key] = child
        if len(models) == 1:
            out.append(f"### {child}\n")
            out.extend(_model_tables(models[0], child, seen))
        else:
            out.extend(_union_tables(child, field, models, seen))
    return out


def _union_tables(
    path: str, field: FieldInfo, models: list[type[BaseModel]], seen: dict[tuple, str]
) -> list[str]:
    """A table of the fields every member shares, then one table per member (its own fields)."""
    key = _discriminator(field) or ""
    shared = [
        name
        for name, info in models[0].model_fields.items()
        if name != key and all(_same_field(info, m.model_fields.get(name)) for m in models[1:])
    ]
    tags = {m: _tag(m, key) for m in models}
    out = [f"### {path}\n"]
    listing = ", ".join(f"[`{tags[m]}`](#{heading_anchor(f'{path} {key}: {tags[m]}')})" for m in models)
    out.append(
        f"One of {len(models)} kinds, chosen by `{key}`: {listing}. Fields every kind has:\n"
        if key
        else f"One of {len(models)} kinds. Fields every kind has:\n"
    )
    first = models[0].model_fields
    common = [(key, _key_field(models, key))] if key in first else []
    out.append(_table(common + [(n, first[n]) for n in shared]))
    for model in models:
        title = f"{path} {key}: {tags[model]}" if key else f"{path} ({model.__name__})"
        out.append(f"#### {title}\n")
        doc = _own_doc(model)
        if doc:
            out.append(doc + "\n")
        own = [(n, f) for n, f in model.model_fields.items() if n != key and n not in shared]
        out.append(_table(own) if own else "No fields beyond the shared ones.\n")
        out.extend(_nested_tables(model, title, seen))
    return out


def _key_field(models: list[type[BaseModel]], key: str) -> FieldInfo:
    """The discriminator as one field whose type lists every member's tag."""
    merged = copy.copy(models[0].model_fields[key])
    merged.annotation = typing.Literal[tuple(_tag(m, key) for m in models)]  # type: ignore[misc]
    return merged


def _fixed_on_resume(model: type[BaseModel]) -> set[str]:
    """The fields of a section that a resumed run may not change (finetune.recipe.resume's marks)."""
    from finetune.recipe.base import _Section
    from finetune.recipe.resume import fixed_fields

    return fixed_fields(model) if issubclass(model, _Section) else set()


def _table(fields: list[tuple[str, FieldInfo]], *, fixed: set[str] = frozenset()) -> str:
    """Fields as table rows; those in `fixed` say that a resumed run may not change them."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, info in fields:
        description = (info.description or "") + (" *Fixed on resume.*" if name in fixed else "")
        cells = (f"`{name}`", _type_text(info), _default_text(info), description)
        rows.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_text(info: FieldInfo) -> str:
    """The field's type in words, with the bounds its metadata sets (`int >= 1`)."""
    text = _annotation_text(info.annotation)
    bounds = []
    for meta in info.metadata:
        for attr, op in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                bounds.append(f"{op}{value}")
    if not bounds:
        return text
    return text + (" " if " " not in text else ", ") + ", ".join(bounds)


def _annotation_text(annotation: Any) -> str:
    """A short, readable form of a type: `'a' or 'b'`, `list of str`, `int or null`.

    >>> from typing import Literal
    >>> _annotation_text(Literal["drop", "truncate", "raise"] | None)
    "'drop', 'truncate', 'raise' or null"
    >>> _annotation_text(list[str] | Literal["all-linear"])
    "list of str or 'all-linear'"
    """
    parts = _alternatives(annotation)
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


def _alternatives(annotation: Any) -> list[str]:
    """The alternatives of a type in words, unions and Literals flattened; null last."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _alternatives(args[0])
    if origin is typing.Literal:
        return [f"'{a}'" if isinstance(a, str) else json.dumps(a) for a in args]
    if origin in _UNION_TYPES:
        if _models_in(annotation) and all(_models_in(a) for a in args if a is not type(None)):
            found = ["one of the entries below"]
        else:
            found = [p for a in args if a is not type(None) for p in _alternatives(a)]
        return found + (["null"] if type(None) in args else [])
    if origin in (list, tuple, set):
        if args and _models_in(args[0]):
            return ["list of entries (below)"]
        return [f"list of {_annotation_text(args[0])}" if args else "list"]
    if origin is dict:
        key, value = (_annotation_text(a) for a in args) if args else ("any", "any")
        return [f"mapping of {key} to {value}"]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ["section (below)"]
    if annotation is Any:
        return ["any"]
    return [getattr(annotation, "__name__", str(annotation))]


def _default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section defaults)"
    if isinstance(value, float) and (abs(value) >= 1e4 or 0 < abs(value) < 1e-3):
        return f"`{value:g}`"
    return f"`{json.dumps(value)}`" if not isinstance(value, str) else f"`{value}`"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field holds, through list, Optional, Union and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for model in _models_in(arg):
            if model not in found:
                found.append(model)
    return found


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated or origin in _UNION_TYPES:
        return any(_is_list(a) for a in typing.get_args(annotation))
    return origin in (list, tuple, set)


def _discriminator(field: FieldInfo) -> str | None:
    """The name of the field that tells a union's members apart, wherever pydantic keeps it."""

    def search(annotation: Any) -> str | None:
        if typing.get_origin(annotation) is typing.Annotated:
            for meta in typing.get_args(annotation)[1:]:
                key = getattr(meta, "discriminator", None)
                if isinstance(key, str):
                    return key
        for arg in typing.get_args(annotation):
            if (key := search(arg)) is not None:
                return key
        return None

    key = field.discriminator if isinstance(field.discriminator, str) else None
    return key or search(field.annotation)


def _tag(model: type[BaseModel], key: str) -> str:
    """The value of the discriminator that selects `model` (its Literal, else its default)."""
    info = model.model_fields.get(key)
    if info is None:
        return model.__name__
    args = typing.get_args(info.annotation)
    if typing.get_origin(info.annotation) is typing.Literal and args:
        return "/".join(str(a) for a in args)
    return str(info.get_default())


def _same_field(a: FieldInfo | None, b: FieldInfo | None) -> bool:
    return (
        a is not None
        and b is not None
        and a.annotation == b.annotation
        and a.description == b.description
        and _default_text(a) == _default_text(b)
    )


def _own_doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__") or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def heading_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes (a repeated
    heading gets -1, -2, ... after it; tests/unit/test_docs.py counts those).

    >>> heading_anchor("data.datasets[] type: alpaca")
    'datadatasets-type-alpaca'
    """
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.recipe.reference", description="Write the recipe reference page."
    )
    parser.add_argument("path", nargs="?", default="docs/reference.md", help="where to write it")
    parser.add_argument("--check", action="store_true", help="only say whether the file is current")
    args = parser.parse_args(argv)
    text = reference_markdown()
    path = Path(args.path)
    if args.check:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return 0
        print(f"{path} is not current with the recipe schema; regenerate it: {REGENERATE}", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
