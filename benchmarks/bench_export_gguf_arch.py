#!/usr/bin/env python
"""`write_gguf` per outtype on the tiny Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE models of
tests/unit/gguf/test_gguf_export_arch.py.

    python benchmarks/bench_export_gguf_arch.py

For each architecture and outtype: the file's size and the largest logit difference of the file
loaded back with transformers (`gguf_file=`) from the model, absolute and as a fraction of the largest
logit (what the test's TOLERANCE bounds).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from finetune.gguf.export import OUTTYPES, write_gguf
from tests.unit.gguf.test_gguf_export import DEMO_TOKENIZER, TEXTS, load_back
from tests.unit.gguf.test_gguf_export_arch import ARCHS, model


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    ids = torch.tensor([tokenizer(TEXTS[0]).input_ids])
    print("| model (GGUF architecture) | outtype | file KiB | max abs logit diff | of largest logit |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-export-gguf-arch-") as folder:
        for model_type, (arch, _) in ARCHS.items():
            net = model(model_type, tokenizer)
            with torch.no_grad():
                want = net(ids).logits
            for outtype in OUTTYPES:
                path = Path(folder) / f"{model_type}-{outtype}.gguf"
                write_gguf(net, tokenizer, path, outtype=outtype, name=f"tiny-{model_type}")
                with torch.no_grad():
                    got = load_back(path)[0](ids).logits
                diff = (got - want).abs().max().item()
                share = diff / want.abs().max().item()
                size = path.stat().st_size / 1024
                print(f"| {model_type} ({arch}) | {outtype} | {size:.1f} | {diff:.4f} | {share:.2%} |")


if __name__ == "__main__":
    main()
