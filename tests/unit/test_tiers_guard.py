"""The fast tier's guard (tests/tiers.py): outside the slow tier, starting a process or sending a signal
fails the test, with the fix in the message, even when the code under test swallows the exception."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import pytest

from tests.tiers import ProcessLaunched, no_processes

pytest_plugins = ["pytester"]


def _child() -> None:  # a multiprocessing target (never runs: the start is refused)
    pass


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param(
            lambda: subprocess.run([sys.executable, "-c", "pass"], check=False), id="subprocess.run"
        ),
        pytest.param(lambda: os.popen("true").read(), id="os.popen"),
        pytest.param(lambda: os.system("true"), id="os.system"),
        pytest.param(lambda: os.posix_spawn("/bin/true", ["true"], os.environ), id="os.posix_spawn"),
        pytest.param(
            lambda: multiprocessing.get_context("spawn").Process(target=_child).start(), id="mp-spawn"
        ),
        pytest.param(
            lambda: multiprocessing.get_context("fork").Process(target=_child).start(), id="mp-fork"
        ),
        pytest.param(lambda: os.kill(os.getpid(), signal.SIGUSR1), id="os.kill"),
        pytest.param(lambda: signal.raise_signal(signal.SIGUSR1), id="raise_signal"),
    ],
)
def test_every_launch_and_signal_is_refused_with_the_fix(launch) -> None:
    with no_processes("tests/x.py::test_y") as refusals, pytest.raises(ProcessLaunched) as refused:
        launch()
    message = str(refused.value)
    assert message.startswith("tests/x.py::test_y is in the fast tier (not marked slow) but ")
    assert "@pytest.mark.slow" in message and "tests/inprocess.py" in message
    assert refusals.seen == [message]


def test_a_liveness_probe_is_allowed_and_everything_is_put_back() -> None:
    real_kill, real_execute = os.kill, subprocess.Popen._execute_child
    with no_processes("t") as refusals:
        os.kill(os.getpid(), 0)  # signal 0 only asks whether the process exists (locks do)
    assert refusals.seen == []
    assert os.kill is real_kill and subprocess.Popen._execute_child is real_execute


def test_the_guard_fails_a_fast_test_that_swallows_the_refusal_and_spares_slow_ones(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import subprocess, sys
        import pytest

        UNGUARDED = subprocess.Popen._execute_child  # as collected (the outer test's guard, if any)

        def launch():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except Exception:
                pass  # swallowed: the guard still fails the test

        def test_fast():
            launch()

        @pytest.mark.slow
        def test_slow():
            assert subprocess.Popen._execute_child is UNGUARDED  # no guard in the slow tier

        def test_real_model(smollm2):
            pass

        @pytest.fixture
        def smollm2():
            return None
        """
    )
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow")
    result = pytester.runpytest_inprocess("-p", "tests.tiers", "-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    output = result.stdout.str()
    assert "::test_fast is in the fast tier (not marked slow) but started a subprocess: " in output
    assert "::test_real_model is in the fast tier but uses the real model (smollm2): mark the test" in output
