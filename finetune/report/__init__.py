"""`finetune report OUTPUT_DIR [OUTPUT_DIR ...]`: one self-contained HTML page about training runs.

Per run and overlaid across runs: the training curves, the objective's metrics, training-time
evaluations, the base-vs-tuned table of `finetune eval` with its samples, the prepared data's
manifest, and the planner's memory prediction beside the measured peak. The page needs no network:
charts are inline SVG (finetune.report.charts), there is no script.

Modules: `runs` (what an output_dir holds), `charts` (SVG line charts), `page` (the HTML), `serve`
(`finetune report --serve`: the same page on 127.0.0.1, kept current by server-sent events while the
runs log; only that page carries a script).
"""

from __future__ import annotations

from pathlib import Path

from finetune.errors import FinetuneError, WriteError
from finetune.report.page import render
from finetune.report.runs import load_run, run_labels


def build_report(output_dirs: list[str], output: str | None = None) -> Path:
    """Read every output_dir (each must be a run: FinetuneError naming the first that is not) and
    write the page to `output` (default: report.html in the current folder); returns its path."""
    paths = [Path(p) for p in output_dirs]
    runs = [load_run(path, label) for path, label in zip(paths, run_labels(paths), strict=True)]
    target = Path(output or "report.html")
    if target.is_dir():
        raise FinetuneError(f"--output {target} is a folder: give a file name, e.g. {target / 'report.html'}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(runs), encoding="utf-8")
    except OSError as exc:
        raise WriteError(
            f"cannot write the report to {target}: {exc.strerror or exc}; choose another --output"
        ) from None
    return target
