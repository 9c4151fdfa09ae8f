"""tests/inprocess.py: a command run in this process reads like a subprocess (return code, stdout, stderr)
and leaves the process as it found it (Accelerate's singletons, environment, signals, logging, torch)."""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import warnings

import pytest
import torch

from tests.inprocess import REPO, NotInProcess, finetune, run_main

DEMO = REPO / "recipes" / "demo" / "tiny_sft_cpu.yaml"


def test_output_and_exit_codes_as_a_subprocess_gives_them() -> None:
    def main(argv):
        print("out", *argv)
        print("err", file=sys.stderr)
        return 3

    result = run_main(main, ["a", "b"], prog="prog")
    assert (result.returncode, result.stdout, result.stderr) == (3, "out a b\n", "err\n")
    assert result.args == ["prog", "a", "b"]
    assert run_main(lambda argv: sys.exit(2), [], prog="p").returncode == 2
    assert run_main(lambda argv: None, [], prog="p").returncode == 0
    said = run_main(lambda argv: sys.exit("bad"), [], prog="p")
    assert (said.returncode, said.stderr) == (1, "bad\n")
    crashed = run_main(lambda argv: 1 / 0, [], prog="p")
    assert crashed.returncode == 1 and "Traceback" in crashed.stderr and "ZeroDivisionError" in crashed.stderr


def test_stdin_cwd_argv_and_the_environment_of_a_run(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    seen = {}

    def main(argv):
        seen.update(
            cwd=os.getcwd(), argv=list(sys.argv), line=input(), cpu=os.environ.get("ACCELERATE_USE_CPU")
        )
        return 0

    run_main(main, ["x"], prog="finetune", input="hello\n", env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    assert seen == {"cwd": str(REPO), "argv": ["finetune", "x"], "line": "hello", "cpu": "true"}
    assert os.getcwd() == str(tmp_path)


def test_process_wide_state_is_put_back(fresh_accelerator_state) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    logger = logging.getLogger("finetune.test_inprocess")
    argv, filters = list(sys.argv), list(warnings.filters)
    handler = signal.getsignal(signal.SIGTERM)
    random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), torch.rand(1))
    random.seed(1)
    torch.manual_seed(1)

    def main(argv):
        Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=4)
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
        os.environ["FINETUNE_TEST_SET_BY_A_RUN"] = "1"
        signal.signal(signal.SIGTERM, lambda *a: None)
        logger.setLevel(logging.ERROR)
        logger.addHandler(logging.StreamHandler(sys.stderr))
        warnings.simplefilter("ignore")
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        random.random()
        torch.rand(3)
        return 0

    assert run_main(main, [], prog="p").returncode == 0
    assert not AcceleratorState._shared_state and not PartialState._shared_state
    assert "FINETUNE_TEST_SET_BY_A_RUN" not in os.environ
    assert (
        "ACCELERATE_MIXED_PRECISION" not in os.environ or os.environ["ACCELERATE_MIXED_PRECISION"] != "bf16"
    )
    assert signal.getsignal(signal.SIGTERM) is handler and sys.argv == argv and warnings.filters == filters
    assert logger.level == logging.NOTSET and logger.handlers == []
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert (random.random(), torch.rand(1)) == expected  # the draws a run made are undone


def test_a_handler_made_before_the_run_writes_into_its_capture() -> None:
    logger = logging.getLogger("finetune.test_inprocess.before")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        result = run_main(lambda argv: logger.warning("said during the run"), [], prog="p")
        assert "said during the run" in result.stderr
        assert handler.stream is sys.stderr
    finally:
        logger.removeHandler(handler)


def test_finetune_runs_the_cli_in_this_process() -> None:
    result = finetune("validate", str(DEMO), "--train.max_steps", "3")
    assert result.returncode == 0, result.stderr
    assert "max_steps: 3" in result.stdout and "valid" in result.stderr
    usage = finetune("validate")
    assert usage.returncode == 2 and "usage: finetune" in usage.stderr


def test_a_multi_process_launch_is_refused(tmp_path) -> None:
    with pytest.raises(NotInProcess, match=r"torch\.distributed\.run"):
        finetune("train", str(DEMO), "--accelerate-config", "multi_cpu", "--train.output_dir", str(tmp_path))
