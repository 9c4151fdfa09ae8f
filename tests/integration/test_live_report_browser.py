"""`finetune report --serve` followed in a real headless Chromium (Debian's, driven by Playwright with
executable_path, as tests/integration/test_run_report_browser.py) while a real tiny training run
writes progress.jsonl: the server starts before the run exists (the page says so), the loss chart's
points grow as the run logs and end equal to progress.jsonl's, per chart, no console or page errors,
no request leaves the server; a screenshot is written and its path printed (and recorded as the
test's `screenshot` property). And the command itself stops cleanly on Ctrl-C (SIGINT): exit code 0,
no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from finetune.report.serve import make_server
from tests.integration._run import DEMO, REPO, accelerate_cmd, env, short_run
from tests.integration.test_run_report_browser import CHROMIUM, logged_points

pytestmark = pytest.mark.slow  # a browser, a training process and a server process

STEPS = 10
LOSS_POINTS = "() => document.querySelectorAll('figure.chart[data-key=\"loss\"] circle.point').length"


def _need_chromium() -> None:
    if not CHROMIUM.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"CI=true and no Chromium at {CHROMIUM}: .ci/run installs it (apt-get install chromium)"
            )
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")


def test_the_live_page_follows_a_training_run_in_chromium(tmp_path, record_property):
    _need_chromium()
    from playwright.sync_api import sync_playwright

    out, prepared, log = tmp_path / "out", tmp_path / "prepared", tmp_path / "train.log"
    server = make_server([str(out)], port=0, poll_s=0.1)  # the run does not exist yet
    threading.Thread(target=server.serve_forever, daemon=True).start()
    shot, problems, counts = tmp_path / "live.png", [], []
    overrides = short_run(
        "--train.max_steps",
        str(STEPS),
        "--train.save_steps",
        "0",
        "--train.micro_batch_size",
        "1",
        "--data.sample_packing_sequence_len",
        "128",
    )  # fmt: skip  (small steps: the suite shares 2 cores)
    cmd = accelerate_cmd(
        DEMO, *overrides, "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)
    )
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)  # fmt: skip
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.on("request", lambda r: None if r.url.startswith(server.url) else problems.append(f"request: {r.url}"))  # fmt: skip
                page.goto(server.url)
                # selectors, not wait_for_function: its polling evaluates strings, which the page's
                # Content-Security-Policy (no 'unsafe-eval') refuses
                page.wait_for_selector('#live-status[data-state="live"]')
                assert "cannot be read now" in page.inner_text("#runs")  # before training starts
                with open(log, "w") as sink:
                    training = subprocess.Popen(
                        cmd, cwd=REPO, env=env(), stdout=sink, stderr=subprocess.STDOUT
                    )
                    deadline = time.monotonic() + 600
                    while training.poll() is None and time.monotonic() < deadline:
                        counts.append(page.evaluate(LOSS_POINTS))
                        time.sleep(0.1)
                    if training.poll() is None:
                        training.kill()
                assert training.wait() == 0, log.read_text()[-4000:]
                page.locator("#runs").get_by_text(f"finished at step {STEPS}").wait_for()
                counts.append(page.evaluate(LOSS_POINTS))
                charts = page.eval_on_selector_all(
                    "figure.chart",
                    """figs => figs.map(f => ({key: f.dataset.key, source: f.dataset.source,
                        series: [...f.querySelectorAll('g.series')].map(g => ({run: g.dataset.run,
                          points: [...g.querySelectorAll('circle.point')].map(c => [+c.dataset.step, +c.dataset.value])}))}))""",
                )
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.close()
    print(f"screenshot of the live page: {shot}")
    record_property("screenshot", str(shot))
    assert problems == []
    assert counts == sorted(counts), counts  # the points only grow
    assert len(set(counts)) >= 3, counts  # seen growing while training ran, not only at the end
    assert counts[-1] == len(logged_points(out, "loss", "steps")) == STEPS
    assert {"loss", "lr", "grad_norm", "tokens_per_sec"} <= {c["key"] for c in charts}
    for chart in charts:
        (series,) = chart["series"]
        assert series["points"] == [list(p) for p in logged_points(out, chart["key"], chart["source"])], (
            chart["key"]
        )
    from PIL import Image

    with Image.open(shot) as image:
        assert image.width >= 1400 and image.height >= 900
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text and charts drawn, not a blank page


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_the_server_cleanly(tmp_path, inherited):
    """Also when started with SIGINT ignored, as a background job of a non-interactive shell (or nohup)
    starts it: Python would then leave SIGINT ignored (CI ran the suite that way and the server never
    stopped)."""
    ignore = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    run = tmp_path / "run"
    run.mkdir()
    (run / "progress.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    server = subprocess.Popen(
        [sys.executable, "-m", "finetune.cli", "report", str(run), "--serve", "--port", "0"],
        cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignore),
    )  # fmt: skip
    try:
        line = server.stdout.readline()
        assert "serving the report of 1 run(s) at http://127.0.0.1:" in line, line + server.stderr.read()
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        with urllib.request.urlopen(url, timeout=60) as response:
            assert response.status == 200 and b"finetune report" in response.read()
        events = urllib.request.urlopen(url + "events", timeout=60)  # an open event stream too
        assert events.readline().startswith(b"retry:")
        server.send_signal(signal.SIGINT)
        stdout, stderr = server.communicate(timeout=60)
        events.close()
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr and stderr.strip() == "", stderr
    assert "stopped serving the report" in stdout
