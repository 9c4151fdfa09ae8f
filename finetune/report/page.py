"""The report page: one HTML file, no script, no external style, font or image (inline SVG charts).

Sections: the runs (status, damaged log lines), training curves (loss, learning rate, gradient norm,
throughput), the objective's own metrics (preference rewards and log-probs, RL rewards, KL, clip
ratios: whatever numbers the objective logs), training-time evaluations (eval loss, generation-set
scores), the base-vs-tuned table of `finetune eval` with its samples, the prepared data's manifest,
and the planner's memory prediction beside the measured peak. All text is escaped.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from finetune.report.charts import COLORS, Series, fmt, line_chart
from finetune.report.runs import RunData, is_number

# Training curves every objective logs, in this order; the throughput is the first one a run has.
TRAINING_KEYS = ("loss", "lr", "grad_norm")
THROUGHPUT_KEYS = ("tokens_per_sec", "images_per_sec")
# What the engine logs about the machine and bookkeeping (finetune/engine/outputs.py, the objectives'
# log_fields): charted under "System" where it varies, the counters shown in the runs table instead.
SYSTEM_KEYS = (
    "peak_mem_gib", "host_rss_gib", "tflops_per_device", "mfu", "tokens_per_sec_total",
    "trainable_tokens_per_sec", "images_per_sec_total", "rollout_seconds", "train_seconds", "loss_scale",
)  # fmt: skip
NOT_CHARTED = (
    "step", "epoch", "trainable_tokens", "num_images", "nonfinite_steps", "fp16_skipped_steps",
    "pairs", "examples", "pairs_per_sec", "examples_per_sec",
)  # fmt: skip
# Evaluation counts (how many tokens, pairs, prompts were scored): in the tables, not charts.
EVAL_COUNTS = ("eval_tokens", "eval_pairs", "eval_examples", "eval_prompts")

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1800px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 6px}.muted{color:#666}.missing{color:#8a4b00;background:#fff6e5;padding:6px 10px}
table{border-collapse:collapse;margin:6px 0 12px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:12px}figure.chart{margin:0;border:1px solid #e5e5e5;padding:6px;max-width:520px}
figcaption{font-weight:600;margin-bottom:2px}.legend{list-style:none;padding:0;margin:2px 0 0;font-size:12px}
.legend li{display:inline-block;margin-right:12px}.swatch{display:inline-block;width:10px;height:10px;
margin-right:4px;border-radius:2px}pre{white-space:pre-wrap;margin:0;font:12px/1.35 ui-monospace,monospace}
.ok{color:#1a7f37}.bad{color:#b42318}details{margin:4px 0}
"""


def render(runs: list[RunData], *, live: str = "", body: str | None = None) -> str:
    """The whole page for `runs` (at least one). `finetune report --serve` (finetune.report.serve)
    passes `live`, its status line and script, and its `body`: the body is then wrapped so that the
    script can replace it."""
    body = body_html(runs) if body is None else body
    if live:
        body = f'{live}<div id="live-body">{body}</div>'
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>finetune report: {escape(', '.join(r.label for r in runs))}</title>"
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def body_html(runs: list[RunData]) -> str:
    """The page's content, every section (what the live page replaces on each update)."""
    colors = {run.label: COLORS[i % len(COLORS)] for i, run in enumerate(runs)}
    body = [
        "<h1>finetune report</h1>",
        f'<p class="muted">{len(runs)} run(s), generated {escape(time.strftime("%Y-%m-%d %H:%M:%S %Z"))}</p>',
        runs_section(runs, colors),
        charts_section("training", "Training", runs, colors, training_keys(runs), "steps"),
        charts_section("objective", "Objective metrics", runs, colors, objective_keys(runs), "steps"),
        charts_section("evaluation", "Evaluation during training", runs, colors, eval_keys(runs), "evals"),
        charts_section("system", "System", runs, colors, system_keys(runs), "steps"),
        eval_section(runs),
        data_section(runs),
        memory_section(runs),
    ]
    return "".join(body)


# ------------------------------------------------------------------------------------------ keys


def _numeric_keys(records: list[dict]) -> list[str]:
    """Keys with a number in at least one record, in first-seen order."""
    seen: dict[str, None] = {}
    for record in records:
        for key, value in record.items():
            if is_number(value) or value in ("nan", "inf", "-inf"):
                seen.setdefault(key, None)
    return [k for k in seen if any(is_number(r.get(k)) for r in records)]


