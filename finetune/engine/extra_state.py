"""State that checkpoints hold besides accelerate's own (a schedule under DeepSpeed, an EMA), stored
without pickle: tensors in extra_state.safetensors, everything else in extra_state.json.

accelerate saves objects given to `register_for_checkpointing` with pickle and loads them with
`weights_only=False`, so a tampered checkpoint file could run code on resume; these two files can
only hold tensors and JSON values.

>>> flatten({"lr": [0.1], "shadow": [torch.zeros(2)]}, "ema")[0]
{'lr': [0.1], 'shadow': ['<tensor:ema/shadow/0>']}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TENSORS_FILE = "extra_state.safetensors"
JSON_FILE = "extra_state.json"
_MARK = "<tensor:"


def flatten(value: Any, key: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(value with every tensor replaced by a `<tensor:key>` mark, {key: tensor})."""
    if isinstance(value, torch.Tensor):
        return f"{_MARK}{key}>", {key: value.detach().cpu().contiguous()}
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k], found = flatten(v, f"{key}/{k}")
            tensors.update(found)
        return out, tensors
    if isinstance(value, (list, tuple)):
        items = []
        for i, v in enumerate(value):
            item, found = flatten(v, f"{key}/{i}")
            items.append(item)
            tensors.update(found)
        return items, tensors
    return value, tensors


def unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, str) and value.startswith(_MARK):
        return tensors[value[len(_MARK) : -1]]
    if isinstance(value, dict):
        return {k: unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [unflatten(v, tensors) for v in value]
    return value


def collect_states(objects: dict[str, Any]) -> dict[str, Any]:
    """The state_dict of every object, taken on every process: a state may gather from all of them
    (a data stream's position, finetune.data.batching.streaming), while only the main process writes."""
    return {name: obj.state_dict() for name, obj in objects.items()}


def save_extra(objects: dict[str, Any], folder: Path, *, states: dict[str, Any] | None = None) -> None:
    """Write the state_dict of every object under its name (`states`: taken already by collect_states)."""
    from safetensors.torch import save_file

    if not objects:
        return
    states = states if states is not None else collect_states(objects)
    plain, tensors = {}, {}
    for name in objects:
        plain[name], found = flatten(states[name], name)
        tensors.update(found)
    save_file(tensors, str(folder / TENSORS_FILE))
    (folder / JSON_FILE).write_text(json.dumps(plain))


def load_extra(objects: dict[str, Any], folder: Path) -> None:
    """Restore every object's state_dict from `folder` (which must hold all of them)."""
    from safetensors.torch import load_file

    from finetune.errors import FinetuneError

    if not objects:
        return
    if not (folder / JSON_FILE).is_file():
        raise FinetuneError(
            f"{folder} has no {JSON_FILE} (the state of {', '.join(objects)}): it was written by another "
            "finetune version or setup; resume from a checkpoint this setup wrote"
        )
    plain = json.loads((folder / JSON_FILE).read_text())
    missing = [name for name in objects if name not in plain]
    if missing:
        raise FinetuneError(
            f"{folder / JSON_FILE} holds no state for {', '.join(missing)}: the checkpoint was written by "
            "another finetune version or setup; resume from a checkpoint this setup wrote"
        )
    tensors = load_file(str(folder / TENSORS_FILE))
    for name, obj in objects.items():
        obj.load_state_dict(unflatten(plain[name], tensors))
