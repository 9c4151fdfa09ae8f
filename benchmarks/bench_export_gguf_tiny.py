#!/usr/bin/env python
"""`write_gguf` per outtype on the tiny random models of tests/unit/gguf/test_gguf_export.py.

    python benchmarks/bench_export_gguf_tiny.py

For each architecture the test covers (Llama, Mistral, Qwen2 with tied embeddings, Qwen3) and each
outtype: the file's size and the largest logit difference of the file loaded back with transformers
(`gguf_file=`) from the model, absolute and as a fraction of the largest logit (what the test's
TOLERANCE bounds).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from finetune.gguf.export import OUTTYPES, write_gguf
from tests.unit.gguf.test_gguf_export import ARCHS, DEMO_TOKENIZER, TEXTS, load_back, tiny


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    ids = torch.tensor([tokenizer(TEXTS[0]).input_ids])
    print("| model | outtype | file KiB | max abs logit diff | of largest logit |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-export-gguf-tiny-") as folder:
        for model_type, config in ARCHS.items():
            net = tiny(model_type, len(tokenizer), **config)
            with torch.no_grad():
                want = net(ids).logits
            for outtype in OUTTYPES:
                path = Path(folder) / f"{model_type}-{outtype}.gguf"
                write_gguf(net, tokenizer, path, outtype=outtype, name=f"tiny-{model_type}")
                with torch.no_grad():
                    got = load_back(path)[0](ids).logits
                diff = (got - want).abs().max().item()
                share = diff / want.abs().max().item()
                print(
                    f"| {model_type} | {outtype} | {path.stat().st_size / 1024:.1f} | {diff:.4f} | {share:.2%} |"
                )


if __name__ == "__main__":
    main()
