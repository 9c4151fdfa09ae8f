"""`finetune report`'s page from output_dirs written by hand: charts hold exactly the logged points,
text is escaped, what is missing is said with the command that makes it, damaged progress.jsonl lines
are counted, not fatal; a folder that is not a run is an error naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.errors import FinetuneError
from finetune.report import build_report
from finetune.report.charts import MAX_POINTS, Series, decimate, line_chart

PLAN = {
    "engine": "single (one device, nothing sharded) on 1 GPU, 1 node",
    "micro_batch_size": 2,
    "seq_len": 512,
    "gradient_checkpointing": False,
    "parts": [
        {"name": "weights", "gpu_bytes": 2**30, "host_bytes": 0},
        {"name": "CUDA context", "gpu_bytes": 2**30},
    ],
    "total_gpu_bytes": 3 * 2**30,
    "allowance_bytes": 2**30,
}


def write_run(
    folder: Path, records: list, *, objective: str = "sft", extra_lines: tuple[str, ...] = ()
) -> Path:
    """An output_dir: a resolved recipe and a progress.jsonl of `records` (then `extra_lines` as they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    prepared = folder.parent / "prepared"
    (folder / "recipe.resolved.yaml").write_text(
        f"model:\n  model_path: null\ntrain:\n  objective: {objective}\ndata:\n  dataset_prepared_path: {prepared}\n"
    )
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    (folder / "progress.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def sft_records(steps: int, *, finished: bool = True, peak: float | None = None) -> list[dict]:
    records = [
        {"step": 0, "event": "started", "data_fingerprint": "fp1", "total_steps": steps, "device": "cuda"}
    ]
    records[0]["memory_plan"] = PLAN
    for s in range(1, steps + 1):
        records.append(
            {
                "step": s,
                "loss": 5.0 / s,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_sec": 100.0,
                "peak_mem_gib": peak,
            }
        )
    records.append(
        {"step": steps, "event": "eval", "eval_loss": 2.0, "eval_tokens": 40, "eval_arith_exact_match": 0.5}
    )
    if finished:
        records.append({"step": steps, "event": "finished"})
    return records


def render(tmp_path: Path, *folders: Path) -> str:
    return build_report([str(f) for f in folders], str(tmp_path / "report.html")).read_text()


def series_points(page: str, key: str) -> dict[str, int]:
    """run -> number of <circle> points in chart `key`'s series."""
    chart = re.search(rf'<figure class="chart" data-key="{re.escape(key)}".*?</figure>', page, re.S)
    assert chart, f"no chart {key}"
    groups = re.findall(r'<g class="series" data-run="([^"]*)"(.*?)</g>', chart.group(0), re.S)
    return {run: body.count('<circle class="point"') for run, body in groups}


def test_charts_hold_every_logged_point_per_run_and_only_keys_that_exist(tmp_path):
    sft = write_run(tmp_path / "sft", sft_records(5))
    dpo_steps = [{"step": s, "loss": 0.69, "lr": 1e-4, "rewards/margins": 0.1 * s, "kl": "nan" if s == 2 else 0.1}
                 for s in range(1, 4)]  # fmt: skip
    dpo = write_run(tmp_path / "dpo", dpo_steps, objective="dpo")
    page = render(tmp_path, sft, dpo)
    assert series_points(page, "loss") == {"sft": 5, "dpo": 3}
    assert series_points(page, "tokens_per_sec") == {"sft": 5}
    assert series_points(page, "rewards/margins") == {"dpo": 3}
    assert series_points(page, "kl") == {"dpo": 2} and 'data-skipped="1"' in page  # "nan" is not drawn
    assert series_points(page, "eval_arith_exact_match") == {"sft": 1}
    assert 'data-key="eval_tokens"' not in page and 'data-key="reward"' not in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_text_is_escaped(tmp_path):
    run = write_run(tmp_path / "a<b>", sft_records(2))
    (run / "eval.json").write_text(json.dumps({
        "models": {"base": "<base>", "tuned": str(run)},
        "results": {
            name: {"eval_loss": 1.0, "generation": {"s<1>": {"metric": "contains", "score": 1.0, "n": 1, "samples": [
                {"prompt": "<script>alert(1)</script>", "output": "x & y", "expected": "<i>", "correct": True}]}}}
            for name in ("base", "tuned")
        },
    }))  # fmt: skip
    page = render(tmp_path, run)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "x &amp; y" in page and "a&lt;b&gt;" in page and "s&lt;1&gt; contains (n=1)" in page


def test_an_eval_json_not_in_finetune_evals_form_is_said_not_raised(tmp_path):
    run = write_run(tmp_path / "odd", sft_records(2))
    (run / "eval.json").write_text(json.dumps({"results": {"base": {"eval_loss": 1.0}}}))  # no "generation"
    page = render(tmp_path, run)
    assert "eval.json is not in the form `finetune eval` writes (KeyError: &#x27;generation&#x27;)" in page


def test_missing_eval_manifest_and_plan_say_how_to_get_them(tmp_path):
    old = write_run(tmp_path / "old", [{"step": 1, "loss": 1.0}])  # no started record: an older run
    page = render(tmp_path, old)
    assert "no eval.json in" in page and "finetune eval RECIPE --adapter" in page
    assert "finetune prepare-dataset" in page and "no planner prediction recorded" in page
    assert "not finished: step 1" in page


def test_manifest_and_memory_prediction_beside_the_measured_peak(tmp_path):
    run = write_run(tmp_path / "gpu", sft_records(3, peak=1.5))
    manifest = {"fingerprint": "fp1", "rows_in": 1234, "rows_kept": 1200, "rows_dropped": 34,
                "dropped": {"too_long": 34}, "truncated": 7, "num_tokens": 99, "num_trainable_tokens": 50,
                "packing_efficiency": 0.9731, "splits": {"train": {"examples": 1200, "rows": 80}}}  # fmt: skip
    (tmp_path / "prepared" / "fp1").mkdir(parents=True)
    (tmp_path / "prepared" / "fp1" / "manifest.json").write_text(json.dumps(manifest))
    page = render(tmp_path, run)
    data = page.split('<section id="data">')[1].split("</section>")[0]
    assert "1234 / 1200" in data and "too_long: 34" in data and "0.9731" in data and ">7<" in data
    memory = page.split('<section id="memory">')[1].split("</section>")[0]
    assert 'measured peak allocated (max peak_mem_gib)</td><td class="num">1.5<' in memory
    assert 'total less the fixed CUDA allowance)</td><td class="num">2<' in memory  # 3 GiB - 1 GiB
    assert 'measured / predicted</td><td class="num">0.75<' in memory and "finished at step 3" in page


def test_damaged_lines_are_counted_and_reported_not_fatal(tmp_path):
    run = write_run(
        tmp_path / "crashed", sft_records(3, finished=False), extra_lines=('{"step": 4, "lo', "[1]")
    )
    page = render(tmp_path, run)
    assert re.search(r'class="missing damaged" data-run="crashed" data-count="2"', page)
    assert "(lines 6, 7)" in page and series_points(page, "loss") == {"crashed": 3}
    assert "not finished: step 3 of 3" in page


def test_a_folder_that_is_not_a_run_is_an_error_naming_it(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FinetuneError, match=r"empty is not a training output_dir: it holds neither"):
        build_report([str(tmp_path / "empty")], str(tmp_path / "r.html"))
    assert main(["report", str(tmp_path / "nowhere"), "--output", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "nowhere is not a training output_dir: it does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


def test_long_runs_are_decimated_and_say_how_many_points_were_logged():
    points = [(float(s), 1.0 + (100.0 if s == 4321 else 0.0)) for s in range(1, 20001)]
    kept = decimate(points)
    assert len(kept) <= MAX_POINTS + 2 and (4321.0, 101.0) in kept and kept[-1] == points[-1]
    chart = line_chart("loss", "loss", [Series("long", "#000", points)], source="steps")
    assert f'data-logged="20000" data-drawn="{len(kept)}"' in chart
    assert chart.count('<circle class="point"') == len(kept) and "of 20000 points drawn" in chart


def test_a_run_whose_loss_reached_the_largest_floats_still_gets_its_page(tmp_path):
    """A loss of +-1e308 (a diverged run: the range between them overflows a float) is charted, not an
    OverflowError."""
    run = tmp_path / "diverged"
    run.mkdir()
    rows = [{"step": k, "loss": v} for k, v in enumerate([1e308, -1e308, 2.0], 1)]
    (run / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "recipe.resolved.yaml").write_text("train:\n  objective: sft\n")
    assert main(["report", str(run), "--output", str(tmp_path / "page.html")]) == 0
    assert "<svg" in (tmp_path / "page.html").read_text()


def test_lm_eval_benchmarks_are_in_the_eval_table(tmp_path):
    run = write_run(tmp_path / "bench", sft_records(2))
    metrics = {"base": (0.25, 0.0791), "tuned": (0.5, 0.0913)}
    (run / "eval.json").write_text(json.dumps({
        "models": {"base": "b", "tuned": str(run)},
        "results": {
            name: {"generation": {}, "lm_eval": {"lm_eval_version": "0.4.13", "tasks": {"gsm8k": {
                "n": 30, "n_shot": 0, "metrics": {"exact_match,strict-match": {"value": v, "stderr": se}}}}}}
            for name, (v, se) in metrics.items()
        },
    }))  # fmt: skip
    page = render(tmp_path, run)
    assert "lm-eval gsm8k exact_match,strict-match (n=30)" in page
    assert "0.2500 ± 0.0791" in page and "0.5000 ± 0.0913" in page
