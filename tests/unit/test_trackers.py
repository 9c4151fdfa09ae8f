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


def test_every_tracker_takes_tables_and_images():
    """Each tracker Accelerate ships has a table and an image path: no run notes missing tables."""
    assert all(spec.table and spec.images for spec in trackers.TRACKERS.values())
    assert trackers.missing_notes(list(trackers.TRACKERS)) == []


def _red_square():
    from PIL import Image

    return Image.new("RGB", (4, 4), (255, 0, 0))


def _log_all(tracker) -> None:
    acc = SimpleNamespace(trackers=[tracker], log=lambda values, step=None: tracker.log(values, step=step))
    trackers.log_scalars(acc, {"loss": 0.25}, 2)
    trackers.log_table(acc, "eval/set_samples", ["prompt", "output"], [["hi", "there"], ["2+2?", "4"]], 2)
    trackers.log_images(acc, "validation", [[_red_square()]], ["a red square"], 2)


def test_comet_ml_offline_receives_scalars_table_and_image_for_real(tmp_path, monkeypatch):
    monkeypatch.setenv("COMET_START_ONLINE", "false")  # an OfflineExperiment: a zip in the directory below
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")  # no reports to Comet's Sentry
    pytest.importorskip("comet_ml", reason="comet_ml is in the tracking extra")
    import zipfile

    from accelerate.tracking import CometMLTracker

    tracker = CometMLTracker("run")
    tracker.start()
    _log_all(tracker)
    tracker.finish()
    with zipfile.ZipFile(next(tmp_path.glob("*.zip"))) as archive:
        messages = [json.loads(line) for line in archive.read("messages.json").decode().splitlines()]
        payloads = [m.get("payload", m) for m in messages]
        metrics = [p["metric"] for p in payloads if "metric" in p and p["metric"]["metricName"] == "loss"]
        assert [(m["metricValue"], m["step"]) for m in metrics] == [(0.25, 2)]
        params = [
            p["additional_params"] | {"file_path": p["file_path"]}
            for p in payloads
            if p.get("additional_params")
        ]
        uploads = {q.get("fileName", q.get("figName")): q for q in params}
        table = uploads["eval_set_samples_step2.csv"]
        assert archive.read(table["file_path"]).decode().splitlines() == [
            "prompt,output",
            "hi,there",
            "2+2?,4",
        ]
        assert uploads["validation/00_0"]["step"] == 2 and uploads["eval_set_samples_step2.csv"]["step"] == 2


def test_clearml_offline_receives_scalars_table_and_image_for_real(tmp_path, monkeypatch):
    # Read when clearml is imported: an offline session in CLEARML_CACHE_DIR/offline, no server.
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path))
    pytest.importorskip("clearml", reason="clearml is in the tracking extra")
    from accelerate.tracking import ClearMLTracker

    # No repository detection: its background `git` subprocess, forked from this multi-threaded test
    # process, was seen to hang (the child never exec'd) and with it task.close().
    tracker = ClearMLTracker(
        "run", project_name="finetune", task_name="test", auto_connect_frameworks={"detect_repository": False}
    )
    tracker.start()
    _log_all(tracker)
    folder = Path(tracker.task.get_offline_mode_folder())
    tracker.finish()
    events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    events = [e for line in events for e in (line if isinstance(line, list) else [line])]
    by_type = {(e["type"], e["metric"]): e for e in events}
    assert by_type["training_stats_scalar", "loss"]["value"] == 0.25
    table = json.loads(by_type["plot", "eval/set_samples"]["plot_str"])["data"][0]
    assert table["type"] == "table" and table["header"]["values"] == ["prompt", "output"]
    assert by_type["plot", "eval/set_samples"]["iter"] == 2
    assert ("training_debug_image", "validation/00_0") in by_type


class _Recorder:
    """The object an Accelerate tracker wraps (aim's Run, dvclive's Live, swanlab's run): records calls."""

    def __init__(self, folder=None):
        self.calls, self.dir = [], str(folder)

    def __getattr__(self, method):
        return lambda *args, **kwargs: self.calls.append((method, args, kwargs))


