"""`finetune report` on two real tiny runs (SFT with a generation set and `finetune eval`, DPO with a
damaged progress.jsonl line), rendered in a real headless Chromium (Debian's package, which .ci/run
installs; driven by Playwright with executable_path, so no browser is downloaded): no console or page
errors, every chart holds exactly the points progress.jsonl logged, per run, with their values; the
tables hold eval.json's rows and the manifest's numbers; a screenshot is a non-blank PNG.

Training also records the planner's prediction in progress.jsonl's "started" record: it equals what
`finetune plan` predicts for the same recipe.

The runs and commands run in this process (tests/inprocess.py); the browser makes the module slow."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.integration._run import DEMO, REPO, progress, short_run, train_here
from tests.integration._run import cli_here as cli  # in this process (tests/inprocess.py)

pytestmark = pytest.mark.slow  # a browser

CHROMIUM = Path("/usr/bin/chromium")
DPO_DEMO = REPO / "recipes" / "demo" / "tiny_dpo_cpu.yaml"
GEN_SET = "[{{name: arith, path: {path}, field_prompt: question, field_expected: answer, max_new_tokens: 6}}]"


def _train(recipe: Path, out: Path, prepared: Path, *extra: str) -> None:
    cmd = short_run("--train.max_steps", "4", "--train.eval_steps", "2", "--train.save_steps", "0", *extra)
    result = train_here(
        recipe, *cmd, "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Two runs, eval.json of the SFT one, a line cut short at the end of the DPO log, the report."""
    tmp = tmp_path_factory.mktemp("report")
    questions = tmp / "questions.jsonl"
    rows = [
        {"question": f"What is {a} plus {b}? <b>", "answer": f"#### {a + b}"} for a, b in ((2, 3), (7, 1))
    ]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gen_set = GEN_SET.format(path=questions)
    sft, dpo, prepared = tmp / "sft", tmp / "dpo", tmp / "prepared"
    _train(DEMO, sft, prepared, "--eval.generation_sets", gen_set)
    _train(DPO_DEMO, dpo, prepared, "--train.eval_on_start", "false")
    evaluated = cli(
        "eval", str(DEMO), "--adapter", str(sft), "--no-progress", "--train.output_dir", str(sft),
        "--data.dataset_prepared_path", str(prepared), "--eval.generation_sets", gen_set,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    with open(dpo / "progress.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.6\n')  # as a crash mid-write leaves it
    made = cli("report", str(sft), str(dpo), "--output", str(tmp / "report.html"))
    assert made.returncode == 0, made.stderr[-3000:]
    return {"tmp": tmp, "sft": sft, "dpo": dpo, "prepared": prepared, "stdout": made.stdout}


def records_of(output_dir: Path) -> list[dict]:
    """progress.jsonl's records, its damaged lines skipped."""
    records = []
    for line in (output_dir / "progress.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def logged_points(output_dir: Path, key: str, source: str) -> list[tuple[float, float]]:
    """(step, value) of `key` as progress.jsonl logged it: step records (the last per step) or "eval"
    records, finite numbers only."""
    records = records_of(output_dir)
    if source == "steps":
        records = list({r["step"]: r for r in records if r.get("event") is None}.values())
    else:
        records = [r for r in records if r.get("event") == "eval"]
    return [
        (float(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]


def test_training_records_the_planner_prediction_and_the_data_fingerprint(report):
    from finetune.plan import make_plan
    from finetune.recipe import load_recipe

    (started,) = [r for r in progress(report["sft"]) if r.get("event") == "started"]
    assert started["step"] == 0 and started["total_steps"] == 4 and started["device"] == "cpu"
    manifest = report["prepared"] / started["data_fingerprint"] / "manifest.json"
    assert manifest.is_file()
    overrides = ["--data.dataset_prepared_path", str(report["prepared"])]
    plan = make_plan(load_recipe(str(DEMO), overrides))
    assert started["memory_plan"]["total_gpu_bytes"] == plan.estimate.total_gpu
    assert [p["name"] for p in started["memory_plan"]["parts"]] == [p.name for p in plan.estimate.parts]
    assert "report of 2 run(s) written to" in report["stdout"]


def test_the_report_renders_in_chromium_with_every_logged_point(report):
    # Skipped without a browser on a developer's machine; CI (.ci/run installs Debian's) must have one.
    if not CHROMIUM.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"CI=true and no Chromium at {CHROMIUM}: .ci/run installs it (apt-get install chromium)"
            )
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    from finetune.evaluation.compare import comparison_rows

    page_file, shot = report["tmp"] / "report.html", report["tmp"] / "report.png"
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on(
                "console",
                lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None,
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on(
                "request",
                lambda r: problems.append(f"request: {r.url}") if not r.url.startswith("file:") else None,
            )
            page.goto(page_file.as_uri())
            charts = page.eval_on_selector_all(
                "figure.chart",
                """figs => figs.map(f => ({key: f.dataset.key, source: f.dataset.source,
                    series: [...f.querySelectorAll('g.series')].map(g => ({run: g.dataset.run,
                      logged: +g.dataset.logged,
                      points: [...g.querySelectorAll('circle.point')].map(c => [+c.dataset.step, +c.dataset.value])}))}))""",
            )
            eval_rows = page.eval_on_selector_all(
                "#eval table.eval tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
            )
            data_text = {run: page.inner_text(f"#data-{run}") for run in ("sft", "dpo")}
            damaged = page.get_attribute('.damaged[data-run="dpo"]', "data-count")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert problems == []
    folders = {"sft": report["sft"], "dpo": report["dpo"]}
    keys = {c["key"] for c in charts}
    assert {"loss", "lr", "grad_norm", "tokens_per_sec", "rewards/margins", "eval_loss"} <= keys
    assert {"eval_arith_exact_match", "eval_rewards/accuracies"} <= keys
    for chart in charts:
        for series in chart["series"]:
            expected = logged_points(folders[series["run"]], chart["key"], chart["source"])
            assert series["logged"] == len(expected) == len(series["points"]), (chart["key"], series["run"])
            assert series["points"] == [list(p) for p in expected], (chart["key"], series["run"])  # exact
        drawn_runs = {s["run"] for s in chart["series"]}
        assert drawn_runs == {
            name for name, f in folders.items() if logged_points(f, chart["key"], chart["source"])
        }
    results = json.loads((report["sft"] / "eval.json").read_text())["results"]
    assert eval_rows == [[label, *values] for label, values in comparison_rows(results)]
    for label, folder in folders.items():
        (started,) = [r for r in records_of(folder) if r.get("event") == "started"]
        manifest = json.loads(
            (report["prepared"] / started["data_fingerprint"] / "manifest.json").read_text()
        )
        assert f"{manifest['rows_in']} / {manifest['rows_kept']}" in data_text[label]
        assert f"{manifest['packing_efficiency']:.4g}" in data_text[label]
    assert damaged == "1"
    _assert_non_blank_png(shot)


def _assert_non_blank_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.width >= 1400 and image.height > 2000  # the full page, every section
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text and charts drawn, not a blank page
