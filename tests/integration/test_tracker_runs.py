"""`train.report_to` with real trackers, offline: one tiny training run logs to mlflow (a local file
store), trackio (its local SQLite storage) and wandb (offline mode); each tracker's record, read back
with its own reader, holds exactly the numbers progress.jsonl holds, and the generation samples table
reaches the trackers that take tables."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integration._run import DEMO, REPO, demo_overrides, progress, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in ("mlflow", "trackio", "wandb")),
        reason="mlflow-skinny, trackio and wandb are in the test extra",
    ),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_prepared: Path) -> dict:
    """The demo trained 4 steps, evaluated (loss and a generation set) at steps 2 and 4, logging to
    mlflow, trackio and wandb at once."""
    tmp = tmp_path_factory.mktemp("trackers")
    (tmp / "wandb").mkdir()
    variables = {
        "MLFLOW_TRACKING_URI": (tmp / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 refuses the file store unless asked
        "TRACKIO_DIR": str(tmp / "trackio"),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp / "wandb"),
        "WANDB_SILENT": "true",
    }
    return tracked_run(tmp, "[mlflow, trackio, wandb]", variables, demo_prepared)


def tracked_run(tmp: Path, report_to: str, variables: dict[str, str], prepared: Path) -> dict:
    """The demo trained 4 steps in `tmp`, evaluated (loss and a 2-question generation set) at steps 2
    and 4, logging every step to the trackers `report_to` names, with `variables` set."""
    questions = tmp / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({"q": f"What is {a} plus 1?", "a": f"#### {a + 1}"}) + "\n" for a in (2, 5))
    )
    gen_sets = f"[{{name: arith, path: {questions}, field_prompt: q, field_expected: a, max_new_tokens: 6}}]"
    overrides = [
        *demo_overrides(tmp),
        "--train.max_steps", "4", "--train.eval_steps", "2", "--train.log_steps", "1",
        "--train.log_format", "structured", "--train.save_epochs", "0",
        "--train.report_to", report_to, "--eval.generation_sets", gen_sets,
        "--data.dataset_prepared_path", str(prepared),  # the session's (tests/conftest.py)
    ]  # fmt: skip
    result = run(
        [sys.executable, str(REPO / "finetune" / "train.py"), str(DEMO), *overrides], extra_env=variables
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {"tmp": tmp, "out": tmp / "out", "result": result, "env": variables}


def expected_history(out: Path) -> dict[str, list[tuple[int, float]]]:
    """progress.jsonl's numbers per key as (step, value), as finetune.trackers.log_scalars sends them
    (the logged steps; event records such as the started one are the log's own)."""
    history = defaultdict(list)
    for record in progress(out):
        if record.get("event") in ("started", "extended"):  # the log's own records, not sent to trackers
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                history[key].append((record["step"], float(value)))
    return {k: sorted(v) for k, v in history.items()}


def tracker_view(history: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """A tracker's history under progress.jsonl's names: the generation scores go to trackers as
    `eval/<set>_<metric>` and to progress.jsonl as `eval_<set>_<metric>`."""
    return {k.replace("eval/", "eval_", 1): sorted(v) for k, v in history.items()}


def test_the_run_says_nothing_about_missing_tables(trained):
    # All three take numbers, tables and images: no "takes no tables" note.
    assert "takes no" not in trained["result"].stdout + trained["result"].stderr
    assert {"loss", "eval_loss", "eval_arith_exact_match"} <= set(expected_history(trained["out"]))


def test_mlflow_holds_the_progress_numbers_and_the_samples_table(trained, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=trained["env"]["MLFLOW_TRACKING_URI"])
    (mlrun,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, key)]
        for key in mlrun.data.metrics
    }
    assert tracker_view(history) == expected_history(trained["out"])
    assert mlrun.data.params["train.max_steps"] == "4"  # the resolved recipe, flattened
    table = client.download_artifacts(mlrun.info.run_id, "eval/arith_samples.json", str(trained["tmp"]))
    content = json.loads(Path(table).read_text())
    assert content["columns"][:2] == ["step", "prompt"]
    assert [row[0] for row in content["data"]] == [2, 2, 4, 4]


