#!/usr/bin/env python
"""Benchmark dataset preparation on GSM8K with the Llama 2 tokenizer, side by side with TRL (and Axolotl).

    python benchmarks/bench_prepare.py [--data ../shared/data] [--repeats 5] [--write-results]
        [--axolotl-path DIR ...]

What is measured (rows of 2048 tokens unless said otherwise):

1. Packing, on the same example lengths (GSM8K tokenized by finetune: question masked, answer
   trained): our multipack (BFD + gap filling, and FFD), sequential packing, and
   `trl.pack_dataset(..., strategy="bfd")`; efficiency = real tokens / (rows * capacity) for all.
   Times are the median of --repeats runs, warm. "assign" is the bin assignment only; "rows"
   includes building the packed dataset (TRL's pack_dataset always builds it).
2. Full preparation, cold: load the jsonl, tokenize with completion-only labels, pack, and (ours)
   save the cache. Each run is a fresh process with its own empty `datasets` cache, timed after the
   imports. TRL runs its own SFT preparation code, `SFTTrainer._prepare_dataset` (prompt/completion
   tokenization, completion mask -> labels, BFD packing) on an SFTConfig with packing=True and
   completion_only_loss=True, on a trainer object built without a model (the method only reads
   the tokenizer and the chat template from it).
3. Cache hit vs cold prepare: `prepare()` on the same recipe again (fingerprint + memory-mapped load).
4. Axolotl's MultipackBatchSampler, when --axolotl-path points at a folder holding the axolotl
   package and numba (it is not installed in the project venv: axolotl pins older transformers,
   datasets, huggingface_hub, trl and pydantic, so installing it would break the venv). To make one:
   `pip download axolotl --no-deps` (unzip the wheel) and
   `pip install --no-deps --target DIR numba llvmlite`.

`--write-results` replaces the "prepare-dataset" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "RESULTS.md"
SECTION_START, SECTION_END = "<!-- prepare-dataset:start -->", "<!-- prepare-dataset:end -->"
CAPACITY = 2048


def recipe_dict(data_dir: Path, prepared: Path, **data) -> dict:
    return {
        "model": {
            "config_path": {"model_type": "llama"},
            "tokenizer_path": str(data_dir / "tokenizers" / "llama2-hf"),
        },
        "data": {
            "datasets": [
                {
                    "path": str(data_dir / "gsm8k" / "train.jsonl"),
                    "type": "input_output",
                    "field_prompt": "question",
                    "field_completion": "answer",
                }
            ],
            "sequence_len": CAPACITY,
            "dataset_num_proc": 1,
            "dataset_prepared_path": str(prepared),
            **data,
        },
        "train": {"output_dir": str(prepared.parent / "out")},
    }


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds over `repeats` calls (after one warm-up call), and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


# ------------------------------------------------------------------------------------------ packing


def tokenized_gsm8k(data_dir: Path):
    """GSM8K tokenized by finetune (input_ids, labels), as the packers' common input."""
    from finetune.data.formats.tokenize import tokenize_dataset
    from finetune.data.sources.readers import load_source
    from finetune.model.build import load_tokenizer
    from finetune.recipe import validate_recipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = validate_recipe(recipe_dict(data_dir, Path(tmp) / "prepared"))
    entry = recipe.data.datasets[0]
    tokenizer = load_tokenizer(recipe.model)
    result = tokenize_dataset(
        load_source(entry, num_proc=1),
        entry,
        tokenizer,
        sequence_len=CAPACITY,
        excess_length_strategy="drop",
        on_bad_row="raise",
    )
    return result.dataset.select_columns(["input_ids", "labels"])


