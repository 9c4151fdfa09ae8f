"""data.streaming: memory over a large corpus, tokens/s against the prepared path, packing efficiency.

    python benchmarks/bench_streaming.py --gb 2 --read-seconds 300 --steps 150 --repeats 2

1. Writes a jsonl corpus of `--gb` GB (the demo's alpaca rows, repeated, in 16 shards) under
   `--corpus` (default /tmp/finetune_stream_corpus; never in the repository).
2. Reads the whole corpus through the stream loader (tokenize + buffered packing, no model) for up
   to `--read-seconds`, sampling the process's RSS: start, middle, end, max, and how much was read.
3. Trains the tiny demo model for `--steps` steps with `finetune train` on a subset (one shard of
   `--subset-rows` rows) streamed and prepared, interleaved, one CPU thread per run: tokens/s after
   the first 20 steps (warm), and the streaming run's RSS over time (the process tree, from /proc).
4. Packing efficiency of the buffered packer (several buffer sizes) against multipack on the whole
   subset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, check, child_env, interleaved, machine

sys.path.insert(0, str(REPO))  # this checkout's finetune, also for the parts run in this process

DEMO_ROWS = REPO / "recipes" / "demo" / "data" / "arithmetic.jsonl"
STREAM = REPO / "recipes" / "demo" / "tiny_sft_stream_cpu.yaml"
PREPARED = REPO / "recipes" / "demo" / "tiny_sft_cpu.yaml"


def make_corpus(folder: Path, gb: float, shards: int = 16) -> int:
    """`gb` GB of jsonl in `shards` files (kept when already there); returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    chunk = DEMO_ROWS.read_text() * 40  # ~10 MB written at a time
    per_shard = int(gb * 1e9 / shards)
    total = 0
    for k in range(shards):
        path = folder / f"part-{k:03d}.jsonl"
        if not path.exists() or path.stat().st_size < per_shard:
            with open(path, "w") as f:
                written = 0
                while written < per_shard:
                    written += f.write(chunk)
        total += path.stat().st_size
    return total


def rss_mb(pids: list[int]) -> float:
    """Resident memory of the processes `pids` and their children, in MB (from /proc)."""
    seen, todo, total = set(), list(pids), 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def read_only(corpus: Path, seconds: float) -> dict:
    """Read the corpus through the stream loader (no model) for up to `seconds`; RSS samples."""
    import os

    from transformers import AutoTokenizer

    from finetune.data.batching.streaming import make_stream_loader
    from finetune.recipe import load_recipe

    recipe = load_recipe(
        STREAM,
        ["--data.datasets", f"[{{path: {corpus}, type: alpaca}}]", "--data.stream_buffer_size", "1000"],
    )
    tok = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    loader = make_stream_loader(recipe.data, recipe.train, tok, chat_template=None)
    samples, started = [], time.perf_counter()
    next_sample = 0.0
    for _ in loader:
        elapsed = time.perf_counter() - started
        if elapsed >= next_sample:
            counts = loader.counts()
            samples.append(
                {"s": round(elapsed, 1), "rows": counts.rows_in, "rss_mb": round(rss_mb([os.getpid()]), 1)}
            )
            next_sample += 5.0
        if elapsed > seconds or loader.position.epoch >= 1:
            break
    counts = loader.counts()
    return {"samples": samples, "rows": counts.rows_in, "seconds": time.perf_counter() - started,
            "packing_efficiency": loader.packing_efficiency()}  # fmt: skip


