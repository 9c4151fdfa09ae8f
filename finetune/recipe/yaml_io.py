"""YAML reading and writing for recipes.

PyYAML implements YAML 1.1, where `3e-5` (no dot) is a string. Recipes and CLI overrides are
written by people who expect `lr: 3e-5` to be a number, so the loader adds a float resolver for
that form. Everything else is plain `yaml.SafeLoader`.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from finetune.errors import RecipeError


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5`, `3E+4` and `.5e3` as floats and rejects duplicate keys.

    PyYAML keeps the last of two equal keys, so a second `lr:` (or a second `train:` section)
    would silently replace the first.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # SafeLoader reports unhashable keys itself
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {first_line[key]})",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, *, source: str = "<string>") -> Any:
    """Parse YAML text; syntax errors become RecipeError with the file, line and column."""
    try:
        return yaml.load(text, Loader=RecipeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{where}: invalid YAML: {problem}") from None


def read_yaml(path: Path) -> Any:
    """Read a YAML file; a missing file or bad syntax is a RecipeError naming the file."""
    if not path.is_file():
        hint = " (it is a directory)" if path.is_dir() else ""
        raise RecipeError(f"recipe file not found: {path}{hint}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe file {path}: {exc}") from None
    return parse_yaml(text, source=str(path))


def key_lines(text: str) -> dict[tuple, int]:
    """Map each key path in a YAML document, e.g. ('data', 'datasets', 1, 'type'), to its 1-based line.

    Used to point error messages at the line of the offending key. Returns {} on bad YAML.
    """
    try:
        root = yaml.compose(text, Loader=RecipeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[tuple, int] = {}
    active: set[int] = set()  # nodes on the current path: a recursive alias (&a [*a]) loops

    def walk(node, prefix: tuple) -> None:
        if id(node) in active:
            return
        active.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = (*prefix, key.value)
                lines[path] = key.start_mark.line + 1
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*prefix, i)] = item.start_mark.line + 1
                walk(item, (*prefix, i))
        active.discard(id(node))

    if root is not None:
        walk(root, ())
    return lines


def dump_yaml(data: Any) -> str:
    """Dump plain data as block-style YAML, keys in their defined order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
