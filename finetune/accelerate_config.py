"""Accelerate configs: finding them by name, and reading one (or a launched process's environment)
into a `DistributedSetup` (the distributed engine, ZeRO stage and processes of a run), the one
description cli, train, distributed and plan share.

The shipped configs live in accelerate_configs/ (`finetune list-configs`); a recipe or the command
line names one (`zero3`) or gives a path. Reading follows Accelerate's own defaults (a DeepSpeed
config without `zero_stage` is ZeRO-2, as `DeepSpeedPlugin` makes it; a DeepSpeed JSON without a
stage is stage 0, as DeepSpeed makes it; `fsdp_version` defaults to 1), so what the planner predicts
is what the launched run does.

>>> DistributedSetup("deepspeed", num_processes=8, zero_stage=3).shard_degree
8
>>> DistributedSetup("fsdp", num_processes=16, num_machines=2, zero_stage=3, hybrid=True).shard_degree
8
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

REPO_ROOT = Path(__file__).resolve().parent.parent
ACCELERATE_CONFIGS = REPO_ROOT / "accelerate_configs"
OFFLOAD_KEYS = ("fsdp_offload_params", "offload_optimizer_device", "offload_param_device")
_KNOWN_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "FSDP", "DEEPSPEED")


@dataclass(frozen=True)
class DistributedSetup:
    """How a run is spread over processes and how its model states are sharded.

    `zero_stage` is DeepSpeed's stage; for FSDP 3 = full shard (params resharded after forward),
    2 = params kept unsharded between forward and backward (SHARD_GRAD_OP / reshard_after_forward
    false), 0 = NO_SHARD. Offload devices are "none", "cpu" or "nvme".
    """

    kind: str = "single"  # single | ddp | deepspeed | fsdp
    num_processes: int = 1  # over all machines (GPUs on a GPU cluster)
    num_machines: int = 1
    zero_stage: int = 0
    hybrid: bool = False  # FSDP: shard within a node, replicate across nodes
    shard_size: int | None = None  # FSDP: explicit shard group (parallelism_config dp_shard_size)
    offload_optimizer: str = "none"
    offload_params: str = "none"
    fsdp_version: int = 2
    use_cpu: bool = False
    source: str = "no accelerate config"  # the file (or environment) it was read from
    ds_config_path: Path | None = None  # the DeepSpeed JSON, when the config names one

    @property
    def sharded(self) -> bool:
        return self.kind in ("fsdp", "deepspeed") and self.zero_stage > 0

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.num_processes // self.num_machines)

    @property
    def shard_degree(self) -> int:
        """N: how many devices share one copy of the sharded states."""
        if self.kind == "deepspeed" and self.zero_stage > 0:
            return self.num_processes
        if self.kind == "fsdp" and self.zero_stage > 0:
            if self.shard_size:
                return min(self.shard_size, self.num_processes)
            return self.gpus_per_node if self.hybrid else self.num_processes
        return 1

    @property
    def name(self) -> str:
        """Short name, the one the shipped configs use where one exists (zero3_offload, fsdp2_hybrid)."""
        if self.kind == "deepspeed":
            return f"zero{self.zero_stage}" + ("_offload" if self.offloaded else "")
        if self.kind == "fsdp":
            shard = {0: "_no_shard", 2: "_no_reshard", 3: ""}[self.zero_stage]
            groups = self.shard_size or self.num_processes
            hybrid = "_hybrid" if self.hybrid or groups < self.num_processes else ""
            return f"fsdp{self.fsdp_version}{shard}{hybrid}" + ("_offload" if self.offloaded else "")
        return self.kind

    @property
    def label(self) -> str:
        """A few words for messages: "DeepSpeed ZeRO-3 with offload", "FSDP2 hybrid shard", "DDP"."""
        if self.kind == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage}" + (" with offload" if self.offloaded else "")
        if self.kind == "fsdp":
            mode = "hybrid shard" if self.hybrid else "full shard"
            off = " with CPU offload" if self.offload_params != "none" else ""
            return f"FSDP{self.fsdp_version} {mode}{off}"
        return {"single": "a single process", "ddp": "DDP"}[self.kind]

    def describe(self) -> str:
        """One line: the name, what is sharded how many ways, offload, and where it runs."""
        n, stage = self.shard_degree, self.zero_stage
        what = {"single": "one device, nothing sharded", "ddp": "DDP: every state replicated"}.get(
            self.kind, ""
        )
        if self.kind == "deepspeed":
            sharded = ("", "optimizer states", "gradients and optimizer states", "all states")[stage]
            what = f"DeepSpeed ZeRO-{stage}: {sharded} sharded {n} ways" if stage else "DeepSpeed, no ZeRO"
        elif self.kind == "fsdp":
            hybrid = " within each node, replicated across nodes" if n < self.num_processes else ""
            what = f"FSDP{self.fsdp_version}: all states sharded {n} ways{hybrid}"
            what = what if stage else f"FSDP{self.fsdp_version} NO_SHARD: every state replicated"
        for part, device in (("optimizer", self.offload_optimizer), ("params", self.offload_params)):
            what += f"; {part} offloaded to {device}" if device != "none" else ""
        device = "CPU process" if self.use_cpu else "GPU"
        return f"{self.name} ({what}) on {_plural(self.num_processes, device)}, {_plural(self.num_machines, 'node')}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


# --------------------------------------------------------------------------------------- lookup


def resolve_accelerate_config(name_or_path: str | None) -> Path | None:
    """A config name from accelerate_configs/ (with or without .yaml) or a path to a file."""
    if name_or_path is None:
        return None
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (ACCELERATE_CONFIGS / name_or_path, ACCELERATE_CONFIGS / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    names = ", ".join(sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml")))
    raise FinetuneError(
        f"accelerate config {name_or_path!r} is neither a file nor a name in {ACCELERATE_CONFIGS} "
        f"(available: {names})"
    )


def list_configs() -> list[tuple[str, str]]:
    """(name, first comment line) for every shipped accelerate config."""
    rows = []
    for path in sorted(ACCELERATE_CONFIGS.glob("*.yaml")):
        first = next((ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
        rows.append((path.stem, first))
    return rows


def resolve_ds_config_file(value: str, *, relative_to: Path | None = None) -> Path:
    """A DeepSpeed JSON named in an accelerate config: as given (from the working directory), then
    beside the accelerate config, then from the repository root (the shipped configs name
    `accelerate_configs/deepspeed/*.json`, so they work from any directory)."""
    path = Path(value)
    candidates = [path]
    if not path.is_absolute():
        if relative_to is not None:
            candidates.append(relative_to / path)
        candidates.append(REPO_ROOT / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise FinetuneError(
        f"deepspeed_config_file {value!r} not found (looked in: {', '.join(str(c) for c in candidates)}); "
        "fix the path in the accelerate config"
    )


def load_ds_config(path: Path) -> dict:
    """A DeepSpeed JSON as a dict, with errors that name the file and line."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise FinetuneError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except OSError as exc:
        raise FinetuneError(f"could not read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise FinetuneError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


# -------------------------------------------------------------------------------------- reading


def read_accelerate_config(
    config: Path | None, *, num_processes: int | None = None, num_machines: int | None = None
) -> DistributedSetup:
    """The engine an accelerate config file selects (None = one process); the keyword arguments
    (the command line's --num-processes / --num-gpus, --num-machines / --num-nodes) win.

    distributed_type NO / MULTI_GPU / MULTI_CPU -> single or DDP, FSDP -> `fsdp_config`,
    DEEPSPEED -> `deepspeed_config` (zero_stage, offload_*_device) or the DeepSpeed JSON its
    `deepspeed_config_file` names (zero_optimization.stage, offload_optimizer/offload_param.device).
    Offload settings under any other distributed_type are refused (Accelerate would ignore them).
    """
    data = _read_mapping(config) if config is not None else {}
    kind = str(data.get("distributed_type", "NO")).upper()
    processes = int(num_processes or data.get("num_processes") or 1)
    machines = int(num_machines or data.get("num_machines") or 1)
    if processes < 1 or machines < 1 or processes % machines:
        raise FinetuneError(
            f"{processes} processes cannot be spread evenly over {machines} machines: --num-gpus "
            "(--num-processes) counts processes over all machines and must be a multiple of --num-nodes "
            "(--num-machines)"
        )
    if kind not in _KNOWN_TYPES:
        raise FinetuneError(
            f"{config}: distributed_type {kind} is not one finetune knows ({', '.join(_KNOWN_TYPES)})"
        )
    _refuse_stray_offload(data, kind, config)
    common: dict[str, Any] = {
        "num_processes": processes,
        "num_machines": machines,
        "use_cpu": kind == "MULTI_CPU" or _truthy(data.get("use_cpu")),
        "source": str(config) if config is not None else "no accelerate config",
    }
    if kind == "DEEPSPEED":
        return DistributedSetup(kind="deepspeed", **common, **_deepspeed_settings(data, config))
    if kind == "FSDP":
        settings = _fsdp_settings(data, processes)
        if settings["hybrid"] and (num_processes or num_machines):  # the config's group sizes no longer apply
            settings["shard_size"] = None
        return DistributedSetup(kind="fsdp", **common, **settings)
    return DistributedSetup(kind="ddp" if processes > 1 else "single", **common)


def setup_from_env(env: os._Environ | dict | None = None) -> DistributedSetup:
    """The engine of the running process, from the variables `accelerate launch` sets."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    common: dict[str, Any] = {
        "num_processes": world,
        "use_cpu": _truthy(env.get("ACCELERATE_USE_CPU", "false")),
        "source": "the launched process's environment",
    }
    if _truthy(env.get("ACCELERATE_USE_DEEPSPEED", "false")):
        config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if config_file and config_file != "none":
            path = resolve_ds_config_file(config_file)
            return DistributedSetup(
                kind="deepspeed", ds_config_path=path, **common, **_zero_settings(load_ds_config(path), path)
            )
        settings = {
            "zero_stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"),
            "offload_optimizer": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
            "offload_params": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
        }
        return DistributedSetup(
            kind="deepspeed", **common, **_checked_zero(settings, "the launched process's environment")
        )
    if _truthy(env.get("ACCELERATE_USE_FSDP", "false")):
        offload = "cpu" if _truthy(env.get("FSDP_OFFLOAD_PARAMS", "false")) else "none"
        return DistributedSetup(
            kind="fsdp",
            zero_stage=3,
            fsdp_version=int(env.get("FSDP_VERSION", "1")),
            offload_params=offload,
            offload_optimizer=offload,
            hybrid=int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")) > 1,
            **common,
        )
    return DistributedSetup(kind="ddp" if world > 1 else "single", **common)


def _read_mapping(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))  # JSON is YAML too
    except (OSError, yaml.YAMLError) as exc:
        raise FinetuneError(f"could not read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise FinetuneError(f"{path}: expected a mapping of settings")
    return data


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "yes", "1")


def _refuse_stray_offload(data: dict, kind: str, config: Path | None) -> None:
    fsdp, ds = data.get("fsdp_config") or {}, data.get("deepspeed_config") or {}
    offload_set = [
        key
        for key in OFFLOAD_KEYS
        if str(fsdp.get(key, ds.get(key, "none"))).lower() not in ("none", "false", "")
    ]
    if offload_set and kind not in ("FSDP", "DEEPSPEED"):
        raise FinetuneError(
            f"{config}: {', '.join(offload_set)} is set but distributed_type is {kind}; offload needs "
            "DeepSpeed or FSDP: use zero2_offload, zero3_offload or fsdp2_offload instead"
        )


def _offload_device(value: Any, where: str) -> str:
    device = "none" if value in (None, False) else str(value).lower()
    if device not in ("none", "cpu", "nvme"):
        raise FinetuneError(f"{where}: offload device {value!r} is not one of none, cpu, nvme")
    return device


def _deepspeed_settings(data: dict, config: Path | None) -> dict[str, Any]:
    ds = data.get("deepspeed_config") or {}
    file = ds.get("deepspeed_config_file")
    if file:
        json_path = resolve_ds_config_file(str(file), relative_to=Path(config).parent if config else None)
        return {"ds_config_path": json_path, **_zero_settings(load_ds_config(json_path), json_path)}
    # Accelerate's DeepSpeedPlugin defaults zero_stage to 2 when the config does not say.
    settings = {
        "zero_stage": ds.get("zero_stage", 2),
        "offload_optimizer": ds.get("offload_optimizer_device"),
        "offload_params": ds.get("offload_param_device"),
    }
    return _checked_zero(settings, str(config))


def _zero_settings(ds_json: dict, path: Path) -> dict[str, Any]:
    """Stage and offload devices of a DeepSpeed JSON (DeepSpeed's default stage is 0)."""
    zero = ds_json.get("zero_optimization") or {}
    settings = {
        "zero_stage": zero.get("stage", 0),
        "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device"),
        "offload_params": (zero.get("offload_param") or {}).get("device"),
    }
    return _checked_zero(settings, str(path))


def _checked_zero(settings: dict[str, Any], where: str) -> dict[str, Any]:
    stage = settings["zero_stage"]
    if str(stage) not in ("0", "1", "2", "3"):
        raise FinetuneError(f"{where}: ZeRO stage {stage!r} is not 0, 1, 2 or 3")
    out = {
        "zero_stage": int(stage),
        "offload_optimizer": _offload_device(settings["offload_optimizer"], where),
        "offload_params": _offload_device(settings["offload_params"], where),
    }
    if out["offload_params"] != "none" and out["zero_stage"] != 3:
        raise FinetuneError(f"{where}: offload_param needs ZeRO stage 3 (got stage {stage})")
    if out["offload_optimizer"] != "none" and out["zero_stage"] == 0:
        raise FinetuneError(f"{where}: offload_optimizer needs ZeRO stage 1, 2 or 3")
    return out


# FSDP1 sharding strategies (names or accelerate's 1-based numbers) -> (zero-like stage, hybrid).
_FSDP_STRATEGIES = {
    "FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False),
    "HYBRID_SHARD": (3, True), "HYBRID_SHARD_ZERO2": (2, True),
    "1": (3, False), "2": (2, False), "3": (0, False), "4": (3, True), "5": (2, True),
    "TRUE": (3, False), "FALSE": (2, False),
}  # fmt: skip


def _fsdp_settings(data: dict, processes: int) -> dict[str, Any]:
    fsdp = data.get("fsdp_config") or {}
    version = int(fsdp.get("fsdp_version", 1))
    # FSDP2 reads fsdp_reshard_after_forward; FSDP1 (and old FSDP2 configs) fsdp_sharding_strategy.
    raw = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"))
    strategy = _FSDP_STRATEGIES.get(str(raw).upper())
    if strategy is None:
        raise FinetuneError(f"fsdp_config: unknown sharding setting {raw!r} (e.g. FULL_SHARD, HYBRID_SHARD)")
    stage, hybrid = strategy
    parallel = {
        k.removeprefix("parallelism_config_"): v for k, v in (data.get("parallelism_config") or {}).items()
    }
    replicate = int(parallel.get("dp_replicate_size") or 1)
    shard_size = int(parallel["dp_shard_size"]) if parallel.get("dp_shard_size") else None
    if replicate > 1:
        hybrid, shard_size = True, shard_size or max(1, processes // replicate)
    offload = "cpu" if _truthy(fsdp.get("fsdp_offload_params")) else "none"
    return {
        "zero_stage": stage,
        "hybrid": hybrid,
        "shard_size": shard_size,
        "fsdp_version": version,
        "offload_optimizer": offload,
        "offload_params": offload,
    }
