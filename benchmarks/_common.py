"""What the benchmarks that compare finetune with a peer (TRL, a bare Accelerate loop, another
layout) share: runs in fresh subprocesses with a set number of CPU threads, repeats interleaved,
and every run reported next to the median.

Why: on a 2-core machine shared with other jobs, the SmolLM2 LoRA SFT comparison run twice in a row
gave finetune / TRL 10.2x, then 0.67x (1.66x on the idle machine): each tool fell to 12-18 tokens/s
whenever another process used a core, because with two threads every kernel waits for the thread
whose core was taken. With one thread per run (OMP_NUM_THREADS=1) a run slows down in proportion to
the load instead of stalling; interleaving the tools (A B, B A, A B, ...) puts them under the same
load; printing every run shows a disturbed one instead of hiding it in a single figure.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(threads: int, **extra: str) -> dict[str, str]:
    """The environment of a benchmark subprocess: `threads` CPU threads (0 = every core), the
    checkout importable, output unbuffered; `extra` variables on top."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads or os.cpu_count() or 1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def run_kwargs(threads: int) -> dict:
    """subprocess.run arguments for a child: run from the checkout, `child_env(threads)`, output kept."""
    return {"cwd": REPO, "env": child_env(threads), "capture_output": True, "text": True}


def check(result: subprocess.CompletedProcess) -> None:
    """Stop the benchmark with the child's last output when it failed."""
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"benchmark run failed (exit {result.returncode})")


def machine(*, cpu: bool = False) -> str:
    """The GPU (unless `cpu`: a CPU comparison on a machine that has one), else the CPU core count
    and model, with torch's version."""
    import torch

    if torch.cuda.is_available() and not cpu:
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def interleaved(
    names: list[str], repeats: int, run: Callable[[str, int], dict], describe: Callable[[dict], str]
) -> dict[str, list[dict]]:
    """Every run of every name: `run(name, repeat)` for repeat 1..repeats, the names in turn and in
    alternating order (A B, B A, ...) so neither always runs first; each run is printed to stderr
    as `describe(result)` as soon as it ends.

    >>> order = []
    >>> runs = interleaved(["a", "b"], 3, lambda n, i: order.append(n) or {"i": i}, lambda r: "")
    >>> order, [r["i"] for r in runs["b"]]
    (['a', 'b', 'b', 'a', 'a', 'b'], [1, 2, 3])
    """
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(1, repeats + 1):
        for name in names if repeat % 2 else names[::-1]:
            result = run(name, repeat)
            runs[name].append(result)
            if describe(result):
                print(f"{name} run {repeat}: {describe(result)}", file=sys.stderr, flush=True)
    return runs


def medians(runs: list[dict]) -> dict:
    """One row for a table: the median of each numeric field that differs between the runs, every
    other field as the first run has it (settings stay as they are: an int stays an int).

    >>> medians([{"tokens_per_sec": 10.0, "chunk": 512}, {"tokens_per_sec": 30.0, "chunk": 512}])
    {'tokens_per_sec': 20.0, 'chunk': 512}
    """
    row = dict(runs[0])
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric and len(set(values)) > 1:
            row[key] = statistics.median(values)
    return row


def every_run(runs: list[dict], key: str, spec: str = ".2f") -> str:
    """Each run's `key`, in run order, for the table's "every run" column.

    >>> every_run([{"s": 1.234}, {"s": 2.0}], "s")
    '1.23, 2.00'
    """
    return ", ".join(format(r[key], spec) for r in runs)
