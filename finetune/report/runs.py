"""What `finetune report` reads from a training output_dir: the resolved recipe, progress.jsonl
(step records, evaluations, events, damaged lines), eval.json of `finetune eval`, and the prepared
dataset's manifest. Nothing here imports torch: a report of finished runs needs only these files.

Every part that is missing comes back as None with the reason and the command that makes it, so the
page can say what is missing instead of failing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

PROGRESS = "progress.jsonl"
RECIPE = "recipe.resolved.yaml"
EVAL_JSON = "eval.json"


@dataclass
class RunData:
    """One output_dir as the report shows it."""

    label: str
    path: Path
    recipe: dict
    steps: list[dict] = field(default_factory=list)  # step records (no event), one per step, in order
    evals: list[dict] = field(default_factory=list)  # "eval" records (training-time evaluations)
    events: list[dict] = field(default_factory=list)  # every other event record
    damaged: list[int] = field(default_factory=list)  # progress.jsonl line numbers that are not records
    problems: list[str] = field(default_factory=list)  # files that could not be read, with the reason
    eval_report: dict | None = None
    eval_missing: str | None = None
    manifest: dict | None = None
    manifest_missing: str | None = None

    @property
    def finished(self) -> bool:
        return any(e.get("event") == "finished" for e in self.events)

    @property
    def started(self) -> dict | None:
        """The last "started" record (a resumed run adds one per start)."""
        found = [e for e in self.events if e.get("event") == "started"]
        return found[-1] if found else None

    @property
    def objective(self) -> str:
        return str((self.recipe.get("train") or {}).get("objective") or "?")


def is_number(value: Any) -> bool:
    """A value a chart can draw: a finite int or float (not a bool, not "nan" as the log writes it).

    >>> [is_number(v) for v in (1, 0.5, float("inf"), "nan", None, True)]
    [True, True, False, False, False, False]
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run_labels(paths: list[Path]) -> list[str]:
    """Short unique names of the runs: their folder names (parent/name where two share a name).

    >>> run_labels([Path("a/sft"), Path("b/dpo"), Path("c/sft")])
    ['sft', 'dpo', 'c/sft']
    """
    labels: list[str] = []
    for path in paths:
        label = path.name or str(path)
        if label in labels:
            label = f"{path.parent.name}/{path.name}"
        k = 2
        while label in labels:
            label, k = f"{path.name}-{k}", k + 1
        labels.append(label)
    return labels


def load_run(path: Path, label: str) -> RunData:
    """Read one output_dir; a folder that holds neither progress.jsonl nor recipe.resolved.yaml is
    not a run (FinetuneError naming it)."""
    path = Path(path)
    if not path.is_dir() or not ((path / PROGRESS).is_file() or (path / RECIPE).is_file()):
        what = "does not exist" if not path.exists() else "is not a folder" if not path.is_dir() else None
        what = what or f"holds neither {PROGRESS} nor {RECIPE}"
        raise FinetuneError(
            f"{path} is not a training output_dir: it {what} (`finetune train` writes both there). "
            "Give the train.output_dir of a run"
        )
    run = RunData(label=label, path=path, recipe=_read_recipe(path))
    if not run.recipe:
        run.problems.append(f"{path / RECIPE} is missing or unreadable: objective and data settings unknown")
    _read_progress(run)
    run.eval_report, run.eval_missing = _read_eval(run)
    run.manifest, run.manifest_missing = _find_manifest(run)
    return run


def _read_recipe(path: Path) -> dict:
    from finetune.recipe.yaml_io import read_yaml

    try:
        data = read_yaml(path / RECIPE)
    except (OSError, FinetuneError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_progress(run: RunData) -> None:
    """Fill the run's records from progress.jsonl; lines that are not JSON objects are counted as
    damaged (a line cut short by a crash, or a run writing it right now), never fatal."""
    path = run.path / PROGRESS
    if not path.is_file():
        run.problems.append(f"no {PROGRESS} yet: the run has logged nothing")
        return
    by_step: dict[int, dict] = {}
    text = path.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            run.damaged.append(number)
        elif record.get("event") is None:
            by_step[record["step"]] = record  # the last record of a step wins, as a resume replays it
        elif record["event"] == "eval":
            run.evals.append(record)
        else:
            run.events.append(record)
    run.steps = [by_step[s] for s in sorted(by_step)]


def _read_eval(run: RunData) -> tuple[dict | None, str | None]:
    path = run.path / EVAL_JSON
    how = (
        f"run `finetune eval RECIPE --adapter {run.path}` (--model {run.path} for a full model) to compare "
        "the tuned model with its base; it writes eval.json there"
    )
    if not path.is_file():
        return None, f"no {EVAL_JSON} in {run.path}: {how}"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return None, f"{path} is not valid JSON ({exc}): {how}"
    if not isinstance(report, dict) or not isinstance(report.get("results"), dict) or not report["results"]:
        return None, f"{path} holds no results: {how}"
    return report, None


def _find_manifest(run: RunData) -> tuple[dict | None, str | None]:
    """The prepared dataset's manifest: dataset_prepared_path/<fingerprint>/manifest.json, the
    fingerprint from the run's "started" record (or, for runs logged before that record existed,
    computed again from the resolved recipe: found only while the data files are unchanged)."""
    prepared = (run.recipe.get("data") or {}).get("dataset_prepared_path")
    again = f"`finetune prepare-dataset {run.path / RECIPE}` prepares it again"
    if not prepared:
        return None, f"the resolved recipe names no data.dataset_prepared_path: {again}"
    fingerprint = (run.started or {}).get("data_fingerprint")
    if fingerprint is None:
        fingerprint = _fingerprint_again(run)
        if fingerprint is None:
            return None, (
                f"progress.jsonl records no data fingerprint and the resolved recipe's data matches no "
                f"preparation in {prepared} (files changed, or the cache was removed): {again}"
            )
    path = Path(prepared) / fingerprint / "manifest.json"
    if not path.is_file():
        relative = (
            ""
            if Path(prepared).is_absolute()
            else " (a relative path: run the report from the folder training ran from)"
        )
        return None, (
            f"the prepared dataset {fingerprint} is not in {prepared}{relative}; moved or removed? {again}"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except ValueError as exc:
        return None, f"{path} is not valid JSON ({exc}): {again}"


def _fingerprint_again(run: RunData) -> str | None:
    from finetune.data.prepare.fingerprint import cached
    from finetune.recipe import load_recipe

    if not (run.path / RECIPE).is_file() or (run.recipe.get("model") or {}).get("kind") == "diffusion":
        return None
    try:
        found = cached(load_recipe(str(run.path / RECIPE), []))
    except (FinetuneError, OSError):
        return None
    return None if found is None else found[1].get("fingerprint")
