"""finetune.trackers: the recipe's choices come from its table; scalars, tables and images reach each
tracker the way it takes them (tensorboard for real; a number-only tracker gets numbers alone)."""

from __future__ import annotations

import typing
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
