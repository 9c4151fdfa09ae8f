"""Run the `finetune` command or the training entry point in this process, as a subprocess would run it.

The fast tier (`pytest -m "not slow"`) launches no process (tests/conftest.py's guard): a one-process
train or eval whose subject is not the launcher runs here, through the same `main` functions, saving
the 5-15 s a fresh interpreter spends importing torch, transformers and Accelerate.

    result = finetune("eval", str(recipe), "--adapter", str(out))   # finetune.cli.main
    result = train(recipe, "--train.max_steps", "4")                 # finetune/train.py
    assert result.returncode == 0, result.stderr

Both give a `subprocess.CompletedProcess` (returncode, stdout, stderr), so a test reads the same as
with a subprocess. `finetune train ...` runs its CLI (parsing, checks before launch, the launch
command) and then the one training process in this process instead of `accelerate launch`; a
multi-process or DeepSpeed launch is refused (those stay subprocesses: tests/integration/_run.py).

What a run changes process-wide is put back afterwards: Accelerate's singletons (AcceleratorState,
PartialState, GradientState), environment variables (ACCELERATE_*, and whatever the run sets), the
working directory and sys.argv, signal handlers (the loop installs its own), logging (levels,
handlers, filters) and warnings filters, torch's default dtype, grad mode, thread count and
deterministic flags, and the RNG states of random, numpy and torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "finetune" / "train.py"
_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


class NotInProcess(RuntimeError):
    """The command launches more than one process (torchrun, a config file, DeepSpeed): run it as a
    subprocess (tests/integration/_run.py) in a test marked slow."""


def run_environment(extra_env: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a run: tests/integration/_run.py's env() (CPU, unbuffered), minus `unset`,
    plus `extra_env`."""
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "2")
    out["PYTHONUNBUFFERED"] = "1"
    out["ACCELERATE_USE_CPU"] = "true"
    return {k: v for k, v in out.items() if k not in unset} | (extra_env or {})


