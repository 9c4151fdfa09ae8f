#!/usr/bin/env python
"""Vision-language data on CPU: where pixels are processed, at prepare time (cached) or at collate time.

Measures, on the tiny VLM demo (recipes/demo/tiny_vlm_cpu.yaml, its processor and data):

* prepare: rows/s of tokenizing the demo's training rows (finetune.data.formats.tokenize with the processor: every
  image opened, checked and expanded), then what caching the pixels adds: the image processor run on every
  row and its pixel_values written to Arrow (seconds, and the bytes on disk against the image bytes);
* training: tokens/s of optimizer steps (forward, backward, AdamW) of the demo model, batches from the
  prepared rows with pixels made at collate time (finetune.data.batching.vision.collate_vlm: decode + image
  processor) vs read from the cached pixel column; and the loader alone (batches/s).

    python benchmarks/bench_vlm_pixels.py --steps 20 --repeats 3

Each variant runs with one CPU thread, repeats interleaved (benchmarks/_common.py says why).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor  # noqa: E402

from finetune.data.batching.collate import collate_rows  # noqa: E402
from finetune.data.batching.vision import collate_vlm  # noqa: E402
from finetune.data.formats import images  # noqa: E402
from finetune.data.formats.tokenize import tokenize_dataset  # noqa: E402
from finetune.recipe import dataset_entry  # noqa: E402

RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_cpu.yaml"
DATA = REPO / "recipes" / "demo" / "data" / "vlm" / "train.jsonl"
PROCESSOR = REPO / "recipes" / "demo" / "vlm_processor"


def prepare(processor) -> tuple[datasets.Dataset, float]:
    entry = dataset_entry(path=str(DATA), type="chat_template")
    raw = datasets.load_dataset("json", data_files=str(DATA), split="train")
    start = time.perf_counter()
    result = tokenize_dataset(
        raw, entry, processor.tokenizer, sequence_len=64, excess_length_strategy="drop", on_bad_row="raise",
        processor=processor,
    )  # fmt: skip
    return result.dataset, len(raw) / (time.perf_counter() - start)


def cache_pixels(rows: datasets.Dataset, processor, folder: Path) -> tuple[datasets.Dataset, float, int]:
    """The rows with their pixel_values computed once and saved (what a prepare-time cache would do)."""
    start = time.perf_counter()

    def add(batch):
        pixels = [
            processor.image_processor(images=[[images.decode(b) for b in imgs]], return_tensors="np")
            for imgs in batch["images"]
        ]
        return {
            "pixel_values": [p["pixel_values"][0].astype(np.float32) for p in pixels],
            "pixel_attention_mask": [p["pixel_attention_mask"][0] for p in pixels],
        }

    cached = rows.map(add, batched=True, batch_size=64)
    cached.save_to_disk(str(folder))
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in folder.rglob("*.arrow"))
    return datasets.load_from_disk(str(folder)), seconds, size


def collate_cached(rows, *, pad_token_id):
    batch = collate_rows(rows, pad_token_id=pad_token_id, pad_to_multiple_of=8, packed=False)
    del batch["position_ids"]
    batch["pixel_values"] = torch.as_tensor(np.stack([np.asarray(r["pixel_values"]) for r in rows]))
    batch["pixel_attention_mask"] = torch.as_tensor(
        np.stack([np.asarray(r["pixel_attention_mask"]) for r in rows])
    )
    return batch


def model():
    config = dict(yaml.safe_load(RECIPE.read_text())["model"]["config_path"])
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.for_model(config.pop("model_type"), **config))


def run(rows, collate, *, steps: int, batch_size: int, train: bool) -> float:
    """tokens/s of `steps` optimizer steps (train) or batches/s of the loader alone."""
    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=collate)
    net = model() if train else None
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3) if train else None
    tokens, start, done = 0, time.perf_counter(), 0
    while done < steps:
        for batch in loader:
            if train:
                net(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            tokens += int(batch["attention_mask"].sum())
            done += 1
            if done == steps:
                break
    seconds = time.perf_counter() - start
    return (tokens if train else steps) / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    processor = AutoProcessor.from_pretrained(PROCESSOR)
    rows, rows_per_sec = prepare(processor)
    image_bytes = sum(len(b) for imgs in rows["images"] for b in imgs)
    with tempfile.TemporaryDirectory() as tmp:
        cached, cache_seconds, cache_bytes = cache_pixels(rows, processor, Path(tmp) / "cached")
        cached = cached.remove_columns(["images"]).with_format(
            "numpy", columns=["pixel_values", "pixel_attention_mask"], output_all_columns=True
        )
        collate_time = partial(collate_vlm, pad_token_id=3, pad_to_multiple_of=8, processor=processor)
        variants = {
            "collate-time": (rows, collate_time),
            "cached": (cached, partial(collate_cached, pad_token_id=3)),
        }
        results = {(name, train): [] for name in variants for train in (False, True)}
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            for train in (False, True):
                for name in order:
                    data, collate = variants[name]
                    results[name, train].append(
                        run(data, collate, steps=args.steps, batch_size=args.batch_size, train=train)
                    )
    print(f"prepare (tokenize + check + expand images): {rows_per_sec:.0f} rows/s over {len(rows)} rows")
    print(f"caching pixels adds {cache_seconds:.2f} s ({len(rows) / cache_seconds:.0f} rows/s); "
          f"{cache_bytes / 1e6:.1f} MB of pixel_values vs {image_bytes / 1e6:.2f} MB of image bytes")  # fmt: skip
    for (name, train), values in results.items():
        what = "train tokens/s" if train else "loader batches/s"
        runs = ", ".join(f"{v:.0f}" for v in values)
        print(f"{name:>12} {what}: median {statistics.median(values):.0f} (runs: {runs})")


if __name__ == "__main__":
    main()
