"""`finetune report --serve`: how long a progress.jsonl line takes to reach the page.

A run folder with `--steps` logged steps is served in this process (finetune.report.serve, the default
poll of POLL_S seconds); one step record at a time is appended, `--lines` times, and the time is taken
from the write to:

- sse: the `update` event holding the new point, read by an HTTP client (the server's part alone);
- browser: the page in headless Chromium (Debian's /usr/bin/chromium through Playwright, when present)
  drawing the new point in the loss chart (Playwright's wait_for_selector).

Each line is written at a random moment within a poll (as a training step's line is), so the figures
include the wait for the server's next look.

Each figure: median, 90th percentile and maximum in milliseconds. With a poll every POLL_S seconds a
line waits POLL_S / 2 on average for the server to look; the rest is reading the folder, rendering
the page body and, in the browser, parsing it.

Usage: python benchmarks/bench_report_live.py [--steps 200] [--lines 30]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from finetune.report.serve import POLL_S, make_server  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")


def write_run(folder: Path, steps: int) -> Path:
    folder.mkdir()
    (folder / "recipe.resolved.yaml").write_text("model:\n  model_path: null\ntrain:\n  objective: sft\n")
    with open(folder / "progress.jsonl", "w") as f:
        f.writelines(json.dumps(record(s)) + "\n" for s in range(1, steps + 1))
    return folder


def record(step: int) -> dict:
    return {"step": step, "loss": 4.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 900.0}


def append(folder: Path, step: int) -> float:
    # at a random moment: right after an update the server has just looked, and would always wait a
    # whole poll; a training step's line comes at any point of it
    time.sleep(random.uniform(0, POLL_S))
    with open(folder / "progress.jsonl", "a") as f:
        f.write(json.dumps(record(step)) + "\n")
    return time.perf_counter()


def sse_latencies(server, folder: Path, first: int, lines: int) -> list[float]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("GET", "/events")
    response = conn.getresponse()  # kept: the stream closes with it
    stream = response.fp

    def next_update() -> str:
        data = []
        while True:
            line = stream.readline().decode()
            if line.startswith("data: "):
                data.append(line[6:])
            elif line == "\n" and data:
                return "".join(data)

    next_update()  # the page as it is on connecting
    out = []
    for step in range(first, first + lines):
        sent = append(folder, step)
        while f'data-step="{step}"' not in next_update():
            pass
        out.append(time.perf_counter() - sent)
    conn.close()
    return out


def browser_latencies(server, folder: Path, first: int, lines: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            page = browser.new_page()
            page.goto(server.url)
            page.wait_for_selector('#live-status[data-state="live"]')
            # selectors, not wait_for_function: its polling evaluates strings, which the page's
            # Content-Security-Policy (no 'unsafe-eval') refuses
            for step in range(first, first + lines):
                sent = append(folder, step)
                page.wait_for_selector(
                    f'figure.chart[data-key="loss"] g.series[data-logged="{step}"]', timeout=30_000
                )
                out.append(time.perf_counter() - sent)
        finally:
            browser.close()
    return out


def summary(name: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"| {name} | {len(ms)} | {statistics.median(ms):.0f} | {p90:.0f} | {ms[-1]:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps logged before measuring (200)")
    parser.add_argument("--lines", type=int, default=30, help="lines appended and timed per path (30)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_run(Path(tmp) / "run", args.steps)
        server = make_server([str(folder)], port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            rows = [summary("sse (HTTP client)", sse_latencies(server, folder, args.steps + 1, args.lines))]
            if CHROMIUM.is_file():
                first = args.steps + args.lines + 1
                rows.append(summary("browser (Chromium, point drawn)", browser_latencies(server, folder, first, args.lines)))  # fmt: skip
            else:
                rows.append(f"| browser | skipped: no Chromium at {CHROMIUM} | | | |")
        finally:
            server.shutdown()
            server.close()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"poll {POLL_S} s, {args.steps} steps logged before, {os.cpu_count()} CPU(s), load {load:.1f}, "
          f"{platform.platform()}")  # fmt: skip
    print("| path | lines | median ms | p90 ms | max ms |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
