"""No load path in finetune unpickles arbitrary objects: checkpoints, prepared data and outputs are
input that whoever can write the folder (or a Hub repo) controls. Read from the package's source, so
that a new torch.load or pickle.load is caught when it is written.

Allowed: torch.load with weights_only=True (tensors and plain values), safetensors, JSON, Arrow.
Refused: pickle/dill/cloudpickle/joblib loads, torch.load without weights_only=True, any
weights_only=False, numpy's allow_pickle=True, and accelerate's register_for_checkpointing (which
pickles the object's state and loads it with weights_only=False).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"
PICKLERS = {"pickle", "dill", "cloudpickle", "joblib", "_pickle"}


def _name(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain or a name, else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _is_true(value: ast.AST | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is True


def _is_false(value: ast.AST | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is False


def _unsafe(call: ast.Call) -> list[str]:
    name = _name(call.func)
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    if name.split(".")[0] in PICKLERS and name.split(".")[-1] in {"load", "loads", "Unpickler"}:
        return [name]
    if name.endswith("register_for_checkpointing"):
        return ["register_for_checkpointing (pickled, loaded with weights_only=False)"]
    if name.endswith("torch.load") and not _is_true(keywords.get("weights_only")):
        return ["torch.load without weights_only=True"]
    if "weights_only" in keywords and not _is_true(keywords["weights_only"]):
        return [f"{name} with weights_only not True"]
    if "allow_pickle" in keywords and not _is_false(keywords["allow_pickle"]):
        return [f"{name} with allow_pickle"]
    return []


def unsafe_loads(source: str) -> list[tuple[int, str]]:
    """(line, what) for every call in `source` that could unpickle arbitrary objects.

    >>> unsafe_loads("import torch\\ntorch.load(f)\\ntorch.load(f, weights_only=True)")
    [(2, 'torch.load without weights_only=True')]
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            found += [(node.lineno, what) for what in _unsafe(node)]
    return found


def test_the_scan_finds_each_kind_of_unsafe_load():
    source = """
import pickle, torch, numpy as np
pickle.load(f)
torch.load(f, weights_only=False)
np.load(f, allow_pickle=True)
accelerator.register_for_checkpointing(ema)
torch.load(f, weights_only=True)
"""
    assert [line for line, _ in unsafe_loads(source)] == [3, 4, 5, 6]


def test_no_module_of_the_package_unpickles():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, what in unsafe_loads(path.read_text())
    ]
    assert not found, "loads that can run code from a file:\n" + "\n".join(found)