def finetune(
    *args: str,
    input: str | None = None,
    extra_env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """`finetune ARGS` (finetune.cli.main) in this process; `input` is its stdin. `finetune train` trains
    here too, in one process (NotInProcess for a multi-process or config-file launch)."""
    import finetune.cli

    def main(argv: list[str]) -> int:
        real = finetune.cli.run_supervised
        finetune.cli.run_supervised = _train_here
        try:
            return finetune.cli.main(argv)
        finally:
            finetune.cli.run_supervised = real

    return run_main(main, list(args), prog="finetune", input=input, env=run_environment(extra_env, unset))


def train(
    recipe: str | Path,
    *overrides: str,
    extra_env: dict[str, str] | None = None,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """`python finetune/train.py RECIPE OVERRIDES` (finetune.train.main) in this process: what
    `accelerate launch --num_processes 1 finetune/train.py ...` runs."""
    import finetune.train

    argv = [str(recipe), *overrides]
    return run_main(finetune.train.main, argv, prog=str(TRAIN_SCRIPT), env=run_environment(extra_env, unset))


def _train_here(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Stands in for finetune.launcher.run_supervised under finetune(): the launch command's training
    script and its arguments, run here with the environment the launcher would give it."""
    import finetune.train

    script = cmd.index(str(TRAIN_SCRIPT))
    launcher = cmd[1:script]
    single = launcher[:2] == ["-m", "accelerate.commands.launch"] and "--config_file" not in launcher
    if not single or launcher[launcher.index("--num_processes") + 1] != "1":
        raise NotInProcess(f"`finetune train` would launch {' '.join(launcher)}: run it as a subprocess")
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    return finetune.train.main(cmd[script + 1 :])


def run_main(
    main: Callable[[list[str]], int | None],
    argv: list[str],
    *,
    prog: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`main(argv)` with stdout and stderr captured and stdin fed from `input`, from the repository root
    with `env` as the environment, as an interpreter would run it: its return value or SystemExit code is
    the return code, an exception prints its traceback to stderr and gives 1. Process-wide state is put
    back afterwards (see the module docstring)."""
    out, err = io.StringIO(), io.StringIO()
    with _restored_process_state(), _captured(out, err, input):
        os.environ.clear()
        os.environ.update(env if env is not None else run_environment())
        os.chdir(REPO)
        sys.argv = [prog, *argv]
        try:
            code = _exit_code(main(list(argv)))
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except NotInProcess:
            raise
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    return subprocess.CompletedProcess([prog, *argv], code, out.getvalue(), err.getvalue())


def _exit_code(value: object) -> int:
    """What an interpreter exits with for sys.exit(value)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


# --------------------------------------------------------------------------------------- the state


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons (AcceleratorState with PartialState, GradientState)
    and any process group a run left, so the next Accelerator is built from its own settings."""
    if "accelerate" not in sys.modules:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _restored_process_state() -> Iterator[None]:
    environ, cwd, argv = dict(os.environ), os.getcwd(), list(sys.argv)
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    filters, showwarning = list(warnings.filters), warnings.showwarning
    loggers = _logging_state()
    rng = random.getstate()
    torch_state = _torch_state()
    reset_accelerate()
    try:
        yield
    finally:
        reset_accelerate()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv = argv
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        warnings.filters[:] = filters
        warnings.showwarning = showwarning
        getattr(warnings, "_filters_mutated", lambda: None)()  # invalidate the "already warned" caches
        _restore_logging(loggers)
        random.setstate(rng)
        _restore_torch(torch_state)


def _all_loggers() -> list[logging.Logger]:
    found = [logging.getLogger()]
    found += [x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)]
    return found


def _logging_state() -> dict[str, tuple]:
    return {
        logger.name: (
            logger.level,
            list(logger.handlers),
            list(logger.filters),
            logger.propagate,
            logger.disabled,
        )
        for logger in _all_loggers()
    }


def _restore_logging(saved: dict[str, tuple]) -> None:
    for logger in _all_loggers():
        if logger.name in saved:
            level, handlers, filters, propagate, disabled = saved[logger.name]
            if logger.level != level:  # setLevel clears every logger's cache: only where it changed
                logger.setLevel(level)
            logger.handlers[:], logger.filters[:] = handlers, filters
            logger.propagate, logger.disabled = propagate, disabled
        # A logger made during the run (its module imported then) keeps what its module set up.


def _torch_state() -> dict | None:
    if "torch" not in sys.modules:
        return None
    import numpy as np
    import torch

    return {
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
    }


def _restore_torch(saved: dict | None) -> None:
    if saved is None:
        return
    import numpy as np
    import torch

    torch.set_default_dtype(saved["dtype"])
    torch.set_grad_enabled(saved["grad"])
    torch.set_num_threads(saved["threads"])
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["deterministic_warn_only"])
    torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
    torch.set_rng_state(saved["rng"])
    np.random.set_state(saved["numpy_rng"])


@contextlib.contextmanager
def _captured(out: io.StringIO, err: io.StringIO, input: str | None) -> Iterator[None]:
    """sys.stdout, sys.stderr and sys.stdin replaced; logging handlers that write to the streams being
    replaced (made before the run, e.g. by transformers at import) write to the captured ones meanwhile,
    and handlers made during the run on the captured streams are pointed back afterwards."""
    real = {"stdout": sys.stdout, "stderr": sys.stderr, "stdin": sys.stdin}
    targets = {id(sys.stdout): out, id(sys.__stdout__): out, id(sys.stderr): err, id(sys.__stderr__): err}
    swapped = []
    for handler in _stream_handlers():
        if id(handler.stream) in targets:
            swapped.append((handler, handler.stream))
            handler.setStream(targets[id(handler.stream)])
    sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO(input or "")
    try:
        yield
    finally:
        sys.stdout, sys.stderr, sys.stdin = real["stdout"], real["stderr"], real["stdin"]
        for handler, stream in swapped:
            handler.setStream(stream)
        back = {id(out): real["stdout"], id(err): real["stderr"]}
        for handler in _stream_handlers():
            if id(handler.stream) in back:
                handler.setStream(back[id(handler.stream)])


def _stream_handlers() -> list[logging.StreamHandler]:
    """The StreamHandlers of every logger whose stream can be set (logging's last-resort handler reads
    sys.stderr when it writes: nothing to do for it)."""
    found = {}
    for logger in _all_loggers():
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging._StderrHandler):
                found[id(handler)] = handler
    return list(found.values())
