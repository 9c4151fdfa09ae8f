"""The reference model an objective compares its policy with (DPO, IPO, KTO; GRPO's KL term).

`Reference` says where the reference's outputs come from and runs it:

* `adapter`: the model being trained with its LoRA adapters disabled (no second model in memory);
* `copy`: a frozen copy of the initial model in eval mode (full fine-tuning; not under FSDP or
  ZeRO, whose shards a copy would not share);
* `precomputed`: per-sequence log-prob sums of every prepared row, computed once before the first
  step and cached (below); the objective looks rows up instead of running a forward.

Precomputed log-probs (`preference.precompute_ref_log_probs`): the reference model's per-sequence
log-prob sums of every prepared row are computed before the first step (the policy then still equals
the reference: the engine resumes a checkpoint only afterwards) and saved as one safetensors file
per preparation and reference model:

    <dataset_prepared_path>/reference_logps/<data fingerprint>-<reference key>.safetensors

The reference key hashes what the log-probs depend on besides the data (`reference_key`): the model
section (weights location, dtype, attention backend, chat template, special tokens), the identity
of the weights (file sizes and modification times of a local folder, the commit of a Hub
revision), the precision of the computation, and the seed of a random-init model. A later run with
the same data and reference (a resume, another objective) loads the file instead of computing it.

Per split the file holds `<split>.values` (float32, row-major: the row's sequences in order, then
for kto its KL sequences) and `<split>.offsets` (where each prepared row starts; row r holds
2 x its units). `ReferenceTable.rows` gives a batch's values in the order the loss reads them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.data.prepare.cache import compute_fingerprint
from finetune.errors import FinetuneError

CACHE_FOLDER = "reference_logps"
# Weight files whose size and modification time identify a local model folder.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")


def reference_source(*, needed: bool, precompute: bool, lora: bool) -> str | None:
    """Where an objective's reference comes from: None (none needed), precomputed, adapter or copy.

    >>> reference_source(needed=True, precompute=False, lora=True)
    'adapter'
    """
    if not needed:
        return None
    if precompute:
        return "precomputed"
    return "adapter" if lora else "copy"


class Reference:
    """The reference model of a run: `source` is one of reference_source's answers.

    `attach(model, accelerator)` after the model is built (the copy is taken then, before any
    update), `to(device)` once the engine prepared it; `model(policy, accelerator)` is a context
    giving the module that computes the reference's outputs, without gradients; `tables` holds the
    precomputed log-probs by split.
    """

    def __init__(self, source: str | None, *, objective: str, lora: bool):
        self.source, self.objective, self.lora = source, objective, lora
        self.copy: Any = None  # the frozen copy (source `copy`)
        self.tables: dict[str, ReferenceTable] = {}  # precomputed: split -> table

    @property
    def forward_passes(self) -> int:
        """Forward-only passes over each token the reference adds to a step (for FLOPs)."""
        return 1 if self.source in ("adapter", "copy") else 0

    def attach(self, model, accelerator) -> None:
        """Take the frozen copy of the initial model (source `copy`)."""
        if self.source != "copy":
            return
        from accelerate.utils import DistributedType

        kind = accelerator.distributed_type
        if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise FinetuneError(
                f"train.objective {self.objective} with full fine-tuning under {kind.value}: a frozen reference "
                "copy would not be sharded; set preference.precompute_ref_log_probs: true (the reference "
                "log-probs are computed once with the sharded model) or train LoRA adapters"
            )
        # A second copy of the weights: the memory cost of a full fine-tune's reference.
        self.copy = copy.deepcopy(model).requires_grad_(False).eval()

    def to(self, device) -> None:
        if self.copy is not None:
            self.copy.to(device)

    @contextlib.contextmanager
    def model(self, policy, accelerator) -> Iterator[Any]:
        """The module whose forward gives the reference's outputs, under no_grad: the frozen copy
        (in the run's autocast), else the unwrapped policy with its adapters disabled (LoRA), or as
        it is (full fine-tuning, precomputing before any update). The unwrapped model has no DDP
        hooks for a pass without backward, and its forward keeps Accelerate's autocast wrapper."""
        with torch.no_grad():
            if self.copy is not None:
                with accelerator.autocast():
                    yield self.copy
                return
            unwrapped = accelerator.unwrap_model(policy)
            with unwrapped.disable_adapter() if self.lora else contextlib.nullcontext():
                yield unwrapped


@dataclass
class ReferenceTable:
    """Per-sequence reference log-prob sums of one prepared split, by row: 2 x the row's units values,
    a pair's chosen and rejected sequences in turn, or (`kto`) the row's examples then their KL
    sequences."""

    values: torch.Tensor  # float32, every row's values one after the other
    offsets: torch.Tensor  # int64, len(rows) + 1
    kto: bool = False

    def rows(self, row_index: torch.Tensor, num_units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The values of the batch rows `row_index`, row-major, as (sequences, KL sequences): for pairs
        (chosen_0, rejected_0, chosen_1, ..., empty), for kto (the examples, their KL sequences)."""
        heads, tails = [], []
        for row, units in zip(row_index.tolist(), num_units.tolist(), strict=True):
            values = self.values[self.offsets[row] : self.offsets[row + 1]]
            heads.append(values[:units] if self.kto else values)
            tails.append(values[units:] if self.kto else values[:0])
        return torch.cat(heads), torch.cat(tails)


def reference_key(model_settings: Any, *, mixed_precision: str, seed: int) -> str:
    """What the reference log-probs depend on besides the data, hashed (see the module docstring)."""
    from finetune.gguf.convert import resolve_model_source

    identity: dict[str, Any] = {
        "model": model_settings.model_dump(mode="json"),
        "mixed_precision": mixed_precision,
        "weights": _weights_identity(resolve_model_source(model_settings)),
    }
    if model_settings.model_path is None:
        identity["seed"] = seed  # random init from a config: the seed makes the weights
    return compute_fingerprint(identity)


def _weights_identity(model_settings: Any) -> Any:
    path = model_settings.model_path
    if path is None:
        return None
    local = Path(path).expanduser()
    if local.is_dir():
        return {
            p.name: [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(local.iterdir())
            if p.is_file() and p.suffix in _WEIGHT_SUFFIXES
        }
    if local.is_file():
        return [local.name, local.stat().st_size, local.stat().st_mtime_ns]
    return {"hub": path, "revision": model_settings.revision, "sha": _hub_sha(path, model_settings.revision)}


def _hub_sha(repo: str, revision: str | None) -> str | None:
    """The commit a Hub model revision resolves to (from the cache when offline), None if unknown."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        return HfApi().model_info(repo, revision=revision).sha
    except Exception:  # offline: the snapshot already in the cache names its commit
        cached = try_to_load_from_cache(repo, "config.json", revision=revision)
        if isinstance(cached, str) and "snapshots" in Path(cached).parts:
            parts = Path(cached).parts
            return parts[parts.index("snapshots") + 1]
    return None


def cache_path(prepared_root: Path, data_fingerprint: str, key: str) -> Path:
    """Where the reference log-probs of a preparation and a reference model are cached."""
    return Path(prepared_root) / CACHE_FOLDER / f"{data_fingerprint}-{key}.safetensors"


def load_or_compute(
    accelerator,
    path: Path,
    splits: dict[str, Any],
    compute: Callable[[dict], list[torch.Tensor]],
    make_batches: Callable[[Any], Iterable[dict]],
    *,
    kto: bool,
) -> dict[str, ReferenceTable]:
    """The cached tables at `path`, or computed now on every process and saved by the main one.

    `splits` maps a split name to its prepared rows (with `row_index` and `num_units` columns);
    `make_batches(rows)` batches a subset of them; `compute(batch)` returns each batch row's values
    (2 x its units). Each process computes an equal share of the rows (repeating one row to even the
    shares, so sharded engines run the same forwards on every rank), then all are gathered.
    """
    if path.is_file():
        accelerator.print(f"reference log-probs: loaded from {path}")
        return _load(path, kto=kto)
    accelerator.print(f"reference log-probs: computing them for {', '.join(splits)} (cached at {path})")
    tables = {}
    for name, rows in splits.items():
        values = _compute_split(accelerator, rows, compute, make_batches)
        tables[name] = _table(values, kto=kto)
    if accelerator.is_main_process:
        _save(path, tables)
    accelerator.wait_for_everyone()
    return tables


def _compute_split(accelerator, rows: Any, compute, make_batches) -> list[torch.Tensor]:
    from accelerate.utils import gather_object

    n, world, rank = len(rows), accelerator.num_processes, accelerator.process_index
    share = -(-n // world)
    mine = list(range(rank * share, min(n, (rank + 1) * share)))
    padded = mine + [mine[-1] if mine else 0] * (share - len(mine))  # the same number of forwards everywhere
    found: list[tuple[int, list[float]]] = []
    position = 0
    for batch in make_batches(rows.select(padded)):
        for values in compute(batch):
            if position < len(mine):
                found.append((mine[position], values.float().cpu().tolist()))
            position += 1
    gathered = gather_object(found) if world > 1 else found
    by_row = dict(gathered)
    missing = [i for i in range(n) if i not in by_row]
    if missing:
        raise FinetuneError(
            f"reference log-probs: rows {missing[:5]} were not computed ({len(missing)} in all)"
        )
    return [torch.tensor(by_row[i], dtype=torch.float32) for i in range(n)]


def _table(values: list[torch.Tensor], *, kto: bool) -> ReferenceTable:
    lengths = torch.tensor([len(v) for v in values], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return ReferenceTable(values=torch.cat(values) if values else torch.zeros(0), offsets=offsets, kto=kto)


def _save(path: Path, tables: dict[str, ReferenceTable]) -> None:
    """Write atomically: a temporary file, then a rename (a crash never leaves a partial file)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, table in tables.items():
        tensors[f"{name}.values"], tensors[f"{name}.offsets"] = table.values.contiguous(), table.offsets
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"splits": json.dumps(sorted(tables))})
    os.replace(tmp, path)


def _load(path: Path, *, kto: bool) -> dict[str, ReferenceTable]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    names = {key.rsplit(".", 1)[0] for key in tensors}
    tables = {}
    for name in names:
        tables[name] = ReferenceTable(tensors[f"{name}.values"], tensors[f"{name}.offsets"], kto=kto)
    return tables