def test_trackio_holds_the_progress_numbers_and_the_samples_table(trained):
    # trackio reads TRACKIO_DIR when imported: read its storage in a process of its own.
    reader = (
        "import json; from trackio.sqlite_storage import SQLiteStorage as S; "
        "(r,) = S.get_runs('out'); print(json.dumps(S.get_logs('out', r)))"
    )
    found = run([sys.executable, "-c", reader], extra_env=trained["env"], quiet=False)
    assert found.returncode == 0, found.stderr[-3000:]
    history, tables = defaultdict(list), []
    for log in json.loads(found.stdout.strip().splitlines()[-1]):
        for key, value in log.items():
            if isinstance(value, dict) and value.get("_type") == "trackio.table":
                tables.append((key, log["step"], value))
            elif key not in ("step", "timestamp") and isinstance(value, (int, float)):
                history[key].append((log["step"], float(value)))
    assert tracker_view(history) == expected_history(trained["out"])
    assert [(key, step) for key, step, _ in tables] == [("eval/arith_samples", 2), ("eval/arith_samples", 4)]
    assert "What is 2 plus 1?" in json.dumps(tables[0][2])


def wandb_records(path: Path):
    """The protobuf records of a wandb run file. wandb (0.31) keeps its reader in its Go core, so the
    framing is read here: LevelDB log blocks of 32 KiB after a 7-byte `:W&B` header, each chunk with
    a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); the records are wandb's
    own `Record` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_progress_numbers_and_the_samples_table(trained):
    (run_file,) = (trained["tmp"] / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history, tables = defaultdict(list), []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        # A table comes as nested keys: <name>/_type = "table-file", <name>/nrows, <name>/path, ...
        found = [
            k.removesuffix("/_type") for k, v in items.items() if k.endswith("/_type") and v == "table-file"
        ]
        tables += [(name, items["_step"]) for name in found]
        for key, value in items.items():
            inside_table = any(key.startswith(name + "/") for name in found)
            if not key.startswith("_") and not inside_table and isinstance(value, (int, float)):
                history[key].append((items["_step"], float(value)))
    assert tracker_view(history) == expected_history(trained["out"])
    assert tables == [("eval/arith_samples", 2), ("eval/arith_samples", 4)]


# ------------------------------------------------------------------------ comet_ml, an offline archive


@pytest.fixture(scope="module")
def archived(tmp_path_factory: pytest.TempPathFactory, demo_prepared: Path) -> dict:
    """The same tiny run logging to comet_ml (an offline experiment zip). clearml is tested in
    tests/unit/test_trackers.py only: in a training run its repository detection forks a `git`
    subprocess from the multi-threaded trainer, which was seen to hang task.close() at the end."""
    pytest.importorskip(
        "comet_ml", reason="comet_ml is in the tracking extra (pip install 'finetune[tracking]')"
    )
    tmp = tmp_path_factory.mktemp("archives")
    variables = {
        "COMET_START_ONLINE": "false",
        "COMET_OFFLINE_DIRECTORY": str(tmp / "comet"),
        "COMET_ERROR_TRACKING_ENABLE": "false",
        "COMET_DISABLE_AUTO_LOGGING": "1",
    }
    archived = tracked_run(tmp, "[comet_ml]", variables, demo_prepared)
    assert "takes no" not in archived["result"].stdout + archived["result"].stderr
    return archived


def test_comet_ml_offline_archive_holds_the_progress_numbers_and_the_samples_table(archived):
    import zipfile

    (archive,) = (archived["tmp"] / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as f:
        payloads = [
            json.loads(line).get("payload", {}) for line in f.read("messages.json").decode().splitlines()
        ]
        history = defaultdict(list)
        for metric in (p["metric"] for p in payloads if "metric" in p):
            # Comet's own system metrics (sys.*, "process duration") are not finetune's.
            own = metric["metricName"].startswith("sys.") or metric["metricName"] == "process duration"
            if not own and metric["step"] is not None:
                history[metric["metricName"]].append((metric["step"], float(metric["metricValue"])))
        assert tracker_view(history) == expected_history(archived["out"])
        uploads = [
            p["additional_params"] | {"file": p["file_path"]} for p in payloads if p.get("additional_params")
        ]
        tables = sorted((u["fileName"], u["step"]) for u in uploads if u.get("fileName", "").endswith(".csv"))
        assert tables == [("eval_arith_samples_step2.csv", 2), ("eval_arith_samples_step4.csv", 4)]
        header = f.read(next(u["file"] for u in uploads if u.get("fileName") == tables[0][0])).decode()
        assert header.splitlines()[0].startswith("prompt,")
