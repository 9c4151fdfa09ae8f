"""Checkpoints: `accelerator.save_state` plus our train state, written atomically.

Layout: output_dir/checkpoints/step-N/ (accelerate state + train_state.json + recipe.resolved.yaml)
and output_dir/checkpoints/latest (a text file naming the newest complete checkpoint). A checkpoint
is built in a temporary folder and renamed into place; `latest` is replaced only after that, so a
run killed mid-save never leaves a half-written checkpoint that resume would pick.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

STATE_FILE = "train_state.json"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    step: int,
    train_state: dict[str, Any],
    recipe_yaml: str,
    *,
    total_limit: int | None,
) -> Path:
    """Save model/optimizer/scheduler/RNG state and our train state as checkpoints/step-<step>.

    Every process must call this (sharded engines save from every rank); only the main process
    renames, updates `latest` and rotates.
    """
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(train_state, indent=2))
        (tmp / "recipe.resolved.yaml").write_text(recipe_yaml)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / "latest", final.name + "\n")
        if total_limit:
            rotate(root, keep=total_limit)
    accelerator.wait_for_everyone()
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (those with a train state file), oldest first."""
    found = [p for p in root.glob("step-*") if (p / STATE_FILE).is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def rotate(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names)."""
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    for old in list_checkpoints(root)[:-keep]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(spec: str | None, output_dir: str | Path) -> Path | None:
    """Resolve train.load_checkpoint_path: None, `auto` (latest in output_dir, or None), or a path."""
    if spec is None:
        return None
    if spec == "auto":
        root = checkpoints_dir(output_dir)
        pointer = root / "latest"
        if pointer.is_file():
            candidate = root / pointer.read_text().strip()
            if (candidate / STATE_FILE).is_file():
                return candidate
        complete = list_checkpoints(root)
        return complete[-1] if complete else None
    path = Path(spec)
    if not (path / STATE_FILE).is_file():
        raise FinetuneError(
            f"train.load_checkpoint_path: {path} is not a complete checkpoint (no {STATE_FILE}); "
            "point at output_dir/checkpoints/step-N or use `auto`"
        )
    return path


def load_train_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())
