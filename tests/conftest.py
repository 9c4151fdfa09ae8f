"""Shared pytest fixtures.

Hub: every test session gets a Hugging Face Hub-compatible server on loopback (tests/hub_server.py)
and the environment points huggingface_hub and datasets at it, with a fake token and throwaway
caches; subprocesses inherit it, so they use the same server. huggingface_hub, datasets and
transformers read that environment once, at import. So it is set when this file is imported, the
earliest moment pytest gives: `pytest_configure` would be too late for `pytest tests/unit/x.py`,
which imports tests/unit/conftest.py (and whatever it imports) before configuring.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub_server import HubServer

# The fast tier's guard (tests/tiers.py): a test not marked slow launches no process.
pytest_plugins = ["tests.tiers"]

REPO_ROOT = Path(__file__).resolve().parent.parent
# The most pytest-xdist workers `-n auto` starts: two, for CI's 2-core machine (docs/CONTRIBUTING.md);
# more would run as many training subprocesses side by side, each holding a model, and none was
# measured. PYTEST_XDIST_AUTO_NUM_WORKERS or `-n N` override it.
MAX_AUTO_WORKERS = 2


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cap_threads_per_xdist_worker() -> None:
    """Under xdist, give each worker (and the subprocesses it starts, which inherit the environment)
    its share of the CPUs: torch would otherwise start one thread per CPU in every worker, and the
    workers' threads would fight over the cores. Set before torch is imported; a value the user set wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, _usable_cpus() // workers))


_cap_threads_per_xdist_worker()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest -p no:xdist has no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per usable CPU, at most MAX_AUTO_WORKERS (PYTEST_XDIST_AUTO_NUM_WORKERS wins)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(MAX_AUTO_WORKERS, _usable_cpus()))


# Variables that would send the clients elsewhere (real Hub, user caches, offline mode).
_HUB_ENV_TO_UNSET = (
    "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE", "HF_XET_CACHE",
    "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HUGGINGFACE_CO_STAGING",
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
)  # fmt: skip


def _start_test_hub() -> tuple[HubServer, Path, dict[str, str | None]]:
    """Start the session's Hub and point the environment at it; returns what teardown needs."""
    imported = [name for name in ("huggingface_hub", "datasets", "transformers") if name in sys.modules]
    if imported:
        raise pytest.UsageError(
            f"{', '.join(imported)} was imported before tests/conftest.py could point it at the test Hub "
            "(HF_ENDPOINT is read at import time). Do not import it from a pytest plugin."
        )
    tmp = Path(tempfile.mkdtemp(prefix="finetune-tests-"))
    server = HubServer(tmp / "hub").start()  # binds port 0: the OS picks a free port, no race
    env = {
        "HF_ENDPOINT": server.endpoint,
        "HF_TOKEN": server.token,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp / "hf_home"),
        "HF_DATASETS_CACHE": str(tmp / "hf_datasets_cache"),
        "FINETUNE_GGUF_CACHE": str(tmp / "gguf_cache"),  # GGUF conversions (finetune.gguf), once per session
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_UPDATE_DOWNLOAD_COUNTS": "0",  # else datasets pings an S3 URL on every load
        "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"])),
    }
    saved = {name: os.environ.get(name) for name in (*env, *_HUB_ENV_TO_UNSET)}
    for name in _HUB_ENV_TO_UNSET:
        os.environ.pop(name, None)
    os.environ.update(env)
    return server, tmp, saved


_TEST_HUB = _start_test_hub()


def pytest_unconfigure(config: pytest.Config) -> None:
    server, tmp, saved = _TEST_HUB
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The root of the repository (where pyproject.toml is)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Real data shared beside the repository (`../shared/data`, or `$FINETUNE_SHARED_DATA` for a
    checkout elsewhere, e.g. a git worktree); skips the test when absent."""
    path = Path(os.environ.get("FINETUNE_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.skip(f"shared data not available at {path} (tests using real data need ../shared/data)")
    return path


@pytest.fixture(scope="session")
def hub_server() -> HubServer:
    """The session's test Hub: `.endpoint`, `.token`, `.requests` (log), `.read_file(...)`."""
    return _TEST_HUB[0]


