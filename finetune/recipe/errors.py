"""Turn a pydantic ValidationError into one message listing every recipe problem.

Each line names the YAML path (`data.datasets[1].type`), the source line when known, the bad
value, what is allowed, and a did-you-mean for misspelled keys.
"""

from __future__ import annotations

import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from finetune.recipe.base import tagged_members
from finetune.recipe.overrides import _unwrap, did_you_mean

_LITERAL = re.compile(r"Input should be (.*)$")


class _Walk(typing.NamedTuple):
    path: tuple
    owner: type[BaseModel] | None
    union_at: int | None
    tagged: tuple[str, dict[str, type[BaseModel]]] | None


def _schema_walk(root: type[BaseModel], loc: tuple) -> _Walk:
    """Keep the loc parts that are real keys (fields, list indexes, dict keys); drop union tags.

    Returns the cleaned path, the model class that owns the last key (for did-you-mean), the length
    the path had at the first plain union (None when there was none): errors below that point are
    one union member's complaint about the value at that path, and the tag and members of the last
    tagged union passed (a dataset entry's type and the entry classes), whose errors are the
    member's own.
    """
    path: list = []
    annotation: Any = root
    owner: type[BaseModel] | None = root
    union_at: int | None = None
    tagged: tuple[str, dict[str, type[BaseModel]]] | None = None
    for part in loc:
        members = tagged_members(annotation)
        if members is not None:
            annotation, tagged = members.get(str(part)), (str(part), members)
            continue
        alternatives = [a for a in _unwrap(annotation) if a is not type(None)]
        if len(alternatives) > 1:
            # pydantic names the union member that failed: 'str', 'list[str]', "literal['x']"...
            union_at = len(path) if union_at is None else union_at
            annotation = _member(alternatives, str(part))
            continue
        annotation = alternatives[0] if alternatives else None
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(part, str):
            owner = annotation
            field = owner.model_fields.get(part)
            annotation = field.annotation if field else None
        elif origin is list and isinstance(part, int):
            annotation = typing.get_args(annotation)[0]
        elif origin is dict and part != "[key]":
            annotation = typing.get_args(annotation)[1]
        elif part == "[key]":  # the key itself of a dict entry was invalid
            continue
        else:
            annotation = None
        path.append(part)
    return _Walk(tuple(path), owner, union_at, tagged)


def _member(alternatives: list, tag: str) -> Any:
    """The union member a pydantic loc tag names, where it matters for the path below it."""
    for alt in alternatives:
        origin = typing.get_origin(alt)
        if isinstance(alt, type) and issubclass(alt, BaseModel) and tag == alt.__name__:
            return alt
        if (origin is list and tag.startswith("list[")) or (origin is dict and tag.startswith("dict[")):
            return alt
    return None


def yaml_path(path: tuple) -> str:
    """('data', 'datasets', 1, 'type') -> 'data.datasets[1].type'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<recipe>"


def split_path(dotted: str) -> tuple:
    """'data.datasets.1.type' -> ('data', 'datasets', 1, 'type')."""
    return tuple(int(p) if p.isdigit() else p for p in dotted.split(".")) if dotted else ()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _expected(err: dict) -> str:
    """What one error says was expected: "'a', 'b' or 'c'", 'a valid integer', ..."""
    literal = _LITERAL.match(err["msg"]) if err["type"] == "literal_error" else None
    if literal:
        return literal.group(1)
    msg = err["msg"]
    for prefix in ("Value error, ", "Input should be "):
        msg = msg[len(prefix) :] if msg.startswith(prefix) else msg
    return msg


def _describe(err: dict, walk: _Walk) -> str:
    kind, path, owner = err["type"], walk.path, walk.owner
    if kind == "extra_forbidden":
        allowed = list(owner.model_fields) if owner else []
        key = str(path[-1])
        if readers := _read_by_others(key, walk):
            hint = f": {readers}."
        elif close := did_you_mean(key, allowed + _other_fields(walk)):
            readers = "" if close in allowed else _read_by_others(close, walk)
            hint = f"; did you mean '{close}'?{f' ({readers})' if readers else ''}"
        else:
            hint = ""
        return f"unknown key (value {_show(err['input'])}){hint} Allowed keys: {', '.join(allowed)}"
    if kind == "missing":
        field = owner.model_fields.get(str(path[-1])) if owner and path else None
        desc = f" ({field.description})" if field and field.description else ""
        return f"required field is missing{desc}"
    if kind == "literal_error":
        hint = ""
        if isinstance(err["input"], bool):
            hint = " (YAML reads unquoted yes/no/on/off/true/false as booleans: quote the value)"
        return f"got {_show(err['input'])}; allowed: {_expected(err)}{hint}"
    msg = err["msg"]
    msg = msg[len("Value error, ") :] if msg.startswith("Value error, ") else msg
    return f"got {_show(err['input'])}: {msg}"


def _readers(key: str, walk: _Walk) -> list[str]:
    """The other members of the tagged union passed (other dataset types) that have the field `key`."""
    if walk.tagged is None:
        return []
    tag, members = walk.tagged
    return [name for name, model in members.items() if name != tag and key in model.model_fields]


def _other_fields(walk: _Walk) -> list[str]:
    """The fields of the tagged union's members (every dataset type), for did-you-mean."""
    if walk.tagged is None:
        return []
    return list(dict.fromkeys(name for model in walk.tagged[1].values() for name in model.model_fields))


