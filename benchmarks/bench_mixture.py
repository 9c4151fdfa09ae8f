"""Weighted mixtures: the shares of rows and trained tokens each dataset gets, against the weights asked.

Prepares two mixtures with `finetune.data.prepare.build.prepare` at several weights and prints, per dataset,
the training rows, the rows drawn, its share of the rows and of the trained tokens (read from the
manifest, which counts them in the packed rows), next to what the weights ask: a share of rows of
w_i * n_i / sum(w_j * n_j), and of trained tokens w_i * T_i / sum(w_j * T_j) (n: training rows,
T: trained tokens at weight 1; exact for whole weights, an expectation for fractions, whose rows are
drawn at random).

- demo: recipes/demo/data arithmetic.jsonl (alpaca) + chat.jsonl (chat_template), demo tokenizer,
  val_set_size 0.05 (recipes/demo/tiny_mix_cpu.yaml with other weights).
- real (when ../shared/data is present): GSM8K train (input_output) + the 175 Alpaca seed tasks (their
  first instance as an alpaca row, written to a temporary file), Llama 2 tokenizer, sequence_len 1024.

Usage: python benchmarks/bench_mixture.py [--cases demo,real]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
DEMO_WEIGHTS = [(1.0, 1.0), (0.5, 3.0), (0.5, 2.0), (0.25, 1.0), (2.0, 0.5)]
REAL_WEIGHTS = [(1.0, 1.0), (0.1, 4.0), (0.05, 10.0)]


def _recipe(entries: list[dict], tokenizer: Path, root: Path, **data):
    from finetune.recipe import validate_recipe

    return validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1},
                "tokenizer_path": str(tokenizer),
            },
            "data": {
                "datasets": entries,
                "dataset_num_proc": 1,
                "dataset_prepared_path": str(root / "prepared"),
                **data,
            },
            "train": {"output_dir": str(root / "out")},
        }
    )


def _cases(root: Path, names: list[str]) -> dict:
    demo = REPO / "recipes" / "demo"
    cases = {}
    if "demo" in names:
        cases["demo"] = (
            [
                {"path": str(demo / "data" / "arithmetic.jsonl"), "type": "alpaca"},
                {"path": str(demo / "data" / "chat.jsonl"), "type": "chat_template"},
            ],
            demo / "tokenizer",
            {"val_set_size": 0.05, "sequence_len": 256, "sample_packing_sequence_len": 512},
            DEMO_WEIGHTS,
        )
    gsm8k, seeds = SHARED / "gsm8k" / "train.jsonl", SHARED / "alpaca" / "seed_tasks.jsonl"
    if "real" in names and gsm8k.is_file() and seeds.is_file():
        alpaca = root / "alpaca_seed_tasks.jsonl"  # a temporary copy in the alpaca shape
        with alpaca.open("w") as out:
            for line in seeds.read_text().splitlines():
                task = json.loads(line)
                first = task["instances"][0]
                row = {"instruction": task["instruction"], "input": first["input"], "output": first["output"]}
                out.write(json.dumps(row) + "\n")
        cases["real"] = (
            [
                {
                    "path": str(gsm8k),
                    "type": "input_output",
                    "field_prompt": "question",
                    "field_completion": "answer",
                },
                {"path": str(alpaca), "type": "alpaca"},
            ],
            SHARED / "tokenizers" / "llama2-hf",
            {"sequence_len": 1024},
            REAL_WEIGHTS,
        )
    elif "real" in names:
        print(f"real: skipped ({gsm8k} or {seeds} is missing)")
    return cases


def _run(entries, tokenizer, data, weights, root: Path) -> list[dict]:
    from finetune.data.prepare.build import prepare

    out = []
    for ws in weights:
        weighted = [{**e, "weight": w} for e, w in zip(entries, ws, strict=True)]
        manifest = prepare(_recipe(weighted, tokenizer, root, **data), log=lambda _: None).manifest
        out.append(
            {"weights": ws, "mixture": manifest["mixture"], "packed_rows": manifest["rows_out"]["train"]}
        )
    return out


def _table(name: str, runs: list[dict]) -> str:
    base = next(r for r in runs if all(w == 1 for w in r["weights"]))["mixture"]
    lines = [
        f"#### {name}",
        "",
        "| weights | dataset | training rows | rows drawn | share of rows (asked) | share of trained tokens (asked) |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        mix = run["mixture"]
        asked_rows = [d["weight"] * d["rows_train"] for d in mix]
        asked_tokens = [d["weight"] * b["num_trained_tokens"] for d, b in zip(mix, base, strict=True)]
        for i, d in enumerate(mix):
            lines.append(
                f"| {' / '.join(f'{w:g}' for w in run['weights'])} | {Path(d['path']).name} | {d['rows_train']} | "
                f"{d['rows_drawn']} | {d['share_of_rows']:.2%} ({asked_rows[i] / sum(asked_rows):.2%}) | "
                f"{d['share_of_trained_tokens']:.2%} ({asked_tokens[i] / sum(asked_tokens):.2%}) |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="demo,real")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, (entries, tokenizer, data, weights) in _cases(Path(tmp), args.cases.split(",")).items():
            print(_table(name, _run(entries, tokenizer, data, weights, Path(tmp) / name)) + "\n")
    print(f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})")


if __name__ == "__main__":
    main()
