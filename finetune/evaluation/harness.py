"""Standard benchmarks in `finetune eval` through EleutherAI's lm-evaluation-harness (`pip install
'finetune[eval]'`): the recipe's `eval.lm_eval` tasks (or `--lm-eval gsm8k,arc_easy`) run by
`lm_eval.simple_evaluate` on the model object `finetune eval` already loaded, wrapped in lm-eval's own
`HFLM`, so the numbers are lm-eval's (metrics, filters, few-shot, stderr), not a re-implementation.

Offline by default: the tasks' datasets are loaded with datasets' and huggingface_hub's offline mode on,
so a task defined on local files (a task YAML in `include_path` with `dataset_path: json` and
`dataset_kwargs.data_files`, or a built-in task pointed at local files with `data_files`) runs with no
network, and one that would need a download fails at once, naming the task and how to point it at local
files, before any model is loaded.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

INSTALL = "pip install 'finetune[eval]' (lm-eval)"

# Where datasets' builders read files by extension (dataset_path of a task pointed at local files).
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class HarnessSettings:
    """What `eval.lm_eval` asks for, with paths already resolved against the recipe's folder."""

    tasks: tuple[str, ...]
    include_path: tuple[str, ...] = ()
    data_files: dict[str, dict[str, str]] = field(default_factory=dict)
    limit: int | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    max_length: int | None = None
    max_gen_toks: int | None = None
    apply_chat_template: bool = False
    bootstrap_iters: int = 1000
    download: bool = False


def import_harness():
    """The lm_eval package, or an error naming the pip install."""
    try:
        import lm_eval
    except ImportError:
        raise FinetuneError(f"eval.lm_eval (--lm-eval) needs lm-evaluation-harness: {INSTALL}") from None
    return lm_eval


@contextlib.contextmanager
def offline(enabled: bool) -> Iterator[None]:
    """datasets' and huggingface_hub's offline mode while tasks load. Both read it from the environment
    at import, and finetune eval has imported them before (the eval split), so their module-level flags
    are set too (the libraries read those at call time); restored afterwards. Without it a missing Hub
    dataset costs five HTTP retries (~25 s) per task before failing."""
    if not enabled:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    saved_env = {name: os.environ.get(name) for name in names}
    saved = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    os.environ.update(dict.fromkeys(names, "1"))
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def task_manager(settings: HarnessSettings):
    """lm-eval's TaskManager over `include_path`; lm-eval's built-in tasks are indexed too only when a
    task is not in `include_path` (indexing the thousands of built-in YAMLs costs ~15 s on 2 cores)."""
    from lm_eval.tasks import TaskManager

    for folder in settings.include_path:
        if not Path(folder).is_dir():
            raise FinetuneError(
                f"eval.lm_eval.include_path: {folder} is not a folder; give folders holding lm-eval task YAMLs"
            )
    if settings.include_path:
        local = TaskManager(include_path=list(settings.include_path), include_defaults=False)
        if all(_known(local, t) for t in settings.tasks):
            return local
    manager = TaskManager(include_path=list(settings.include_path) or None)
    unknown = [t for t in settings.tasks if not _known(manager, t)]
    if unknown:
        raise FinetuneError(
            f"eval.lm_eval.tasks: {', '.join(unknown)} is no lm-eval task, group or task YAML"
            f"{' in ' + ', '.join(settings.include_path) if settings.include_path else ''}; "
            "see `lm-eval ls tasks` for the built-in names, or put a task YAML in a folder named by "
            "eval.lm_eval.include_path"
        )
    return manager


def _known(manager, task: str) -> bool:
    return task in manager.task_index or (task.endswith((".yaml", ".yml")) and Path(task).is_file())


def task_specs(manager, settings: HarnessSettings) -> list[str | dict[str, Any]]:
    """What simple_evaluate loads: each task's name, or for a task in `data_files` its own config with
    its dataset replaced by local files (dataset_path: the builder for their extension, data_files per
    split). lm-eval takes a config dict as a task but does not merge one into a registered task, so the
    registered YAML is read (with its `include`s) and the dataset keys are replaced here."""
    # lm-eval's own YAML reader (its `include`s and `!function`s resolved as TaskManager resolves them):
    # it has no public name in 0.4.13.
    from lm_eval.tasks._yaml_loader import load_yaml

    specs: list[str | dict[str, Any]] = []
    for name in settings.tasks:
        files = settings.data_files.get(name)
        if not files:
            specs.append(name)
            continue
        entry = manager.task_index.get(name)
        if entry is None or entry.yaml_path is None:
            raise FinetuneError(
                f"eval.lm_eval.data_files.{name}: {name} is not a task defined by a YAML file (a group, a tag or "
                "a Python task), so its dataset cannot be replaced; name its tasks one by one"
            )
        config = load_yaml(entry.yaml_path, resolve_func=True, recursive=True)
        specs.append(
            {
                **config,
                "task": name,
                "dataset_path": _builder(name, files),
                "dataset_name": None,
                "dataset_kwargs": {"data_files": dict(files)},
            }
        )
    return specs


def _builder(task: str, files: dict[str, str]) -> str:
    builders = set()
    for split, path in files.items():
        if not Path(path).is_file():
            raise FinetuneError(f"eval.lm_eval.data_files.{task}.{split}: {path} is not a file")
        suffix = Path(path).suffix.lower()
        if suffix not in BUILDERS:
            raise FinetuneError(
                f"eval.lm_eval.data_files.{task}.{split}: {path}: give a {', '.join(BUILDERS)} file"
            )
        builders.add(BUILDERS[suffix])
    if len(builders) > 1:
        raise FinetuneError(f"eval.lm_eval.data_files.{task}: give every split in one file format")
    return builders.pop()