def _media_module(monkeypatch, name: str):
    """A stand-in for aim / swanlab (not installable here without downgrading shared packages): their
    Text and Image record what they were built from."""
    module = SimpleNamespace(
        Text=lambda text, **kw: ("Text", text, kw), Image=lambda image, **kw: ("Image", image.size, kw)
    )
    monkeypatch.setitem(__import__("sys").modules, name, module)


def test_aim_gets_a_text_per_row_and_captioned_images(monkeypatch):
    _media_module(monkeypatch, "aim")
    run = _Recorder()
    _log_all(SimpleNamespace(name="aim", tracker=run, log=lambda values, step=None: None))
    texts = [(a[0], k) for m, a, k in run.calls if a[0][0] == "Text"]
    assert texts == [
        (
            ("Text", "prompt: hi\noutput: there", {}),
            {"name": "eval/set_samples", "step": 2, "context": {"row": 0}},
        ),
        (
            ("Text", "prompt: 2+2?\noutput: 4", {}),
            {"name": "eval/set_samples", "step": 2, "context": {"row": 1}},
        ),
    ]
    (image,) = [(a[0], k) for m, a, k in run.calls if a[0][0] == "Image"]
    assert image == (
        ("Image", (4, 4), {"caption": "a red square"}),
        {"name": "validation/00", "step": 2, "context": {"image": 0}},
    )


def test_swanlab_gets_texts_and_captioned_images(monkeypatch):
    _media_module(monkeypatch, "swanlab")
    run = _Recorder()
    _log_all(SimpleNamespace(name="swanlab", tracker=run, log=lambda values, step=None: None))
    logged = [a[0] | {"step": k["step"]} for m, a, k in run.calls if m == "log"]
    assert logged == [
        {
            "eval/set_samples": [
                ("Text", "prompt: hi\noutput: there", {}),
                ("Text", "prompt: 2+2?\noutput: 4", {}),
            ],
            "step": 2,
        },
        {"validation": [("Image", (4, 4), {"caption": "a red square"})], "step": 2},
    ]


def test_dvclive_gets_a_table_file_and_step_named_images(tmp_path):
    live = _Recorder(tmp_path)
    _log_all(SimpleNamespace(name="dvclive", tracker=live, log=lambda values, step=None: None))
    rows = (tmp_path / "tables" / "eval_set_samples.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in rows] == [
        {"step": 2, "prompt": "hi", "output": "there"},
        {"step": 2, "prompt": "2+2?", "output": "4"},
    ]
    ((method, (name, image), _),) = live.calls
    assert (method, name, image.size) == ("log_image", "validation/step2_00_0.png", (4, 4))


@pytest.mark.slow  # mlflow runs `git` (GitPython) to tag the run with the repository's state
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


@pytest.mark.slow  # MLflow runs `git version` for its run tags: a process
def test_mlflow_without_a_tracking_uri_logs_to_a_file_store_in_output_dir(
    tmp_path, monkeypatch, capsys, request
):
    """mlflow-skinny's own default store (sqlite:///mlflow.db) fails with KeyError 'sqlite', and MLflow 3
    refuses a file store unless asked: with no MLFLOW_TRACKING_URI the run starts a file store in
    output_dir/mlruns (said once), and metrics land there."""
    pytest.importorskip("mlflow", reason="mlflow-skinny is in the test extra")
    import mlflow
    from accelerate.tracking import MLflowTracker
    from mlflow.tracking import MlflowClient

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):  # unset, and unset again afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    # MLflow's in-process URI at its default, as a library that called mlflow.set_tracking_uri(
    # mlflow.get_tracking_uri()) leaves it (CI met this: the in-process URI wins over the variable)
    mlflow.set_tracking_uri(mlflow.get_tracking_uri())
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # set_tracking_uri sets it (when it changes)
    request.addfinalizer(lambda: mlflow.set_tracking_uri(None))
    run = tmp_path / "run"
    started = []
    acc = SimpleNamespace(
        is_main_process=True,
        print=print,
        init_trackers=lambda name, config: started.append(MLflowTracker(name)),
    )
    trackers.start(acc, ["mlflow"], run_name="run", config={}, output_dir=run)
    assert "logs to a file store in" in capsys.readouterr().out
    (tracker,) = started
    tracker.start()
    tracker.log({"loss": 0.5}, step=1)
    run_id = tracker.tracker.info.run_id
    tracker.finish()
    assert (run / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 0.5)]
