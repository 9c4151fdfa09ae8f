"""`--section.field value` overrides, applied to the raw recipe mapping before validation.

Values are parsed as YAML (so `true`, `null`, `[a, b]`, `3e-5` come out typed) and paths are
checked against the recipe schema, so a misspelled override fails loudly with a did-you-mean
instead of being dropped by validation of a key nobody reads.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel

from finetune.errors import RecipeError
from finetune.recipe.yaml_io import parse_yaml


def parse_override_args(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--a.b', 'v', '--c.d=w'] into [('a.b', 'v'), ('c.d', 'w')].

    >>> parse_override_args(["--train.lr", "3e-5", "--lora.enable_lora=true"])
    [('train.lr', '3e-5'), ('lora.enable_lora', 'true')]
    """
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise RecipeError(f"unexpected argument {arg!r}: overrides look like --section.field value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            # A following `--x` is the next option, not this one's value (`-1` is a value).
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
                raise RecipeError(f"override --{key} has no value: write --{key} VALUE or --{key}=VALUE")
            value = args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def did_you_mean(word: str, names: list[str]) -> str | None:
    """The name `word` most likely misspells: a close match, else the one name it abbreviates.

    >>> did_you_mean("lrr", ["lr", "lr_min", "seed"])
    'lr'
    >>> did_you_mean("pad", ["bos_token", "pad_token"])
    'pad_token'
    """
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if close:
        return close[0]
    longer = [name for name in names if word and word.lower() in name.lower()]
    return longer[0] if len(longer) == 1 else None


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of a (possibly Optional/Union, possibly Annotated) annotation."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _unwrap(arg)]
    return [annotation]


def _step(annotation: Any, part: str, path: str, shown: str) -> tuple[str | int, Any]:
    """Resolve one path part below a value of type `annotation`; return (key, child annotation).

    Below a union of models (a dataset entry: one class per type) a field of any member is
    accepted: the value's type is not known here, and validation names the types that read a field.
    """
    models = [alt for alt in _unwrap(annotation) if isinstance(alt, type) and issubclass(alt, BaseModel)]
    if models:
        fields = {name: f for model in models for name, f in model.model_fields.items()}
        if part in fields:
            return part, fields[part].annotation
        close = did_you_mean(part, list(fields))
        hint = f"; did you mean '{f'{shown}.' if shown else ''}{close}'?" if close else ""
        raise RecipeError(
            f"unknown override --{path}: '{part}' is not a field of {shown or 'the recipe'}{hint} "
            f"(fields: {', '.join(fields)})"
        )
    for alt in _unwrap(annotation):
        origin = typing.get_origin(alt)
        if origin is list:
            if not part.isdigit():
                raise RecipeError(
                    f"unknown override --{path}: {shown} is a list; use an index like {shown}.0"
                )
            return int(part), typing.get_args(alt)[0]
        if origin is dict:
            return part, typing.get_args(alt)[1]
    if annotation is Any:  # inside free-form data (an inline model config): any nesting goes
        return part, Any
    raise RecipeError(f"unknown override --{path}: {shown} is a single value, it has no field '{part}'")


def _resolve(path: str, root: type[BaseModel]) -> tuple[list[str | int], Any]:
    """The parts of a dotted override path and the annotation of the value it sets."""
    parts = path.split(".")
    if not all(parts):
        raise RecipeError(f"unknown override --{path}: empty part in the dotted path")
    out: list[str | int] = []
    annotation: Any = root
    for depth, part in enumerate(parts):
        key, annotation = _step(annotation, part, path, ".".join(parts[:depth]))
        out.append(key)
    return out, annotation


def check_path(path: str, root: type[BaseModel]) -> list[str | int]:
    """Validate a dotted override path against the schema; return its parts (ints for list items).

    >>> from finetune.recipe import Recipe
    >>> check_path("data.datasets.0.path", Recipe)
    ['data', 'datasets', 0, 'path']
    """
    return _resolve(path, root)[0]


def override_paths(overrides: list[str], root: type[BaseModel]) -> dict[tuple, str]:
    """Map the key path each override sets, e.g. ('train', 'seed'), to its flag `--train.seed`.

    Lets error messages say where a bad value came from. Call it after apply_overrides succeeded.
    """
    return {tuple(check_path(key, root)): f"--{key}" for key, _ in parse_override_args(overrides)}


def _is_text_only(annotation: Any) -> bool:
    """Whether a field takes only strings (or null): str, str | None, Literal['a', 'b'], ..."""
    alternatives = [a for a in _unwrap(annotation) if a is not type(None)]
    if not alternatives:
        return False
    for alt in alternatives:
        if typing.get_origin(alt) is typing.Literal:
            if not all(isinstance(v, str) for v in typing.get_args(alt)):
                return False
        elif alt is not str:
            return False
    return True


def parse_value(raw: str, annotation: Any, *, source: str) -> Any:
    """Parse an override value as YAML; for a text-only field a non-text result keeps the raw text.

    YAML turns `no` into False, `1234` into an int and rejects `{% if ... %}`, but
    `--train.mixed_precision no`, `--model.revision 1234` and a Jinja `--model.chat_template`
    mean the text as typed. `null` still means null.

    >>> parse_value("3e-5", float, source="--train.lr")
    3e-05
    >>> parse_value("no", typing.Literal["bf16", "fp16", "no"], source="--train.mixed_precision")
    'no'
    """
    if raw == "":
        return ""
    text_only = _is_text_only(annotation)
    try:
        value = parse_yaml(raw, source=source)
    except RecipeError:
        if text_only:
            return raw
        raise
    if text_only and value is not None and not isinstance(value, str):
        return raw
    return value


def _set(data: dict, parts: list[str | int], value: Any, path: str) -> None:
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        nxt = parts[depth + 1]
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                size = len(node) if isinstance(node, list) else 0
                raise RecipeError(
                    f"override --{path}: list {'.'.join(map(str, parts[:depth]))} has {size} item(s); "
                    f"index {part} does not exist"
                )
            if node[part] is None:
                node[part] = {}
            node = node[part]
            continue
        if not isinstance(node, dict):
            raise RecipeError(f"override --{path}: {'.'.join(map(str, parts[:depth]))} is not a mapping")
        if node.get(part) is None:
            node[part] = [] if isinstance(nxt, int) else {}
        node = node[part]
    last = parts[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last > len(node):
            size = len(node) if isinstance(node, list) else 0
            raise RecipeError(f"override --{path}: the list has {size} item(s); index {last} does not exist")
        if last == len(node):
            node.append(value)
        else:
            node[last] = value
    else:
        if not isinstance(node, dict):
            raise RecipeError(f"override --{path}: {'.'.join(map(str, parts[:-1]))} is not a mapping")
        node[last] = value


def apply_overrides(data: dict, overrides: list[str], root: type[BaseModel]) -> dict:
    """Return a copy of `data` with the CLI overrides applied (values parsed as YAML).

    Every bad override (unknown path, bad index, bad YAML) is reported in one RecipeError.
    """
    data, problems, _ = apply_valid_overrides(data, overrides, root)
    if len(problems) == 1:
        raise RecipeError(problems[0])
    if problems:
        raise RecipeError(f"{len(problems)} bad overrides:\n" + "\n".join(f"  - {p}" for p in problems))
    return data


def apply_valid_overrides(
    data: dict, overrides: list[str], root: type[BaseModel]
) -> tuple[dict, list[str], list[str]]:
    """(a copy of `data` with the overrides that could be applied, one message per override that
    could not, the applied ones as argument words): a misspelled override is reported together with
    the recipe's other problems instead of hiding them."""
    data = copy.deepcopy(data)
    problems: list[str] = []
    applied: list[str] = []
    for key, raw in parse_override_args(overrides):
        try:
            parts, annotation = _resolve(key, root)
            _set(data, parts, parse_value(raw, annotation, source=f"--{key}"), key)
            applied += [f"--{key}", raw]
        except RecipeError as exc:
            problems.append(str(exc))
    return data, problems, applied
