"""Recipe settings that moved to another section: old recipes keep working, with a warning.

The preference objectives' settings lived in `train` until they got their own `preference`
section. A recipe (or a `--train.beta` override, or a checkpoint's resolved recipe) that still
puts them in `train` is read as if it said `preference`, and the user is told where they live now.
A recipe that sets both places is an error: which one was meant cannot be known.

>>> data, notes = migrate({"train": {"objective": "dpo", "beta": 0.2}})
>>> data["preference"], notes
({'beta': 0.2}, ['train.beta moved to preference.beta: write it there (read from train this time)'])
"""

from __future__ import annotations

import copy
from typing import Any

from finetune.errors import RecipeError

MOVED: dict[str, str] = {
    f"train.{name}": f"preference.{name}"
    for name in (
        "beta",
        "label_smoothing",
        "dpo_smoothing",
        "simpo_gamma",
        "orpo_nll_reduction",
        "kto_desirable_weight",
        "kto_undesirable_weight",
        "precompute_ref_log_probs",
    )
}


def migrate(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a copy of the raw recipe mapping with moved settings at their new place, one note per move)."""
    data = copy.deepcopy(data)
    notes = []
    for old, new in MOVED.items():
        old_section, name = old.split(".")
        new_section, new_name = new.split(".")
        source = data.get(old_section)
        if not isinstance(source, dict) or name not in source:
            continue
        target = data.get(new_section)
        if target is None:
            target = data[new_section] = {}
        if not isinstance(target, dict):
            continue  # the section's own type error is reported by validation
        if new_name in target:
            raise RecipeError(f"{old} and {new} are both set: {old} moved to {new}; remove {old}")
        target[new_name] = source.pop(name)
        notes.append(f"{old} moved to {new}: write it there (read from {old_section} this time)")
    return data, notes


def migrate_override(path: str) -> str:
    """An override's dotted path at its new place (`train.beta` -> `preference.beta`)."""
    return MOVED.get(path, path)


def migrate_override_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`--train.beta 0.2` (or `--train.beta=0.2`) as `--preference.beta ...`, with a note per move.

    >>> migrate_override_args(["--train.beta=0.2", "--train.lr", "1e-4"])[0]
    ['--preference.beta=0.2', '--train.lr', '1e-4']
    """
    out, notes = [], []
    for arg in args:
        if arg.startswith("--"):
            path, sep, value = arg[2:].partition("=")
            if path in MOVED:
                notes.append(
                    f"--{path} moved to --{MOVED[path]}: write it there (read from {path} this time)"
                )
                arg = f"--{MOVED[path]}{sep}{value}"
        out.append(arg)
    return out, notes
