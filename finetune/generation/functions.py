"""Users' functions named in a recipe (rewards, tools, environments), imported by path.

`module:function` imports an importable module (the recipe's folder is tried like the current one);
`path/to/file.py:function` loads a file, a relative one from the recipe's folder first, then the current
folder. Torch-free: the tool worker (finetune.generation.tool_worker) imports functions with it in a
process of its own, without paying for torch.

>>> load_function("json:dumps", what="grpo.tools", noun="tool")([1])
'[1]'
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError


def load_function(
    path: str, *, base: Path | None = None, what: str = "grpo.rewards", noun: str = "reward"
) -> Callable[..., Any]:
    """The function `path` names (see the module docstring); a FinetuneError naming `what` (the recipe
    field, e.g. grpo.rewards) and the `noun` (reward, tool) when the file, the module or the function
    cannot be found."""
    module_name, _, attr = path.rpartition(":")
    try:
        if module_name.endswith(".py"):
            candidates = [Path(module_name)] if Path(module_name).is_absolute() else []
            candidates += [(base or Path.cwd()) / module_name, Path.cwd() / module_name]
            file = next((c for c in candidates if c.is_file()), None)
            if file is None:
                raise FinetuneError(
                    f"{what}: {noun} file {module_name} does not exist (looked in {base or Path.cwd()})"
                )
            spec = importlib.util.spec_from_file_location(f"finetune_user_{file.stem}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if base is not None and str(base) not in sys.path:
                sys.path.insert(0, str(base))  # a module next to the recipe imports like one in the cwd
            module = importlib.import_module(module_name)
    except FinetuneError:
        raise
    except Exception as exc:
        raise FinetuneError(
            f"{what}: cannot import {module_name} for {noun} {path}: {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise FinetuneError(f"{what}: {module_name} has no function {attr!r} ({noun} {path})")
    return fn