@pytest.fixture
def hub_repo_id(hub_server: HubServer, request: pytest.FixtureRequest) -> str:
    """A repo id unique to this test, in the test user's namespace (the repo is not created)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-.")[:60]
    return f"{hub_server.user}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fresh_accelerator_state() -> Iterator[None]:
    """Accelerate's process-wide state reset before and after the test (tests/fakes.py says why)."""
    from tests.fakes import reset_accelerator_state

    reset_accelerator_state()
    yield
    reset_accelerator_state()


@pytest.fixture
def without_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """importlib.util.find_spec finds no bitsandbytes during the test, as where it is not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )


# ------------------------------------------------------------------- shared demo data and checkpoints


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder of this test session shared by its pytest-xdist workers (the parent of each worker's
    base temp, `pytest-N/`); without xdist, in the session's base temp."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def demo_prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `data.dataset_prepared_path` for the demo recipes' runs, shared by the whole session (all
    workers, and subprocess runs too): a preparation is named by its fingerprint and built under a lock
    by whichever process needs it first (finetune.data.prepare), so runs with the same data settings
    tokenize once. A test that inspects the folder or expects `(built)` keeps a folder of its own."""
    return shared_folder(tmp_path_factory, "demo-prepared")


# The demo trained by `demo_adapter`: 6 steps of LoRA on q_proj and v_proj (with the demo's
# modules_to_save), gradient checkpointing, a step logged each step, evaluated with a generation set of 3
# questions at steps 3 and 6, logged to TensorBoard.
DEMO_ADAPTER_RUN = (
    "--train.max_steps", "6", "--train.eval_steps", "3", "--train.log_steps", "1", "--train.save_epochs", "0",
    "--train.log_format", "structured", "--train.report_to", "[tensorboard]",
    "--lora.lora_target_modules", "[q_proj,v_proj]", "--train.gradient_checkpointing", "true",
)  # fmt: skip


@pytest.fixture(scope="session")
def demo_adapter(tmp_path_factory: pytest.TempPathFactory, demo_prepared: Path) -> dict:
    """The demo trained once for the session (DEMO_ADAPTER_RUN, in process), shared by the eval, chat,
    export and merge tests across modules and xdist workers (the first worker to ask trains it under a
    lock; the others read it). {"tmp": folder, "out": tmp/out (the adapter), "result": the run's
    CompletedProcess, "gen_sets": the --eval.generation_sets value, "prepared": demo_prepared}. Tests
    only read the adapter folder (or write files of their own into it, as eval.json)."""
    import json
    import subprocess

    from filelock import FileLock

    from tests.inprocess import train

    tmp = shared_folder(tmp_path_factory, "demo-adapter")
    questions = tmp / "questions.jsonl"
    gen_sets = f"[{{name: arith, path: {questions}, field_prompt: question, field_expected: answer, max_new_tokens: 12}}]"
    saved = tmp / "result.json"
    with FileLock(tmp / ".lock"):
        if not saved.is_file():
            rows = [
                {"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}
                for a, b in ((2, 3), (7, 1), (4, 4))
            ]
            questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
            demo = REPO_ROOT / "recipes" / "demo" / "tiny_sft_cpu.yaml"
            overrides = [
                "--train.output_dir",
                str(tmp / "out"),
                "--data.dataset_prepared_path",
                str(demo_prepared),
            ]
            result = train(demo, *overrides, *DEMO_ADAPTER_RUN, "--eval.generation_sets", gen_sets)
            saved.write_text(json.dumps([result.args, result.returncode, result.stdout, result.stderr]))
    result = subprocess.CompletedProcess(*json.loads(saved.read_text()))
    return {"tmp": tmp, "out": tmp / "out", "result": result, "gen_sets": gen_sets, "prepared": demo_prepared}


@pytest.fixture(autouse=True)
def tools_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the slow tier, tools run in this process (tests/tools_in_process.py): the fast tier starts
    no process, and the worker's own behaviour (timeouts, prints, crashes) is tested in the slow tier."""
    if request.node.get_closest_marker("slow") is None:
        from tests.tools_in_process import InProcessRunner

        monkeypatch.setattr("finetune.generation.tool_worker.ToolRunner", InProcessRunner)
