"""finetune.trackers: the recipe's choices come from its table; scalars, tables and images reach each
tracker the way it takes them (tensorboard for real; a number-only tracker gets numbers alone)."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune import trackers
from finetune.errors import FinetuneError
from finetune.recipe import TrainSection


class FakeTracker:
    def __init__(self, name: str):
        self.name, self.logged, self.tables, self.images = name, [], [], []

    def log(self, values, step=None):
        self.logged.append((values, step))

    def log_table(self, name, columns=None, data=None, step=None):
        self.tables.append((name, columns, data, step))

    def log_images(self, values, step=None, **kwargs):
        self.images.append((values, step, kwargs))


def _accelerator(*names):
    found = [FakeTracker(n) for n in names]

    def log(values, step=None):
        for tracker in found:
            tracker.log(values, step)

    return SimpleNamespace(trackers=found, log=log, is_main_process=True), found


def test_report_to_offers_exactly_the_table():
    choices = typing.get_args(typing.get_args(TrainSection.model_fields["report_to"].annotation)[0])
    assert set(choices) == set(trackers.TRACKERS)


def test_scalars_leave_out_text_booleans_none_and_the_step():
    acc, (tb,) = _accelerator("tensorboard")
    trackers.log_scalars(acc, {"step": 3, "loss": 1.5, "n": 2, "ok": True, "lr": None, "s": "x"}, 3)
    assert tb.logged == [({"loss": 1.5, "n": 2}, 3)]


def test_without_trackers_nothing_is_logged():
    acc = SimpleNamespace(trackers=[], log=lambda *a, **k: pytest.fail("logged without trackers"))
    trackers.log_scalars(acc, {"loss": 1.0}, 1)
    trackers.log_table(acc, "t", ["a"], [["b"]], 1)
    trackers.log_images(acc, "v", [[object()]], ["c"], 1)


def test_tables_go_as_markdown_to_text_trackers_and_as_tables_to_wandb():
    acc, (tb, wb) = _accelerator("tensorboard", "wandb")
    trackers.log_table(acc, "eval/set_samples", ["prompt", "output"], [["2+2?", "4 | four"]], 7)
    assert tb.logged == [({"eval/set_samples": "| prompt | output |\n|---|---|\n| 2+2? | 4 \\| four |"}, 7)]
    assert wb.tables == [("eval/set_samples", ["prompt", "output"], [["2+2?", "4 | four"]], 7)]


def test_a_number_only_tracker_gets_no_table_and_the_run_says_so(monkeypatch):
    spec = trackers.TrackerSpec("numbers", "numbers-pkg", table=None, images=None)
    monkeypatch.setitem(trackers.TRACKERS, "numbers", spec)
    monkeypatch.setattr(trackers, "_installed", lambda name: True)
    acc, (only,) = _accelerator("numbers")
    trackers.log_table(acc, "t", ["a"], [["b"]], 1)
    trackers.log_scalars(acc, {"loss": 2.0}, 1)
    assert only.logged == [({"loss": 2.0}, 1)] and only.tables == []
    (note,) = trackers.check_available(["numbers"])
    assert "numbers takes no tables or images" in note and "progress.jsonl" in note


def test_a_missing_tracker_is_an_error_naming_the_package(monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda name: False)
    with pytest.raises(FinetuneError, match=r"report_to: wandb is not installed \(pip install wandb\)"):
        trackers.check_available(["wandb"])


def test_tensorboard_receives_scalars_text_and_images_for_real(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")
    from accelerate.tracking import TensorBoardTracker
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorBoardTracker("run", str(tmp_path))
    tracker.start()
    acc = SimpleNamespace(trackers=[tracker], log=lambda values, step=None: tracker.log(values, step=step))
    trackers.log_scalars(acc, {"loss": 0.25}, 2)
    trackers.log_table(acc, "samples", ["prompt", "output"], [["hi", "there"]], 2)
    trackers.log_images(acc, "validation", [[Image.new("RGB", (4, 4), (255, 0, 0))]], ["a red square"], 2)
    tracker.finish()
    folder = next(tmp_path.rglob("events.out.tfevents*")).parent
    events = EventAccumulator(str(folder), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == [0.25]
    assert "samples/text_summary" in events.Tags()["tensors"]
    assert events.Images("validation/00")[0].width == 4


def test_report_to_offers_every_tracker_accelerate_ships():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(trackers.TRACKERS) == set(LOGGER_TYPE_TO_CLASS)
    section = TrainSection(output_dir="out", report_to=list(LOGGER_TYPE_TO_CLASS))
    assert section.report_to == list(LOGGER_TYPE_TO_CLASS)


@pytest.mark.parametrize("name", sorted(trackers.TRACKERS))
def test_each_tracker_missing_is_an_error_naming_its_pip_install(monkeypatch, name):
    monkeypatch.setattr(trackers, "_installed", lambda n: False)
    package = "'aim<4'" if name == "aim" else name
    with pytest.raises(FinetuneError, match=rf"report_to: {name} is not installed \(pip install {package}\)"):
        trackers.check_available([name])


@pytest.mark.parametrize("name", ["comet_ml", "aim", "clearml", "dvclive", "swanlab"])
def test_a_number_only_tracker_is_checked_by_accelerate_and_noted(name):
    """The trackers the suite cannot run offline: Accelerate's own availability check refuses them
    when absent; when present the run notes that tables and images stay in progress.jsonl."""
    if trackers._installed(name):
        (note,) = trackers.check_available([name])
        assert f"{name} takes no tables or images" in note
    else:
        with pytest.raises(FinetuneError, match=f"pip install {trackers.TRACKERS[name].package}"):
            trackers.check_available([name])
    assert trackers.missing_notes([name]) == [
        f"train.report_to: {name} takes no tables or images; they stay in progress.jsonl and output_dir/samples"
    ]


def test_mlflow_receives_scalars_tables_and_images_for_real(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow-skinny is in the test extra")
    from accelerate.tracking import MLflowTracker
    from mlflow.tracking import MlflowClient
    from PIL import Image

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracker = MLflowTracker("exp")
    tracker.start()
    acc = SimpleNamespace(trackers=[tracker], log=lambda values, step=None: tracker.log(values, step=step))
    trackers.log_scalars(acc, {"loss": 0.25, "note": "text"}, 2)
    trackers.log_table(acc, "eval/samples", ["prompt", "output"], [["hi", "there"]], 2)
    trackers.log_table(acc, "eval/samples", ["prompt", "output"], [["2+2?", "4"]], 4)
    trackers.log_images(acc, "validation", [[Image.new("RGB", (4, 4), (255, 0, 0))]], ["a red square"], 2)
    run_id = tracker.tracker.info.run_id
    tracker.finish()
    client = MlflowClient()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(2, 0.25)]
    table = json.loads(
        Path(client.download_artifacts(run_id, "eval/samples.json", str(tmp_path))).read_text()
    )
    assert table["columns"] == ["step", "prompt", "output"]
    assert table["data"] == [[2, "hi", "there"], [4, "2+2?", "4"]]  # MLflow appends to the artifact
    images = [f.path for f in client.list_artifacts(run_id, "images")]
    assert images and all("validation" in p for p in images)


def test_validate_accepts_the_peers_trackers_and_explain_lists_them(tmp_path, capsys):
    """`report_to: mlflow` was refused before issue 22; --explain documents every choice."""
    from finetune.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {model_path: org/base}\ndata: {datasets: [{path: a.jsonl, type: alpaca}]}\n")
    choice = "[mlflow, trackio, wandb, comet_ml, aim, clearml, dvclive, swanlab, tensorboard]"
    assert (
        main(["validate", str(recipe), "--train.output_dir", "out", "--train.report_to", choice, "--explain"])
        == 0
    )
    out = capsys.readouterr().out
    description = next(line for line in out.splitlines() if line.strip().startswith("# Trackers"))
    assert all(name in description for name in trackers.TRACKERS)
    assert "  report_to:\n  - mlflow\n  - trackio\n" in out