def bench_packing(ds, repeats: int, axolotl_paths: list[str]) -> list[dict]:
    import datasets
    import numpy as np
    from trl import pack_dataset

    from finetune.data.batching.packing import build_packed_rows, pack_multipack, pack_sequential

    # In memory: `map` then neither writes nor reuses cache files, so repeated runs are real work.
    ds = datasets.Dataset(ds.with_format("arrow")[:])
    lengths = np.array([len(x) for x in ds["input_ids"]], dtype=np.int64)
    total = int(lengths.sum())
    rows_out = []

    def add(name, capacity, rows, assign_s, rows_s, note=""):
        rows_out.append(
            {
                "packer": name,
                "capacity": capacity,
                "rows": rows,
                "efficiency": round(total / (rows * capacity), 5),
                "assign_ms": None if assign_s is None else round(assign_s * 1000, 1),
                "rows_ms": None if rows_s is None else round(rows_s * 1000, 1),
                "note": note,
            }
        )

    for capacity in (CAPACITY, 2 * CAPACITY):
        for strategy in ("bfd", "ffd"):
            assign_s, bins = timed(
                lambda c=capacity, s=strategy: pack_multipack(lengths, c, strategy=s), repeats
            )
            rows_s, _ = timed(
                lambda c=capacity, s=strategy: build_packed_rows(
                    ds, pack_multipack(lengths, c, strategy=s), pad_to_multiple_of=1, pad_token_id=0
                ),
                repeats,
            )
            add(f"finetune multipack ({strategy})", capacity, len(bins), assign_s, rows_s)
        assign_s, bins = timed(lambda c=capacity: pack_sequential(lengths, c), repeats)
        add("finetune sequential", capacity, len(bins), assign_s, None, "order-preserving")
        for label, kwargs in (("", None), (", one group", {"batch_size": len(ds)})):
            rows_s, packed = timed(
                lambda c=capacity, k=kwargs: pack_dataset(ds, c, strategy="bfd", map_kwargs=k), repeats
            )
            real = sum(sum(s) for s in packed["seq_lengths"])
            assert real == total, (real, total)
            note = "default map batches of 1000" if not kwargs else "map batch = whole dataset"
            add(f"TRL pack_dataset(bfd{label})", capacity, len(packed), None, rows_s, note)
        if axolotl_paths:
            rows_out.append(_axolotl(lengths, capacity, repeats, axolotl_paths, total))
    return rows_out


def _axolotl(lengths, capacity: int, repeats: int, paths: list[str], total: int) -> dict:
    """Axolotl's MultipackBatchSampler (first-fit, numba), imported from an out-of-venv folder."""
    sys.path[:0] = [p for p in paths if p not in sys.path]
    row = {"packer": "Axolotl MultipackBatchSampler", "capacity": capacity, "rows_ms": None}
    try:
        from axolotl.utils.samplers.multipack import MultipackBatchSampler
        from torch.utils.data import SequentialSampler
    except Exception as exc:  # missing package or an incompatible dependency
        return row | {"rows": None, "efficiency": None, "assign_ms": None, "note": f"not run: {exc}"}

    def run():
        sampler = MultipackBatchSampler(
            SequentialSampler(range(len(lengths))),
            batch_size=1,
            batch_max_len=capacity,
            lengths=lengths,
            bin_size=200,  # axolotl's default sample_packing_bin_size
            drop_last=False,
            group_size=100_000,
            num_processes=1,
        )
        return [b for batch in sampler.generate_batches(set_stats=True) for b in batch]

    start = time.perf_counter()
    bins = run()  # includes the numba JIT compilation
    first = time.perf_counter() - start
    assign_s, bins = timed(run, repeats)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    return row | {
        "rows": len(bins),
        "efficiency": round(total / (len(bins) * capacity), 5),
        "assign_ms": round(assign_s * 1000, 1),
        "note": f"first call with numba JIT: {first:.2f} s",
    }


# ---------------------------------------------------------------------------------- full preparation


def worker_ours(data_dir: Path, repeats: int) -> dict:
    """One cold prepare() in this fresh process, then cache hits."""
    import torch  # noqa: F401  (imported before timing, as TRL's side imports it too)
    import transformers  # noqa: F401

    import finetune.model.build  # noqa: F401
    from finetune.data.prepare.build import prepare
    from finetune.recipe import validate_recipe

    with tempfile.TemporaryDirectory() as tmp:
        recipe = validate_recipe(recipe_dict(data_dir, Path(tmp) / "prepared"))
        start = time.perf_counter()
        prepared = prepare(recipe, log=lambda _: None)
        cold = time.perf_counter() - start
        assert prepared.source == "built"
        hits = []
        for _ in range(repeats):
            start = time.perf_counter()
            again = prepare(recipe, log=lambda _: None)
            hits.append(time.perf_counter() - start)
            assert again.source == "cache"
        m = prepared.manifest
        return {
            "seconds": cold,
            "rows_in": m["rows_in"],
            "num_tokens": m["num_tokens"],
            "rows_out": m["rows_out"]["train"],
            "efficiency": m["packing_efficiency"],
            "hit_seconds": statistics.median(hits),
            "timings": m["timings"],
        }


