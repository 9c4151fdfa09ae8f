"""Every `>>>` example in finetune/ runs and shows what it says (one test per module that has any)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
    if ">>>" in p.read_text(encoding="utf-8")
)


def test_modules_with_examples_are_found():
    assert "finetune.recipe.defaults" in MODULES and len(MODULES) >= 9


@pytest.mark.parametrize("name", MODULES)
def test_examples(name: str):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0, f"{name} has `>>>` text but no example doctest can run"
    assert result.failed == 0