def training_keys(runs: list[RunData]) -> list[str]:
    present = {k for run in runs for k in _numeric_keys(run.steps)}
    keys = [k for k in TRAINING_KEYS if k in present]
    return keys + [k for k in THROUGHPUT_KEYS if k in present][:1]


def objective_keys(runs: list[RunData]) -> list[str]:
    """The numbers an objective logs beyond the common ones (rewards, log-probs, KL, clip ratios)."""
    common = {*TRAINING_KEYS, *THROUGHPUT_KEYS, *SYSTEM_KEYS, *NOT_CHARTED}
    keys: dict[str, None] = {}
    for run in runs:
        keys.update((k, None) for k in _numeric_keys(run.steps) if k not in common)
    return list(keys)


def eval_keys(runs: list[RunData]) -> list[str]:
    keys: dict[str, None] = {}
    for run in runs:
        keys.update((k, None) for k in _numeric_keys(run.evals) if k not in ("step", *EVAL_COUNTS))
    return list(keys)


def system_keys(runs: list[RunData]) -> list[str]:
    present = {k for run in runs for k in _numeric_keys(run.steps)}
    return [k for k in SYSTEM_KEYS if k in present]


def series_of(run: RunData, key: str, source: str, color: str) -> Series | None:
    """The run's drawable points of `key` (None when it never logged it)."""
    records = run.steps if source == "steps" else run.evals
    logged = [r for r in records if key in r and r[key] is not None]
    if not logged:
        return None
    points = [(float(r["step"]), float(r[key])) for r in logged if is_number(r[key])]
    return Series(run.label, color, points, skipped=len(logged) - len(points))


# -------------------------------------------------------------------------------------- sections


def charts_section(anchor: str, title: str, runs, colors, keys: list[str], source: str) -> str:
    if not keys:
        return ""
    charts = []
    for key in keys:
        series = [s for run in runs if (s := series_of(run, key, source, colors[run.label])) is not None]
        charts.append(line_chart(key, key, series, source=source))
    return f'<section id="{anchor}"><h2>{escape(title)}</h2><div class="charts">{"".join(charts)}</div></section>'


def table(header: list[str], rows: list[list[Any]], *, cls: str = "") -> str:
    """An HTML table of escaped cells (numbers right-aligned)."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join(f"<tr>{cells(row)}</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def cells(row: list[Any]) -> str:
    """<td> cells of escaped values; numbers short and right-aligned, None empty."""
    out = []
    for cell in row:
        text = fmt(cell) if isinstance(cell, float) else "" if cell is None else str(cell)
        num = ' class="num"' if isinstance(cell, (int, float)) and not isinstance(cell, bool) else ""
        out.append(f"<td{num}>{escape(text)}</td>")
    return "".join(out)


def _status(run: RunData) -> str:
    last = run.steps[-1]["step"] if run.steps else 0
    total = (run.started or {}).get("total_steps")
    if run.finished:
        return f"finished at step {last}"
    of = f" of {total}" if total else ""
    return f"not finished: step {last}{of} logged (still training, or stopped; see `finetune checkpoints`)"


def runs_section(runs: list[RunData], colors: dict[str, str]) -> str:
    rows = []
    for run in runs:
        last = run.steps[-1] if run.steps else {}
        model = (run.recipe.get("model") or {}).get("model_path") or "inline config (random init)"
        swatch = f'<span class="swatch" style="background:{colors[run.label]}"></span>'
        values = [
            run.label, str(run.path), run.objective, model, _status(run), len(run.steps),
            last.get("loss"), last.get("epoch"), last.get("nonfinite_steps"), len(run.damaged),
        ]  # fmt: skip
        row = cells(values).replace("<td>", "<td>" + swatch, 1)
        rows.append(f'<tr data-run="{escape(run.label)}">{row}</tr>')
    header = "".join(
        f"<th>{h}</th>"
        for h in ("run", "output_dir", "objective", "base model", "status", "steps logged", "last loss",
                  "epoch", "nonfinite steps", "damaged log lines")
    )  # fmt: skip
    notes = []
    for run in runs:
        if run.damaged:
            lines = ", ".join(str(n) for n in run.damaged[:20]) + (" ..." if len(run.damaged) > 20 else "")
            notes.append(
                f'<p class="missing damaged" data-run="{escape(run.label)}" data-count="{len(run.damaged)}">'
                f"{escape(run.label)}: {len(run.damaged)} line(s) of {escape(str(run.path / 'progress.jsonl'))} "
                f"are not JSON records and were left out (lines {escape(lines)}): a line cut short by a "
                "crash, or one being written</p>"
            )
        notes += [f'<p class="missing">{escape(run.label)}: {escape(p)}</p>' for p in run.problems]
    return (
        f'<section id="runs"><h2>Runs</h2><table><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}'
        f"</tbody></table>{''.join(notes)}</section>"
    )


def eval_section(runs: list[RunData]) -> str:
    """Each run's eval.json: the base-vs-tuned table and every sample, side by side."""
    from finetune.evaluation.compare import comparison_rows

    parts = ['<section id="eval"><h2>Base vs tuned (<code>finetune eval</code>)</h2>']
    for run in runs:
        parts.append(f"<h3>{escape(run.label)}</h3>")
        if run.eval_report is None:
            parts.append(f'<p class="missing" data-missing="eval">{escape(run.eval_missing or "")}</p>')
            parts.append(_training_samples(run))
            continue
        try:  # eval.json is a file on disk: one not in the form finetune eval writes is said, not raised
            parts.append(_eval_tables(run.eval_report, comparison_rows))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            parts.append(
                f'<p class="missing" data-missing="eval">{escape(str(run.path / "eval.json"))} is not in the form '
                f"`finetune eval` writes ({escape(type(exc).__name__)}: {escape(str(exc))}): run finetune eval "
                "again</p>"
            )
        parts.append(_training_samples(run))
    parts.append("</section>")
    return "".join(parts)