def worker_trl(data_dir: Path) -> dict:
    """TRL's SFT dataset preparation (tokenize, completion-only labels, BFD packing), cold."""
    import datasets
    import torch  # noqa: F401
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(
            output_dir=tmp,
            max_length=CAPACITY,
            packing=True,
            packing_strategy="bfd",
            completion_only_loss=True,
            dataset_num_proc=None,
            report_to=[],
            use_cpu=True,
            bf16=False,
        )
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(data_dir / "tokenizers" / "llama2-hf"))
        raw = datasets.load_dataset("json", data_files=str(data_dir / "gsm8k" / "train.jsonl"), split="train")
        raw = raw.rename_columns({"question": "prompt", "answer": "completion"})
        # The preparation method only reads these attributes of the trainer.
        trainer = SFTTrainer.__new__(SFTTrainer)
        trainer._tokenizer, trainer.chat_template, trainer.completion_only_loss = tokenizer, None, True
        packed = SFTTrainer._prepare_dataset(trainer, raw, tokenizer, args, True, None, "train")
        seconds = time.perf_counter() - start
        num_tokens = sum(sum(s) for s in packed["seq_lengths"])
        return {
            "seconds": seconds,
            "rows_in": len(raw),
            "num_tokens": num_tokens,
            "rows_out": len(packed),
            "efficiency": num_tokens / (len(packed) * CAPACITY),
        }


