"""Tools in the loop, as a recipe writes them: `grpo.tools` (any online objective), and a generation
set's `tools` (eval.generation_sets[].tools). finetune.generation.tools runs them.

```yaml
tools:
  - function: calc.py:calculate       # a function beside the recipe (or module:function)
    trigger: '<<([^<>=]*)='           # inline: fn(*groups) where the text ends with a match
    close: '>>'                       #   str(result) + close is inserted
  - function: tools.py:get_weather    # no trigger: a chat tool call in the template's own format
max_tool_calls: 4
tool_timeout_s: 10
```

`function_problems` checks the functions without importing them (importing runs the user's code):
the file exists beside the recipe or in the current folder, defines the function, an inline tool's
function takes its trigger's groups, a chat tool's has the type hints and docstring its schema is
made from, and an environment is a class with reset and step. `finetune validate` reports them with
the recipe's other problems; the run imports the functions at start and checks again.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import Field

from finetune.recipe.base import Problem, Regex, _Section

TIMEOUT_DEFAULT, MAX_CALLS_DEFAULT = 10.0, 4


class ToolSpec(_Section):
    """One tool the model may call while it generates."""

    function: str = Field(
        description="The tool: `path/to/file.py:function` (a relative file beside the recipe first, then in the "
        "current folder) or `module:function`. Inline: called as function(*groups) with the trigger's groups "
        "(strings); chat: with the call's arguments by name. Its str(result) is what the model reads; an "
        "exception becomes `error: ...`.",
    )
    trigger: Regex | None = Field(
        None,
        description="An inline call: where the generated text ends with a match of this regex (checked at every "
        "token) generation pauses, the function runs with the match's groups, and str(result) + close is "
        "inserted (GSM8K's calculator: '<<([^<>=]*)='). null: a chat tool, called in the chat template's own "
        "tool-call format (Qwen, Llama 3.1, Mistral), its schema made from the function's type hints and "
        "docstring (transformers' get_json_schema).",
    )
    close: str | None = Field(
        None, description="Inline calls: the text inserted after the result ('>>'); null = nothing."
    )

    @property
    def name(self) -> str:
        return self.function.rpartition(":")[2]

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if ok("function"):
            module, _, attr = self.function.rpartition(":")
            if not module or not attr.isidentifier():
                problems.append(
                    ("function", self.function, "write it as path/to/file.py:function or module:function")
                )
        if ok("trigger", "close") and self.trigger is None and self.close is not None:
            problems.append(
                ("close", self.close, "is inserted after inline results only: give a trigger, or remove it")
            )
        return problems


def tools_problems(
    tools: Sequence[ToolSpec | None], max_tool_calls: int, tool_timeout_s: float, ok, *, environment=None
) -> list[Problem]:
    """A section's rules for its tools: chat tools' names unique (the model calls them by name), and
    max_tool_calls / tool_timeout_s set only where something calls tools."""
    problems: list[Problem] = []
    if not ok("tools"):
        return problems
    chat = [t.name for t in tools if t is not None and t.trigger is None]
    for name in sorted({n for n in chat if chat.count(n) > 1}):
        problems.append(("tools", name, "two chat tools have the same name; the model calls them by name"))
    if not tools and environment is None:
        for field, value, default in (
            ("max_tool_calls", max_tool_calls, MAX_CALLS_DEFAULT),
            ("tool_timeout_s", tool_timeout_s, TIMEOUT_DEFAULT),
        ):
            if ok(field) and value != default:
                problems.append((field, value, "is read when there are tools; add tools, or remove it"))
    return problems


def max_tool_calls_field() -> int:
    return Field(
        MAX_CALLS_DEFAULT,
        ge=1,
        description="Tool calls per completion (an environment: turns it answers); a call past them gets an "
        "`error: ...` result.",
    )


def tool_timeout_field() -> float:
    return Field(
        TIMEOUT_DEFAULT,
        gt=0,
        description="Seconds a tool call may take; a hung tool is stopped (its process killed) and the model "
        "reads an error result.",
    )


def tools_field(where: str) -> list[ToolSpec]:
    return Field(
        default_factory=list,
        description=f"Tools the model calls while it generates {where}: inline (a trigger regex) or chat tools "
        "(the template's call format); results are inserted and never trained (docs/objectives.md, tools).",
    )


# ------------------------------------------------------------------------- static function checks


def function_problems(recipe, folder: Path) -> list[str]:
    """`path: problem` lines for the recipe's tool and environment functions (see the module docstring);
    `folder` is the recipe's. Functions in modules (module:function) and anything the source alone cannot
    tell (a function made at import) are checked when the run imports them."""
    found: list[tuple[str, ToolSpec | None, str]] = []  # (path, spec, function)
    grpo = getattr(recipe, "grpo", None)
    if grpo is not None:
        found += [(f"grpo.tools[{i}].function", t, t.function) for i, t in enumerate(grpo.tools)]
        if grpo.environment is not None:
            found.append(("grpo.environment", None, grpo.environment))
    for k, gen_set in enumerate(recipe.eval.generation_sets):
        found += [
            (f"eval.generation_sets[{k}].tools[{i}].function", t, t.function)
            for i, t in enumerate(gen_set.tools)
        ]
    problems = []
    for path, spec, function in found:
        problem = static_problem(function, spec, folder)
        if problem is not None:
            problems.append(f"{path}: got {function!r}: {problem}")
    return problems


def static_problem(function: str, spec: ToolSpec | None, folder: Path) -> str | None:
    module, _, attr = function.rpartition(":")
    if not module.endswith(".py"):
        return None
    candidates = [Path(module)] if Path(module).is_absolute() else [folder / module, Path.cwd() / module]
    file = next((c for c in candidates if c.is_file()), None)
    if file is None:
        looked = " or ".join(str(c) for c in dict.fromkeys(candidates))
        return f"the file {module} does not exist (looked for {looked}); give the path relative to the recipe's folder (finetune chat --tool: the current folder)"
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (SyntaxError, UnicodeDecodeError) as exc:
        return f"{file} cannot be read as Python: {exc}"
    node = _top_level(tree, attr)
    if node is None:
        return f"{file} defines no {attr!r} at its top level"
    if spec is None:  # an environment
        if isinstance(node, ast.ClassDef):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            missing = [m for m in ("reset", "step") if m not in methods]
            if missing and not node.bases:
                return f"the environment class has no {' or '.join(missing)} method (reset(row), step(text))"
        return None
    if not isinstance(node, ast.FunctionDef):
        return None  # a class, an alias or a function made at import: checked when imported
    if spec.trigger is not None:
        groups = re.compile(spec.trigger).groups
        if not _takes(node.args, groups):
            return (
                f"the trigger {spec.trigger!r} has {groups} group{'s' * (groups != 1)}, so the tool is called with "
                f"{groups} argument{'s' * (groups != 1)}, which {attr}({ast.unparse(node.args)}) cannot take"
            )
        return None
    names = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]]
    untyped = [
        a.arg
        for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        if a.annotation is None
    ]
    if ast.get_docstring(node) is None or untyped:
        what = "docstring" if ast.get_docstring(node) is None else f"type hints for {', '.join(untyped)}"
        return (
            f"a chat tool's schema is made from its type hints and docstring (transformers' get_json_schema), and "
            f"{attr}({', '.join(names)}) has no {what}; add them, or give the tool a trigger (an inline call)"
        )
    return None


def _top_level(tree: ast.Module, name: str) -> ast.AST | None:
    """The top-level statement that binds `name` (a def, a class, an assignment or an import)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
        imported = isinstance(node, ast.Import | ast.ImportFrom) and node.names
        if imported and any((a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
    return None


def _takes(args: ast.arguments, count: int) -> bool:
    """Whether a def's arguments take `count` positional arguments."""
    positional = [*args.posonlyargs, *args.args]
    required = len(positional) - len(args.defaults)
    required_kw = [a for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None]
    return not required_kw and required <= count and (count <= len(positional) or args.vararg is not None)