def _eval_tables(report: dict, comparison_rows) -> str:
    """eval.json's table (models as columns) and its samples."""
    results = report["results"]
    names = list(results)
    models = report.get("models") or {}
    caption = ", ".join(f"{n}: {models.get(n) or 'the recipe base'}" for n in names)
    parts = [f'<p class="muted">{escape(caption)}</p>']
    rows = [[label, *values] for label, values in comparison_rows(results)]
    parts.append(table(["metric", *names], rows, cls="eval"))
    parts.append(_eval_samples(results))
    return "".join(parts)


def _answer(value: Any) -> str:
    if isinstance(value, list):  # chat messages
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in value if isinstance(m, dict))
    return "" if value is None else str(value)


def _eval_samples(results: dict) -> str:
    names = list(results)
    first = results[names[0]].get("generation") or {}
    out = []
    for set_name, summary in first.items():
        rows = []
        for k, sample in enumerate(summary.get("samples") or []):
            row = [k + 1, _answer(sample.get("prompt")), _answer(sample.get("expected"))]
            for n in names:
                other = ((results[n].get("generation") or {}).get(set_name) or {}).get("samples") or []
                got = other[k] if k < len(other) else {}
                mark = {True: "[correct] ", False: "[wrong] "}.get(got.get("correct"), "")
                row.append(mark + _answer(got.get("output")))
            rows.append(row)
        header = ["#", "prompt", "expected", *names]
        out.append(
            f"<details open><summary>{escape(set_name)}: {len(rows)} sample(s)</summary>"
            f"{_pre_table(header, rows, 'samples')}</details>"
        )
    return "".join(out)


def _pre_table(header: list[str], rows: list[list[Any]], cls: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td><pre>{escape(str(c))}</pre></td>" for c in row) + "</tr>" for row in rows
    )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _training_samples(run: RunData) -> str:
    """The last training-time evaluation's generation samples (eval_<set>_samples)."""
    if not run.evals:
        return ""
    last = run.evals[-1]
    out = []
    for key, samples in last.items():
        if key.startswith("eval_") and key.endswith("_samples") and isinstance(samples, list):
            rows = [
                [
                    _answer(s.get("prompt")),
                    _answer(s.get("expected")),
                    _answer(s.get("output")),
                    s.get("correct"),
                ]
                for s in samples
                if isinstance(s, dict)
            ]
            out.append(
                f"<details><summary>{escape(key)} at training step {last['step']}</summary>"
                f"{_pre_table(['prompt', 'expected', 'output', 'correct'], rows, 'train-samples')}</details>"
            )
    return "".join(out)