def check_tasks(settings: HarnessSettings, manager=None):
    """Load every task once (its dataset read, offline unless `download`) before any model is loaded:
    a task that cannot load fails here, in seconds, naming itself. Returns (task manager, task specs);
    `manager`: a TaskManager already built for `settings` (task_manager), else one is built."""
    import_harness()
    manager = manager or task_manager(settings)
    specs = task_specs(manager, settings)
    with offline(not settings.download):
        for name, spec in zip(settings.tasks, specs, strict=True):
            try:
                manager.load([spec])
            except Exception as e:  # any failure to read a task's data is said with the task's name
                raise _load_error(name, e, settings, manager) from None
    return manager, specs


def _load_error(task: str, error: Exception, settings: HarnessSettings, manager) -> FinetuneError:
    text = " ".join(str(error).split())[:300]
    splits = _splits(manager, task) or {"test": "test"}
    files = ", ".join(f"{split}: FILE.jsonl" for split in splits)
    how = (
        f"point it at local files: eval.lm_eval.data_files.{task}: {{{files}}} (the splits it reads: "
        f"{', '.join(f'{key} {split}' for split, key in splits.items())}), or a task YAML with dataset_path: json "
        "and dataset_kwargs.data_files in a folder named by eval.lm_eval.include_path"
    )
    if not settings.download:
        how += "; or set eval.lm_eval.download: true to let datasets download it (needs the network)"
    return FinetuneError(
        f"lm-eval task {task}: its data could not be loaded ({type(error).__name__}: {text}); {how}"
    )


def _splits(manager, task: str) -> dict[str, str]:
    """{split: the task config's key naming it} for the splits a registered task reads ({} if unknown)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index.get(task)
    if entry is None or entry.yaml_path is None:
        return {}
    config = load_yaml(entry.yaml_path, resolve_func=False, recursive=True)
    splits: dict[str, str] = {}
    for key in ("test_split", "validation_split", "training_split", "fewshot_split"):
        if isinstance(config.get(key), str):
            splits.setdefault(config[key], key)
    return splits


def run_harness(
    model, tokenizer, settings: HarnessSettings, manager, specs, *, device=None
) -> dict[str, Any]:
    """lm_eval.simple_evaluate on `model` (already loaded, wrapped in lm-eval's HFLM with `tokenizer`):
    {"tasks": {task: {"n": examples, "metrics": {"metric,filter": {"value", "stderr"}}}}, "n_shot": ...,
    "lm_eval_version": ...}. lm-eval's stderr is null where it computed none."""
    lm_eval = import_harness()
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=settings.batch_size,
        max_length=settings.max_length,
        device=str(device or next(model.parameters()).device),
    )
    with offline(not settings.download):
        out = lm_eval.simple_evaluate(
            lm,
            tasks=list(specs),
            task_manager=manager,
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            bootstrap_iters=settings.bootstrap_iters,
            apply_chat_template=settings.apply_chat_template,
            gen_kwargs={"max_gen_toks": settings.max_gen_toks} if settings.max_gen_toks else None,
            log_samples=False,
        )
    return summarize(out)


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """The numbers of simple_evaluate's result that eval.json keeps: every task's metrics (per filter)
    with their stderr, the examples scored and the few-shot count."""
    tasks: dict[str, Any] = {}
    for task, values in out["results"].items():
        metrics: dict[str, dict[str, float | None]] = {}
        for key, value in values.items():
            if "," not in key or "_stderr," in key or not isinstance(value, int | float):
                continue
            metric, filt = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filt}")
            metrics[key] = {"value": float(value), "stderr": _number(stderr)}
        samples = out.get("n-samples", {}).get(task, {})
        tasks[task] = {
            "n": samples.get("effective"),
            "n_shot": out.get("n-shot", {}).get(task),
            "metrics": metrics,
        }
    return {"tasks": tasks, "lm_eval_version": out.get("lm_eval_version")}


def _number(value: Any) -> float | None:
    """lm-eval writes "N/A" where it computed no stderr."""
    if isinstance(value, int | float) and not math.isnan(value):
        return float(value)
    return None


def harness_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Rows of the side-by-side table: one per task metric, `value ± stderr` per model."""
    names = list(results)
    first = results[names[0]].get("lm_eval")
    if not first:
        return []
    rows = []
    for task, summary in first["tasks"].items():
        for key in summary["metrics"]:
            label = f"lm-eval {task} {key.replace(',none', '')} (n={summary['n']})"
            rows.append(
                (label, [_plus_minus(results[n]["lm_eval"]["tasks"][task]["metrics"][key]) for n in names])
            )
    return rows


def _plus_minus(metric: dict[str, float | None]) -> str:
    """A metric's value and, where lm-eval computed one, its stderr.

    >>> _plus_minus({"value": 0.25, "stderr": 0.0625}), _plus_minus({"value": 3.0, "stderr": None})
    ('0.2500 ± 0.0625', '3.0000')
    """
    if metric["stderr"] is None:
        return f"{metric['value']:.4f}"
    return f"{metric['value']:.4f} ± {metric['stderr']:.4f}"