def run_worker(kind: str, data_dir: Path, repeats: int) -> dict:
    """Run a worker in a fresh process with an empty `datasets` cache; return its JSON result."""
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "HF_DATASETS_CACHE": cache,
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(REPO_ROOT),
        }
        cmd = [sys.executable, __file__, "--worker", kind, "--data", str(data_dir), "--repeats", str(repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"worker {kind} failed:\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def bench_prepare(data_dir: Path, runs: int, repeats: int) -> dict:
    ours = [run_worker("ours", data_dir, repeats) for _ in range(runs)]
    trl = [run_worker("trl", data_dir, repeats) for _ in range(runs)]

    def median(results, key):
        return statistics.median(r[key] for r in results)

    return {
        "ours": ours[0] | {"seconds": median(ours, "seconds"), "hit_seconds": median(ours, "hit_seconds")},
        "trl": trl[0] | {"seconds": median(trl, "seconds")},
        "runs": runs,
    }


# ----------------------------------------------------------------------------------------- report


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        gpu = "unknown"
    from importlib import metadata

    versions = {
        n: metadata.version(n) for n in ("datasets", "transformers", "tokenizers", "trl", "numpy", "pyarrow")
    }
    with contextlib.suppress(metadata.PackageNotFoundError):  # on sys.path only with --axolotl-path
        versions["axolotl"] = metadata.version("axolotl")
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "gpu": gpu,
        "load": os.getloadavg()[0],
        "python": platform.python_version(),
        **versions,
    }


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def report(packing: list[dict], prep: dict, mach: dict, command: str) -> str:
    lines = [
        "### Packing: GSM8K train (7473 rows, question masked, Llama 2 tokenizer), same lengths for every packer",
        "",
        "| packer | row tokens | rows | efficiency | assign ms | assign + build rows ms | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in packing:
        lines.append(
            f"| {r['packer']} | {r['capacity']} | {_fmt(r['rows'])} | {_fmt(r['efficiency'], '.4f')} | "
            f"{_fmt(r['assign_ms'])} | {_fmt(r['rows_ms'])} | {r['note']} |"
        )
    ours, trl = prep["ours"], prep["trl"]
    ours_rows_s, trl_rows_s = ours["rows_in"] / ours["seconds"], trl["rows_in"] / trl["seconds"]
    lines += [
        "",
        f"### Full preparation, cold (load jsonl, tokenize, mask, pack{', save'}), median of {prep['runs']} fresh processes",
        "",
        "| pipeline | seconds | rows/s | tokens/s | packed rows | efficiency |",
        "|---|---|---|---|---|---|",
        f"| finetune prepare() | {ours['seconds']:.2f} | {ours_rows_s:,.0f} | {ours['num_tokens'] / ours['seconds']:,.0f} "
        f"| {ours['rows_out']} | {ours['efficiency']:.4f} |",
        f"| TRL SFTTrainer._prepare_dataset (packing bfd, completion_only_loss) | {trl['seconds']:.2f} | "
        f"{trl_rows_s:,.0f} | {trl['num_tokens'] / trl['seconds']:,.0f} | {trl['rows_out']} | {trl['efficiency']:.4f} |",
        "",
        f"Throughput ratio finetune / TRL: **{ours_rows_s / trl_rows_s:.2f}x** (rows/s). "
        f"Our stage times (s): {json.dumps(ours['timings'])}.",
        "",
        f"Cache hit (same recipe, `prepare()` again): {ours['hit_seconds'] * 1000:.1f} ms vs {ours['seconds']:.2f} s "
        f"cold: **{ours['seconds'] / ours['hit_seconds']:.0f}x** faster.",
    ]
    if any(r["packer"].startswith("Axolotl") for r in packing):
        lines += [
            "",
            "Axolotl's sampler (first-fit in dataset order, numba, at most 200 examples per row) was imported "
            "from a folder outside the venv (its wheel without dependencies, plus numba and llvmlite): "
            "installing axolotl itself pins older transformers, datasets, huggingface_hub, trl and pydantic.",
        ]
    best = {r["capacity"]: r for r in packing if r["packer"] == "finetune multipack (bfd)"}
    trl_default = {r["capacity"]: r for r in packing if r["packer"] == "TRL pack_dataset(bfd)"}
    b, t = best[CAPACITY], trl_default[CAPACITY]
    lines += [
        "",
        "Targets: multipack efficiency >= 0.999: "
        f"{'met' if b['efficiency'] >= 0.999 else 'MISSED'} ({b['efficiency']:.4f}); pack time <= TRL: "
        f"{'met' if b['rows_ms'] <= t['rows_ms'] else 'MISSED'} ({b['assign_ms']} ms assign, {b['rows_ms']} ms with rows, "
        f"vs {t['rows_ms']} ms); prepare throughput >= 1.5x TRL: "
        f"{'met' if ours_rows_s >= 1.5 * trl_rows_s else 'MISSED'} ({ours_rows_s / trl_rows_s:.2f}x); "
        f"cache hit >= 50x: {'met' if ours['seconds'] / ours['hit_seconds'] >= 50 else 'MISSED'}.",
        "",
        f"Machine: {mach['nproc']} CPU cores ({mach['cpu']}), GPU: {mach['gpu']}, 1-minute load average "
        f"{mach['load']:.1f} at the end of the run (the machine is shared: absolute times are noisy, the "
        f"comparisons ran in the same run); Python {mach['python']}, "
        + ", ".join(f"{k} {v}" for k, v in mach.items() if k not in ("nproc", "cpu", "gpu", "python", "load"))
        + ".",
        "",
        f"Command: `{command}`",
    ]
    return "\n".join(lines)


def write_results(text: str) -> None:
    section = f"{SECTION_START}\n## prepare-dataset\n\n{text}\n{SECTION_END}"
    if RESULTS.exists():
        current = RESULTS.read_text(encoding="utf-8")
    else:
        current = "# Benchmark results\n\nOne section per benchmark; each states its command and machine.\n"
    if SECTION_START in current and SECTION_END in current:
        head, rest = current.split(SECTION_START, 1)
        tail = rest.split(SECTION_END, 1)[1]
        current = head + section + tail
    else:
        current = current.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(current, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO_ROOT.parent / "shared" / "data")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median) for warm measurements")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per cold preparation")
    parser.add_argument(
        "--axolotl-path", action="append", default=[], help="folder(s) holding axolotl and numba"
    )
    parser.add_argument("--write-results", action="store_true", help="update benchmarks/RESULTS.md")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    data_dir = args.data.resolve()
    if args.worker == "ours":
        print(json.dumps(worker_ours(data_dir, args.repeats)))
        return 0
    if args.worker == "trl":
        print(json.dumps(worker_trl(data_dir)))
        return 0
    if not (data_dir / "gsm8k" / "train.jsonl").is_file():
        print(f"GSM8K not found under {data_dir}; pass --data", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    command = "python " + " ".join(
        [os.path.relpath(__file__, REPO_ROOT), *(argv if argv is not None else sys.argv[1:])]
    )
    packing = bench_packing(tokenized_gsm8k(data_dir), args.repeats, args.axolotl_path)
    prep = bench_prepare(data_dir, args.runs, args.repeats)
    text = report(packing, prep, machine(), command)
    print(text)
    if args.write_results:
        write_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