def data_section(runs: list[RunData]) -> str:
    from finetune.model_card import manifest_rows

    parts = ['<section id="data"><h2>Data (prepared dataset manifest)</h2>']
    for run in runs:
        parts.append(f'<div class="run-data" id="data-{escape(run.label)}"><h3>{escape(run.label)}</h3>')
        m = run.manifest
        if m is None:
            parts.append(
                f'<p class="missing" data-missing="manifest">{escape(run.manifest_missing or "")}</p></div>'
            )
            continue
        rows = [[k, _plain(v)] for k, v in manifest_rows(m)]
        rows.insert(2, ["rows dropped", m.get("rows_dropped")])
        rows.insert(3, ["rows truncated", m.get("truncated")])
        parts.append(table(["figure", "value"], rows, cls="manifest"))
        splits = m.get("splits") if isinstance(m.get("splits"), dict) else {}
        splits = {name: sp for name, sp in splits.items() if isinstance(sp, dict)}
        if splits:
            keys = (
                "examples",
                "rows",
                "row_capacity",
                "num_tokens",
                "num_trainable_tokens",
                "packing_efficiency",
            )
            split_rows = [[name, *(s.get(k) for k in keys)] for name, s in splits.items()]
            parts.append(table(["split", *keys], split_rows, cls="splits"))
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return value


def memory_section(runs: list[RunData]) -> str:
    """The planner's prediction (recorded when training started) beside the measured peaks."""
    parts = ['<section id="memory"><h2>Memory: planner vs measured</h2>']
    for run in runs:
        parts.append(f"<h3>{escape(run.label)}</h3>")
        parts.append(_memory_of(run))
    parts.append("</section>")
    return "".join(parts)


def _memory_of(run: RunData) -> str:
    gib = 2**30
    plan = (run.started or {}).get("memory_plan")
    measured = [r["peak_mem_gib"] for r in run.steps if is_number(r.get("peak_mem_gib"))]
    host = [r["host_rss_gib"] for r in run.steps if is_number(r.get("host_rss_gib"))]
    device = (run.started or {}).get("device")
    out = []
    if plan is None:
        out.append(
            '<p class="missing" data-missing="plan">no planner prediction recorded: the run predates it '
            "(progress.jsonl has no started record with memory_plan); `finetune plan "
            f"{escape(str(run.path / 'recipe.resolved.yaml'))}` prints it</p>"
        )
    elif "unavailable" in plan:
        out.append(
            f'<p class="missing" data-missing="plan">no prediction: {escape(str(plan["unavailable"]))}</p>'
        )
    else:
        rows = [[p["name"], p["gpu_bytes"] / gib] for p in plan.get("parts", [])]
        if "rollout_parts" in plan:  # online RL: the training step, then the rollout; the peak is the larger
            rows.append(["training step", plan["training_step_gpu_bytes"] / gib])
            rows += [["rollout: " + p["name"], p["gpu_bytes"] / gib] for p in plan["rollout_parts"]]
            rows.append(["rollout", plan["rollout_gpu_bytes"] / gib])
        rows.append(["total predicted per device", plan["total_gpu_bytes"] / gib])
        out.append(
            f'<p class="muted">{escape(str(plan.get("engine")))}; micro batch {plan.get("micro_batch_size")} '
            f"x {plan.get('seq_len')} tokens</p>"
        )
        out.append(table(["planner part", "GiB"], rows, cls="plan"))
    compare = []
    if plan and "total_gpu_bytes" in plan:
        allocator = (plan["total_gpu_bytes"] - plan.get("allowance_bytes", 0)) / gib
        compare.append(["predicted, allocator memory (total less the fixed CUDA allowance)", allocator])
    if measured:
        compare.append(["measured peak allocated (max peak_mem_gib)", max(measured)])
        if plan and "total_gpu_bytes" in plan:
            compare.append(["measured / predicted", max(measured) / max(compare[0][1], 1e-12)])
    else:
        where = f"on {device}" if device else "here"
        compare.append(
            ["measured peak allocated", f"not measured: the run trained {where} (peak_mem_gib is CUDA's)"]
        )
    if host:
        compare.append(["host peak RSS of the main process (Python, libraries, data included)", max(host)])
    out.append(table(["", "GiB"], compare, cls="memory"))
    return "".join(out)
