"""The manifest of a preparation (`manifest.json`, written last: finetune.data.prepare.cache) and the
summary printed from it: what a cache hit prints without importing datasets or transformers.

The manifest accounts for every input row (kept, truncated, or dropped with its reason and samples),
per source entry and in total, and holds the fingerprint's inputs, the splits' statistics, the
weighted mixture, timings and library versions.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from finetune.data.prepare.cache import canonical_json, library_versions
from finetune.data.prepare.fingerprint import FORMAT_VERSION

# What one example of each kind is, for the summary.
UNIT_NAMES = {"sft": "examples", "preference": "pairs", "kto": "examples", "prompt": "prompts"}


def make_manifest(
    fingerprint: str,
    inputs: dict,
    sources: list[dict],
    bad_row_samples: list[dict],
    splits: dict,
    timings: dict,
) -> dict:
    """The manifest of a preparation: its fingerprint and inputs, every row accounted for (per source
    entry in `sources`, with samples of the dropped ones), the splits' statistics, timings, versions."""
    dropped: dict[str, int] = {}
    for s in sources:
        for reason, count in s["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + count
    train = splits["train"]
    return {
        "fingerprint": fingerprint,
        "fingerprint_sha256": hashlib.sha256(canonical_json(inputs).encode()).hexdigest(),
        "format_version": FORMAT_VERSION,
        "fingerprint_inputs": inputs,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows_in": sum(s["rows_in"] for s in sources),
        "rows_kept": sum(s["rows_kept"] for s in sources),
        "rows_dropped": sum(dropped.values()),
        "dropped": dict(sorted(dropped.items())),
        "truncated": sum(s["truncated"] for s in sources),
        "rows_out": {name: s["rows"] for name, s in splits.items()},
        "num_tokens": train["num_tokens"],
        "num_trainable_tokens": train["num_trainable_tokens"],
        "packing_efficiency": train["packing_efficiency"],
        "splits": splits,
        "sources": sources,
        "bad_row_samples": bad_row_samples,
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "versions": library_versions(),
    }


def reusing(path: Path) -> str:
    """The line said when a preparation is reused from the cache."""
    return f"reusing prepared dataset {path.name} at {path} (nothing to tokenize)"


def summary(manifest: dict, source: str, path: Path) -> str:
    """A few lines for the end of `finetune prepare-dataset`: rows, drops, tokens, packing, location;
    `source` says how it was got (built, cache, hub)."""
    m = manifest
    drops = ", ".join(f"{k}={v}" for k, v in m.get("dropped", {}).items()) or "none"
    lines = [
        f"prepared dataset {m['fingerprint']} ({source}) at {path}",
        f"  rows: {m['rows_in']} in, {m['rows_kept']} kept, {m['rows_dropped']} dropped ({drops}), "
        f"{m['truncated']} truncated",
    ]
    unit = UNIT_NAMES[m.get("kind", "sft")]
    for name in ("train", "eval"):
        if name not in m["splits"]:
            continue
        s = m["splits"][name]
        lines.append(
            f"  {name}: {s['examples']} {unit} -> {s['rows']} rows of {s['row_capacity']} "
            f"({'packed, ' + s['packing_method'] if s['packed'] else 'unpacked'}); {s['num_tokens']:,} tokens, "
            f"{s['num_trainable_tokens']:,} trainable; packing efficiency {s['packing_efficiency']:.4f}"
        )
    return "\n".join(lines + mixture_lines(m.get("mixture", [])))


def mixture_lines(mixture: list[dict]) -> list[str]:
    """One summary line per training dataset when there are several or any is weighted: its weight,
    rows for training and drawn, and its shares of the training rows and trained tokens.

    >>> row = {"dataset": "data.datasets[0]", "path": "a.jsonl", "weight": 0.5, "rows_train": 9,
    ...        "rows_drawn": 5, "share_of_rows": 0.25, "share_of_trained_tokens": 0.3}
    >>> mixture_lines([row])
    ['  data.datasets[0] (a.jsonl): weight 0.5, 9 training rows -> 5 drawn; 25.0% of the rows, 30.0% of the trained tokens']
    """
    if len(mixture) < 2 and all(d["weight"] == 1 for d in mixture):
        return []

    def percent(share: float | None) -> str:
        return "n/a" if share is None else f"{share:.1%}"

    return [
        f"  {d['dataset']} ({Path(d['path']).name}): weight {d['weight']:g}, {d['rows_train']} training rows -> "
        f"{d['rows_drawn']} drawn; {percent(d['share_of_rows'])} of the rows, "
        f"{percent(d['share_of_trained_tokens'])} of the trained tokens"
        for d in mixture
    ]
