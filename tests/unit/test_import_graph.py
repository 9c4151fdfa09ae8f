"""No import cycles in finetune/: a module never imports one that imports it back (docs/CONTRIBUTING.md).

The graph is built from the source with ast, counting every import (module level and inside
functions alike: a function-level import only postpones a cycle, it does not remove it). A package
counts as importing its submodules' importers only through its own `__init__.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "finetune"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the finetune modules it imports (`from a.b import c` counts a.b.c when that is a module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join([package.rsplit(".", node.level - 1)[0], base]).strip(".")
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_finetune_has_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "finetune.engine.loop" in graph["finetune.train"] or "finetune.engine" in graph["finetune.train"]
    assert "finetune.errors" in graph["finetune.recipe.load"]


# The layers of finetune/, top to bottom (docs/CONTRIBUTING.md): a module imports only modules of its
# own layer or below. A package's modules share its layer; `finetune` (the package __init__) is below all.
LAYERS: list[tuple[str, ...]] = [
    ("cli", "train", "evaluation", "report"),
    ("objectives",),
    ("engine", "generation"),
    ("diffusion", "plan"),
    ("data",),
    (
        "model", "model_card", "optim", "checkpoint", "hub", "metrics", "distributed", "accelerate_config",
        "launcher", "losses",
    ),
    ("recipe",),
    ("gguf", "errors", "notices", "quiet", "constants", "trackers", "locks"),
]  # fmt: skip


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the finetune package itself
        return len(LAYERS)
    for index, names in enumerate(LAYERS):
        if parts[1] in names:
            return index
    raise AssertionError(
        f"{module} is in no layer: add finetune/{parts[1]} to LAYERS (and to CONTRIBUTING.md)"
    )


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) < layer_of(a))


def test_every_import_points_down_or_sideways():
    arrows = upward_arrows(import_graph())
    assert not arrows, "imports that point up the layers:\n  " + "\n  ".join(arrows)


def test_the_layer_check_sees_a_planted_upward_arrow():
    assert upward_arrows({"finetune.recipe.load": {"finetune.engine.loop"}}) == [
        "finetune.recipe.load -> finetune.engine.loop"
    ]
    assert upward_arrows({"finetune.engine.loop": {"finetune.recipe.load"}}) == []


# The wings inside a package, top to bottom (docs/CONTRIBUTING.md, the package's row): a module of a
# wing imports only modules of its own wing or the wings below it in that package. The package's own
# modules outside any wing (its __init__) are below every wing.
INNER_LAYERS: dict[str, list[tuple[str, ...]]] = {
    "data": [("prepare",), ("batching",), ("formats",), ("sources",)],
}


def wing_of(module: str) -> tuple[str, int] | None:
    """(package, index of its wing in INNER_LAYERS) of a module of a package with wings, else None."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in INNER_LAYERS:
        return None
    wings = INNER_LAYERS[parts[1]]
    if len(parts) == 2:  # the package's __init__
        return parts[1], len(wings)
    for index, names in enumerate(wings):
        if parts[2] in names:
            return parts[1], index
    raise AssertionError(
        f"{module} is in no wing of finetune.{parts[1]}: put it in one, or add its wing to INNER_LAYERS "
        "(and to CONTRIBUTING.md)"
    )


def upward_wing_arrows(graph: dict[str, set[str]]) -> list[str]:
    arrows = []
    for a, targets in graph.items():
        if (wing_a := wing_of(a)) is None:
            continue
        for b in targets:
            wing_b = wing_of(b)
            if wing_b is not None and wing_b[0] == wing_a[0] and wing_b[1] < wing_a[1]:
                arrows.append(f"{a} -> {b}")
    return sorted(arrows)


def test_every_import_inside_a_package_points_down_or_sideways_its_wings():
    graph = import_graph()
    assert any(wing_of(m) == ("data", 3) for m in graph)  # the wings exist: the check is not empty
    arrows = upward_wing_arrows(graph)
    assert not arrows, "imports that point up a package's wings:\n  " + "\n  ".join(arrows)


def test_the_wing_check_sees_a_planted_upward_arrow():
    assert upward_wing_arrows({"finetune.data.sources.readers": {"finetune.data.formats.rows"}}) == [
        "finetune.data.sources.readers -> finetune.data.formats.rows"
    ]
    assert upward_wing_arrows({"finetune.data.formats.rows": {"finetune.data.sources.damage"}}) == []
    assert upward_wing_arrows({"finetune.data.formats.tokenize": {"finetune.data.formats.registry"}}) == []
    assert upward_wing_arrows({"finetune.data.formats.rows": {"finetune.data"}}) == []  # the package: below
    assert (
        upward_wing_arrows({"finetune.data.prepare.build": {"finetune.model.build"}}) == []
    )  # not its wings
    with pytest.raises(AssertionError, match=r"in no wing of finetune\.data"):
        upward_wing_arrows({"finetune.data.stray": {"finetune.data.sources.location"}})


def _package(module: str) -> str:
    """The top-level package under finetune/ (`engine` for finetune.engine.loop; "" for finetune)."""
    return module.split(".")[1] if "." in module else ""


def test_engine_and_generation_do_not_import_each_other():
    graph = import_graph()
    crossing = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if {_package(a), _package(b)} == {"engine", "generation"}
    ]
    assert not crossing, crossing