def _read_by_others(key: str, walk: _Walk) -> str:
    """For a field of other dataset types: which types read it, and why not this one when its class
    says (`not_read`, finetune.recipe.formats); '' for any other key."""
    readers = _readers(key, walk)
    if not readers:
        return ""
    why = getattr(walk.owner, "not_read", {}).get(key)
    return f"only type {', '.join(readers)} read it, not {walk.tagged[0]}{f' ({why})' if why else ''}"


def _union_message(value: Any, members: list[tuple[tuple, dict]]) -> str:
    """One line for a value that no member of a union accepted."""
    expected = []
    for below, err in members:
        # Keep only the gist of long pydantic messages ("a valid integer, unable to parse ...").
        text = _expected(err).split(", ")[0] if err["type"] != "literal_error" else _expected(err)
        expected.append(f"{yaml_path(below)}: {text}" if below else text)
    return f"got {_show(value)}; expected {' or '.join(dict.fromkeys(expected))}"


def format_validation_error(
    exc: ValidationError,
    root: type[BaseModel],
    *,
    source: str = "recipe",
    lines: dict | None = None,
    extra: list[tuple[str, Any, str]] | tuple = (),
    origins: dict[tuple, str] | None = None,
) -> str:
    """One message with every problem, in recipe order.

    `lines` maps key paths to YAML line numbers (yaml_io.key_lines); `origins` maps key paths set
    by command-line overrides to the flag (`--train.seed`), which is shown instead of a line;
    `extra` adds cross-field problems found outside pydantic, as (dotted path, value, message).
    """
    found: list[tuple[tuple, str]] = []
    unions: dict[tuple, list[tuple[tuple, dict]]] = {}
    for err in exc.errors():
        walk = _schema_walk(root, tuple(err["loc"]))
        path, union_at = walk.path, walk.union_at
        if err["type"] == "combination":
            for sub_path, value, message in err["ctx"]["problems"]:
                found.append(((*path, *split_path(sub_path)), f"got {_show(value)}: {message}"))
        elif union_at is not None:
            unions.setdefault(path[:union_at], []).append((path[union_at:], err))
        else:
            found.append((path, _describe(err, walk)))
    for path, members in unions.items():
        # pydantic gives each member error the input at its own loc: take the whole value from a
        # member that rejected it as a whole.
        value = next((err["input"] for below, err in members if not below), members[0][1]["input"])
        found.append((path, _union_message(value, members)))
    for dotted, value, message in extra:
        found.append((split_path(dotted), f"got {_show(value)}: {message}"))

    origins = origins or {}
    order = {path: i for i, path in enumerate(lines or {})}
    entries = [(_sort_key(path, order, origins), _where(path, lines, origins), msg) for path, msg in found]
    entries.sort(key=lambda entry: entry[0])
    out = [f"{source}: {len(entries)} problem(s) in the recipe:"]
    out += [f"  - {where}: {message}" for _, where, message in entries]
    return "\n".join(out)


def _origin(path: tuple, origins: dict[tuple, str]) -> tuple | None:
    """The override (or the override of an enclosing key) that set `path`, if any."""
    probe = path
    while probe:
        if probe in origins:
            return probe
        probe = probe[:-1]
    return None


def _known_prefix(path: tuple, lines: dict | None) -> tuple | None:
    probe = path
    while probe and probe not in (lines or {}):
        probe = probe[:-1]
    return probe or None


def _sort_key(path: tuple, order: dict, origins: dict[tuple, str]) -> tuple:
    """File problems in the order of their keys in the file, then overrides in command-line order."""
    origin = _origin(path, origins)
    if origin is not None:
        return (1, list(origins).index(origin))
    known = _known_prefix(path, order)
    return (0, order[known]) if known else (2, 0)


def _where(path: tuple, lines: dict | None, origins: dict[tuple, str]) -> str:
    key = yaml_path(path)
    origin = _origin(path, origins)
    if origin is not None:
        return f"{key} (from {origins[origin]})"
    known = _known_prefix(path, lines)
    if known is None:
        return key
    if known == path:
        return f"{key} (line {lines[known]})"
    # Not in the file (a default, or a missing field): point at the enclosing key.
    return f"{key} (not set; {yaml_path(known)} at line {lines[known]})"