def train_run(kind: str, subset: Path, out: Path, steps: int) -> dict:
    """One `finetune train` of `kind` (stream or prepared) on the subset; warm tokens/s and RSS samples."""
    recipe = STREAM if kind == "stream" else PREPARED
    args = ["--data.datasets", f"[{{path: {subset}, type: alpaca}}]", "--train.max_steps", str(steps),
            "--train.log_steps", "10", "--train.save_steps", "0", "--train.save_epochs", "0",
            "--train.save_hf_weights", "false", "--train.output_dir", str(out), "--train.log_format", "structured"]  # fmt: skip
    if kind == "prepared":
        args += [
            "--data.val_set_size",
            "null",
            "--train.eval_steps",
            "null",
            "--data.dataset_prepared_path",
            str(out / "prepared"),
        ]
        args += ["--train.num_train_epochs", "100"]  # max_steps decides; enough epochs of the subset
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(recipe), *args]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=child_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    samples, started = [], time.perf_counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(2.0):
            samples.append(
                {"s": round(time.perf_counter() - started, 1), "rss_mb": round(rss_mb([proc.pid]), 1)}
            )

    threading.Thread(target=sample, daemon=True).start()
    stdout, stderr = proc.communicate()
    stop.set()
    check(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    records = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    warm = [r for r in records if r.get("event") is None and r.get("step", 0) > 20 and "tokens_per_sec" in r]
    last = warm[-1]
    return {
        "kind": kind,
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in warm),
        "rss": samples,
        "stream_packing_efficiency": last.get("stream_packing_efficiency"),
    }


def packing(subset: Path) -> dict:
    """Packing efficiency on the subset's examples: multipack over all of them vs the buffered packer."""
    from transformers import AutoTokenizer

    from finetune.data.batching.packing import BufferedPacker, pack_multipack, packing_efficiency
    from finetune.data.formats.tokenize import tokenize_dataset
    from finetune.data.sources.readers import load_source
    from finetune.recipe import dataset_entry

    tok = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    entry = dataset_entry(path=str(subset), type="alpaca")
    ds = tokenize_dataset(
        load_source(entry), entry, tok, sequence_len=128, excess_length_strategy="drop", on_bad_row="raise"
    ).dataset
    lengths = [len(x) for x in ds["input_ids"]]
    out = {
        "examples": len(lengths),
        "multipack": packing_efficiency(lengths, len(pack_multipack(lengths, 512)), 512),
    }
    for size in (64, 256, 1000, 4000):
        packer = BufferedPacker(512, buffer_size=size)
        for n in lengths:
            packer.add(([0] * n, [0] * n))
        packer.flush()
        out[f"buffer_{size}"] = packer.efficiency()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, default=Path("/tmp/finetune_stream_corpus"))
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--read-seconds", type=float, default=300)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--subset-rows", type=int, default=30000)
    parser.add_argument("--read-only", action="store_true", help=argparse.SUPPRESS)  # the read child
    args = parser.parse_args()
    if args.read_only:
        print(json.dumps(read_only(args.corpus, args.read_seconds)))
        return
    size = make_corpus(args.corpus, args.gb)
    print(f"machine: {machine(cpu=True)}; corpus {size / 1e9:.2f} GB in {args.corpus}", flush=True)
    cmd = [
        sys.executable,
        __file__,
        "--read-only",
        "--corpus",
        str(args.corpus),
        "--read-seconds",
        str(args.read_seconds),
    ]
    result = subprocess.run(cmd, cwd=REPO, env=child_env(1), capture_output=True, text=True)
    check(result)
    print("read:", result.stdout.strip().splitlines()[-1], flush=True)

    subset = args.corpus.parent / "finetune_stream_subset.jsonl"
    lines = DEMO_ROWS.read_text().splitlines()
    subset.write_text("\n".join(lines[i % len(lines)] for i in range(args.subset_rows)) + "\n")
    print("packing:", json.dumps(packing(subset)), flush=True)
    work = args.corpus.parent / "finetune_stream_runs"
    runs = interleaved(
        ["stream", "prepared"],
        args.repeats,
        lambda kind, i: train_run(kind, subset, work / f"{kind}-{i}", args.steps),
        lambda r: (
            f"{r['tokens_per_sec']:.0f} tokens/s, RSS {r['rss'][0]['rss_mb'] if r['rss'] else 0}..{max((s['rss_mb'] for s in r['rss']), default=0)} MB"
        ),
    )
    print("train:", json.dumps(runs), flush=True)


if __name__ == "__main__":
    main()
