"""Trackers (`train.report_to`): which exist, whether they are installed, and one way to send them
scalars, text tables and images.

Accelerate runs the trackers (`Accelerator(log_with=...)`, `init_trackers`, `end_training`); this
module owns what finetune sends them, so objectives and the engine never ask which tracker is on:

* `log_scalars`: numbers, to every tracker.
* `log_table`: rows of text (generation samples), as the tracker's own table where it has one
  (wandb, mlflow, trackio, comet_ml's table asset, clearml's report_table), as markdown text where it
  takes text (tensorboard), as one text per row (aim's Text, swanlab's Text), and as a JSON-lines
  file in the tracker's folder where it takes no text (dvclive: <live dir>/tables/<name>.jsonl).
  progress.jsonl always holds the same rows; a tracker spec without a table function would make the
  run say once that tables stay there.
* `log_images`: images with captions (diffusion validation samples), through each tracker's own
  image API (captions where it has them); the images are always saved under output_dir/samples as
  well.

Adding a tracker is one `TrackerSpec` entry in TRACKERS (the recipe's `train.report_to` choices
come from this table). The table is plain data with lazy imports: the recipe layer reads it
without importing torch or accelerate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker Accelerate ships: its name in `log_with`, the package that provides it, and how it
    takes text tables and images (None: it takes only numbers)."""

    name: str
    package: str
    table: Callable[[Any, str, list[str], list[list[Any]], int], None] | None
    images: Callable[[Any, str, list[list[Any]], list[str], int], None] | None


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows as a markdown table (cells on one line, `|` escaped).

    >>> print(_markdown_table(["prompt", "output"], [["2+2?", "4 | four"]]))
    | prompt | output |
    |---|---|
    | 2+2? | 4 \\| four |
    """
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |")
    return "\n".join(lines)


def _text_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    tracker.log({name: _markdown_table(columns, rows)}, step=step)


def _wandb_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    tracker.log_table(name, columns=columns, data=[[str(c) for c in row] for row in rows], step=step)


def _tensorboard_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    import numpy as np

    # One NHWC grid per prompt; TensorBoard has no captions, the prompt's index names the grid.
    for p, row in enumerate(images):
        tracker.log_images(
            {f"{name}/{p:02d}": np.stack([np.asarray(im) for im in row])}, step=step, dataformats="NHWC"
        )


def _wandb_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    import wandb

    pictures = [wandb.Image(im, caption=c) for c, row in zip(captions, images, strict=True) for im in row]
    tracker.log({name: pictures}, step=step)


def _mlflow_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    import mlflow

    # MLflow's own table: a JSON artifact per name that each call appends to; the step is a column.
    data = {"step": [step] * len(rows)} | {c: [str(row[i]) for row in rows] for i, c in enumerate(columns)}
    mlflow.log_table(data, artifact_file=f"{name}.json", run_id=tracker.tracker.info.run_id)


def _mlflow_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    import mlflow

    # Step-keyed images (MLflow's image history); one key per prompt as for TensorBoard.
    for p, row in enumerate(images):
        for i, image in enumerate(row):
            mlflow.log_image(image, key=f"{name}/{p:02d}_{i}", step=step)


def _trackio_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    import trackio

    tracker.log(
        {name: trackio.Table(columns=columns, data=[[str(c) for c in row] for row in rows])}, step=step
    )


def _trackio_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    import trackio

    pictures = {
        f"{name}/{p:02d}_{i}": trackio.Image(image, caption=caption)
        for p, (caption, row) in enumerate(zip(captions, images, strict=True))
        for i, image in enumerate(row)
    }
    tracker.log(pictures, step=step)


def _cells(rows: list[list[Any]]) -> list[list[str]]:
    return [[str(c) for c in row] for row in rows]


def _comet_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    # Comet's own table asset (a CSV per call, shown in its Assets tab); the file name carries the step.
    tracker.tracker.log_table(
        f"{_file_name(name)}_step{step}.csv", tabular_data=_cells(rows), headers=columns
    )


def _comet_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    for p, (caption, row) in enumerate(zip(captions, images, strict=True)):
        for i, image in enumerate(row):
            tracker.tracker.log_image(
                image, name=f"{name}/{p:02d}_{i}", step=step, metadata={"caption": caption}
            )


def _aim_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    from aim import Text

    # Aim has no table type: one Text per row (its columns as `column: value` lines), the row's index
    # in the context, under the table's name and step.
    for i, row in enumerate(rows):
        text = "\n".join(f"{c}: {v}" for c, v in zip(columns, row, strict=True))
        tracker.tracker.track(Text(text), name=name, step=step, context={"row": i})


def _aim_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    from aim import Image

    for p, (caption, row) in enumerate(zip(captions, images, strict=True)):
        for i, image in enumerate(row):
            tracker.tracker.track(
                Image(image, caption=caption), name=f"{name}/{p:02d}", step=step, context={"image": i}
            )


def _clearml_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    # Accelerate's ClearMLTracker.log_table: ClearML's Logger.report_table, title/series from the name.
    tracker.log_table(name, columns=columns, data=_cells(rows), step=step)


def _clearml_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    import numpy as np

    # Accelerate's ClearMLTracker.log_images (Logger.report_image); ClearML has no captions.
    pictures = {
        f"{name}/{p:02d}_{i}": np.asarray(im) for p, row in enumerate(images) for i, im in enumerate(row)
    }
    tracker.log_images(pictures, step=step)


def _file_name(name: str) -> str:
    """A table's name as one file name.

    >>> _file_name("eval/arith_samples")
    'eval_arith_samples'
    """
    return name.replace("/", "_")


def _dvclive_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    # DVCLive takes numbers, images, plots and artifacts, but no text: a JSON-lines table file in the
    # Live folder (output with the run's metrics), one object per row with its step.
    folder = Path(tracker.tracker.dir) / "tables"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{_file_name(name)}.jsonl", "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"step": step} | dict(zip(columns, _cells([row])[0], strict=True))) + "\n")


def _dvclive_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    # Live.log_image writes plots/images/<name>; the step is in the name so steps do not overwrite.
    for p, row in enumerate(images):
        for i, image in enumerate(row):
            tracker.tracker.log_image(f"{_file_name(name)}/step{step}_{p:02d}_{i}.png", image)


def _swanlab_table(tracker, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    import swanlab

    # SwanLab's Text media, one per row (columns as `column: value` lines).
    texts = ["\n".join(f"{c}: {v}" for c, v in zip(columns, row, strict=True)) for row in rows]
    tracker.tracker.log({name: [swanlab.Text(t) for t in texts]}, step=step)


def _swanlab_images(tracker, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    import swanlab

    pictures = [swanlab.Image(im, caption=c) for c, row in zip(captions, images, strict=True) for im in row]
    tracker.tracker.log({name: pictures}, step=step)


# Every tracker Accelerate 1.15 ships (accelerate.tracking.LOGGER_TYPE_TO_CLASS), each through the
# object Accelerate's tracker wraps (`tracker.tracker`) or Accelerate's own table/image method.
TRACKERS: dict[str, TrackerSpec] = {
    spec.name: spec
    for spec in (
        TrackerSpec("tensorboard", "tensorboard", table=_text_table, images=_tensorboard_images),
        TrackerSpec("wandb", "wandb", table=_wandb_table, images=_wandb_images),
        TrackerSpec("mlflow", "mlflow", table=_mlflow_table, images=_mlflow_images),
        TrackerSpec("trackio", "trackio", table=_trackio_table, images=_trackio_images),
        TrackerSpec("comet_ml", "comet_ml", table=_comet_table, images=_comet_images),
        # Accelerate's AimTracker speaks the aim 3 API (is_aim_available is False for aim 4).
        TrackerSpec("aim", "'aim<4'", table=_aim_table, images=_aim_images),
        TrackerSpec("clearml", "clearml", table=_clearml_table, images=_clearml_images),
        TrackerSpec("dvclive", "dvclive", table=_dvclive_table, images=_dvclive_images),
        TrackerSpec("swanlab", "swanlab", table=_swanlab_table, images=_swanlab_images),
    )
}


def _installed(name: str) -> bool:
    import accelerate.utils

    return bool(getattr(accelerate.utils, f"is_{name}_available")())


def check_available(names: Sequence[str]) -> list[str]:
    """Refuse a tracker that is not installed (naming the package); returns `missing_notes(names)`."""
    for name in names:
        if not _installed(name):
            raise FinetuneError(
                f"train.report_to: {name} is not installed (pip install {TRACKERS[name].package})"
            )
    return missing_notes(names)


def missing_notes(names: Sequence[str]) -> list[str]:
    """A note for each tracker that takes only numbers or no images (what it misses stays in
    progress.jsonl and output_dir/samples), for the run to print once."""
    notes = []
    for name in names:
        spec = TRACKERS[name]
        missing = [what for what, how in (("tables", spec.table), ("images", spec.images)) if how is None]
        if missing:
            notes.append(
                f"train.report_to: {name} takes no {' or '.join(missing)}; they stay in progress.jsonl and "
                "output_dir/samples"
            )
    return notes


def start(
    accelerator,
    names: Sequence[str],
    *,
    run_name: str,
    config: dict[str, Any],
    output_dir: Path | None = None,
) -> None:
    """Start the trackers of `train.report_to` on the main process with the run's flat settings, and
    say once what a tracker will not receive (make_accelerator has checked they are installed)."""
    if names and accelerator.is_main_process:
        if "mlflow" in names:
            note = mlflow_store(output_dir)
            if note:
                _use_mlflow_store(os.environ["MLFLOW_TRACKING_URI"])
                accelerator.print(note)
        accelerator.init_trackers(run_name, config=config)
        for note in missing_notes(names):
            accelerator.print(note)


def mlflow_store(output_dir: Path | None, environ=None) -> str | None:
    """Where MLflow keeps the run when nothing says so: mlflow-skinny's own default (sqlite:///mlflow.db)
    needs the SQL extras it does not ship (`KeyError: 'sqlite'`), and MLflow 3 refuses a file store
    unless MLFLOW_ALLOW_FILE_STORE is true. Without MLFLOW_TRACKING_URI the run goes to a file store in
    output_dir/mlruns; a file: URI the user set is allowed as such. Returns the note to say once, or None.

    >>> env = {}
    >>> mlflow_store(Path("/runs/a"), env).startswith("train.report_to: mlflow")
    True
    >>> env["MLFLOW_TRACKING_URI"], env["MLFLOW_ALLOW_FILE_STORE"]
    ('file:///runs/a/mlruns', 'true')
    """
    environ = os.environ if environ is None else environ  # at call time: os.environ may have been replaced
    uri = environ.get("MLFLOW_TRACKING_URI")
    if not uri and output_dir is not None:
        store = (Path(output_dir).resolve() / "mlruns").as_uri()
        environ["MLFLOW_TRACKING_URI"] = store
        environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (
            f"train.report_to: mlflow logs to a file store in {Path(output_dir) / 'mlruns'} (MLFLOW_TRACKING_URI "
            f"is not set; `mlflow ui --backend-store-uri {store}` shows it)"
        )
    if uri and uri.startswith("file:") and "MLFLOW_ALLOW_FILE_STORE" not in environ:
        environ["MLFLOW_ALLOW_FILE_STORE"] = (
            "true"  # the user asked for a file store: MLflow 3 wants this too
        )
    return None


def _use_mlflow_store(store: str) -> None:
    """MLflow's own tracking URI set to `store` too: a URI set in-process (mlflow.set_tracking_uri, which
    some libraries call with MLflow's default) wins over the environment variable, and the default
    (sqlite:///mlflow.db) is what mlflow-skinny cannot open. One set by the user to anything else stays."""
    import mlflow
    from mlflow.tracking._tracking_service import utils  # the in-process URI has no public getter

    current = utils._tracking_uri
    if current is None or (current.startswith("sqlite:") and current.endswith("/mlflow.db")):
        mlflow.set_tracking_uri(store)


def log_scalars(accelerator, values: dict[str, Any], step: int) -> None:
    """The numeric values (booleans and None left out) to every tracker; nothing without trackers."""
    numbers = {
        k: v
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
    }
    if accelerator.trackers and numbers:
        accelerator.log(numbers, step=step)


def log_table(accelerator, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
    """Rows of text to every tracker that takes tables or text (see the module docstring)."""
    for tracker in accelerator.trackers:
        spec = TRACKERS.get(tracker.name)
        if spec is not None and spec.table is not None:
            spec.table(tracker, name, columns, rows, step)


def log_images(accelerator, name: str, images: list[list[Any]], captions: list[str], step: int) -> None:
    """Images (one list per caption) to every tracker with an image API."""
    for tracker in accelerator.trackers:
        spec = TRACKERS.get(tracker.name)
        if spec is not None and spec.images is not None:
            spec.images(tracker, name, images, captions, step)
