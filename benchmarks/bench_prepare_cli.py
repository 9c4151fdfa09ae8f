"""`finetune prepare-dataset` through the CLI, process start included: a cold preparation of the SFT demo
vs a cache hit of the same recipe (and `finetune validate`, the floor: a process that reads the recipe).

A cache hit is found from the fingerprint alone (finetune/data/prepare/fingerprint.py), so it should cost little
more than `validate`; the target is a cache hit <= 0.35x of a cold prepare. Cold runs get a fresh
prepared folder and a fresh datasets cache each, as a new user's first run does.

    python benchmarks/bench_prepare_cli.py --repeats 3 --write-results
    python benchmarks/bench_prepare_cli.py --baseline /path/to/other/checkout   # and that checkout, same run
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTION_START, SECTION_END = "<!-- prepare-cli:start -->", "<!-- prepare-cli:end -->"
RECIPE = "recipes/demo/tiny_sft_cpu.yaml"
TARGET = 0.35


def timed(cmd: list[str], repo: Path, env: dict) -> float:
    """Wall seconds of one command, process start included; fails loudly when the command fails."""
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return seconds


def measure(repo: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each cold prepare, cache hit and validate (`repeats` of each)."""
    cli = [sys.executable, "-m", "finetune.cli"]
    times: dict[str, list[float]] = {"cold": [], "hit": [], "validate": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(repo), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        prepared = ["--data.dataset_prepared_path", f"{tmp}/prepared"]
        for i in range(repeats):
            shutil.rmtree(f"{tmp}/prepared", ignore_errors=True)
            cold_env = {**env, "HF_DATASETS_CACHE": f"{tmp}/hf-datasets-{i}"}
            times["cold"].append(timed([*cli, "prepare-dataset", RECIPE, *prepared], repo, cold_env))
        for _ in range(repeats):
            times["hit"].append(timed([*cli, "prepare-dataset", RECIPE, *prepared], repo, env))
        for _ in range(repeats):
            times["validate"].append(timed([*cli, "validate", RECIPE], repo, env))
    return times


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def report(
    times: dict[str, list[float]], repeats: int, baseline: tuple[str, dict[str, list[float]]] | None
) -> str:
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["hit"] / median["cold"]
    runs = {k: ", ".join(f"{s:.2f}" for s in v) for k, v in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    before = []
    if baseline is not None:
        name, old = baseline
        for kind, label in (("cold", "cold"), ("hit", "cache hit")):
            runs_old = ", ".join(f"{x:.2f}" for x in old[kind])
            before.append(f"| before ({name}): {label} | {statistics.median(old[kind]):.2f} | {runs_old} |")
    return "\n".join(
        [
            "### Through the CLI: cold prepare vs cache hit of the SFT demo, process start included",
            "",
            f"| command | median s (of {repeats}) | runs s |",
            "|---|---|---|",
            f"| `finetune prepare-dataset {RECIPE}`, cold | {median['cold']:.2f} | {runs['cold']} |",
            f"| the same again, cache hit | {median['hit']:.2f} | {runs['hit']} |",
            f"| `finetune validate {RECIPE}` | {median['validate']:.2f} | {runs['validate']} |",
            *before,
            "",
            f"Cache hit / cold: **{ratio:.2f}x** (target <= {TARGET}x: {'met' if ratio <= TARGET else 'NOT met'}). "
            "A cache hit imports neither torch, transformers nor datasets (test: tests/integration/"
            "test_prepare_cli.py); before, quiet.py imported torch and the hit loaded the splits with datasets.",
            "",
            f"Machine: {os.cpu_count()} CPU cores ({_cpu_name()}), GPU: none, "
            f"1-minute load average {load:.1f} at the end of the run (shared machine: absolute times are noisy); "
            f"Python {platform.python_version()}.",
            "",
            f"Command: `python benchmarks/bench_prepare_cli.py --repeats {repeats} --write-results"
            + (" --baseline <checkout>`" if baseline else "`"),
        ]
    )


def write_results(text: str) -> None:
    """Replace this benchmark's block in RESULTS.md (after the prepare-dataset section), or add it there."""
    content = RESULTS.read_text(encoding="utf-8")
    block = f"{SECTION_START}\n{text}\n{SECTION_END}"
    if SECTION_START in content:
        head, rest = content.split(SECTION_START, 1)
        content = head + block + rest.split(SECTION_END, 1)[1]
    else:
        anchor = "<!-- prepare-dataset:end -->"
        content = content.replace(anchor, f"{anchor}\n\n{block}", 1)
    RESULTS.write_text(content, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. before a change), measured too")
    parser.add_argument("--write-results", action="store_true", help=f"write the figures to {RESULTS}")
    args = parser.parse_args(argv)
    baseline = None
    if args.baseline is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline, capture_output=True, text=True
        ).stdout.strip()
        baseline = (
            f"commit {commit}" if commit else str(args.baseline),
            measure(args.baseline.resolve(), args.repeats),
        )
    text = report(measure(args.repo.resolve(), args.repeats), args.repeats, baseline)
    print(text)
    if args.write_results:
        write_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
