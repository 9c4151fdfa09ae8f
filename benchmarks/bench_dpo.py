"""DPO throughput: finetune vs TRL's DPOTrainer on the same model, data and batch, in one run.

Both train LoRA adapters (rank 16, all linear layers; the reference is the base with the adapters
disabled) with the sigmoid DPO loss, beta 0.1, on the same GSM8K preference pairs (prompt = the
question, chosen = the reference solution, rejected = the same solution with a wrong final answer, as
recipes/smollm2/make_gsm8k_preferences.py builds them; plain text, no chat template, each completion
ending with eos), the same optimizer (AdamW), precision and gradient-checkpointing setting, from a
random-init Llama preset with the Llama-2 tokenizer (or --model-path). Each run is a fresh subprocess.

* finetune, padded: one pair per row (chosen and rejected side by side, position_ids restarting),
  --pairs-per-batch rows per micro-batch: the same pairs per step as TRL.
* finetune, packed: pairs bin-packed into rows of --row-tokens, --rows-per-batch rows per micro-batch
  (a pair is never split; pairs per step vary with their lengths).
* TRL: DPOTrainer with --pairs-per-batch pairs per micro-batch (its padded layout: all chosen rows,
  then all rejected rows; TRL 1.16 has padding_free disabled).

Throughput is pairs/s: the median over the steps after --warmup of pairs / step time (finetune:
`pairs_per_sec` in progress.jsonl; TRL: its pairs per step over the wall clock between step ends).
tokens/s = pairs/s x the mean real tokens of a pair (prompt counted in both sequences, no padding),
the same factor for every run, so the tokens/s ratios are the pairs/s ratios. With --repeats N the
runs are interleaved (every layout once, then again in reverse order, ...); the table gives each
layout's median over its runs and every run's figure. On CPU the runs use one thread (--threads):
with two threads on two shared cores a step took anywhere from 1x to 10x its time, as each kernel
waits for the thread whose core was taken (benchmarks/_common.py).

    # CPU (what RESULTS.md reports): a small Llama (hidden 256, 4 layers) with the Llama-2 vocabulary
    python benchmarks/bench_dpo.py
    # GPU: a TinyLlama-1.1B-shaped model, bf16, larger batches (the same code; the device decides)
    python benchmarks/bench_dpo.py --gpu

Prints a markdown table; --json FILE also writes the numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, check, every_run, interleaved, machine, medians, run_kwargs
from bench_sft import PRESETS as SFT_PRESETS

SHARED = Path(os.environ.get("FINETUNE_SHARED_DATA") or REPO.parent / "shared" / "data")

PRESETS = {
    **SFT_PRESETS,
    # The model of bench_preference_packing.py: seconds per step on a CPU, the Llama-2 vocabulary.
    "small": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
# --gpu: what the run changes when no option says otherwise.
GPU_DEFAULTS = {"preset": "tinyllama-1.1b", "precision": "bf16", "pairs_per_batch": 8, "row_tokens": 4096}
GPU_DEFAULTS |= {"rows_per_batch": 1, "steps": 30, "warmup": 5, "pairs": 2000, "repeats": 1, "threads": 0}
CPU_DEFAULTS = {"preset": "small", "precision": "no", "pairs_per_batch": 4, "row_tokens": 1024}
CPU_DEFAULTS |= {"rows_per_batch": 1, "steps": 12, "warmup": 3, "pairs": 400, "repeats": 2, "threads": 1}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
BETA, LR = 0.1, 5e-5


def write_pairs(source: Path, out: Path, limit: int) -> int:
    """GSM8K pairs as {"prompt", "chosen", "rejected"} jsonl (the recipe script's wrong final answer)."""
    import random

    spec = importlib.util.spec_from_file_location(
        "make_gsm8k_preferences", REPO / "recipes" / "smollm2" / "make_gsm8k_preferences.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng, rows = random.Random(0), 0
    with open(source) as f, open(out, "w") as g:
        for line in f:
            row = json.loads(line)
            rejected = script.wrong_final_answer(row["answer"], rng)
            if rejected is None:
                continue
            prompt = f"Question: {row['question']}\nAnswer: "
            g.write(json.dumps({"prompt": prompt, "chosen": row["answer"], "rejected": rejected}) + "\n")
            rows += 1
            if rows >= limit:
                break
    return rows


def tokens_per_pair(args, data: Path) -> float:
    """Mean real tokens of a pair: [bos] prompt completion eos, twice."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path or args.tokenizer)
    total = n = 0
    with open(data) as f:
        for line in f:
            row = json.loads(line)
            for side in ("chosen", "rejected"):
                total += len(tokenizer(row["prompt"] + row[side])["input_ids"]) + 1
            n += 1
    return total / n


# ------------------------------------------------------------------------------------- finetune


def run_finetune(args, layout: str, work: Path, data: Path) -> dict:
    import yaml

    model: dict = {"attn_implementation": args.attn, "torch_dtype": "auto"}
    if args.model_path:
        model["model_path"] = args.model_path
    else:
        model |= {"config_path": PRESETS[args.preset], "tokenizer_path": args.tokenizer}
    packed = layout == "packed"
    recipe = {
        "model": model,
        "data": {
            "datasets": [{"path": str(data), "type": "preference"}],
            "sequence_len": 2 * args.max_length,  # a pair; TRL's max_length bounds each sequence
            "sample_packing": packed,
            "sample_packing_sequence_len": max(args.row_tokens, 2 * args.max_length) if packed else None,
            "pad_to_multiple_of": 8,
            "dataset_prepared_path": str(work / "prepared"),
            "dataloader_num_workers": 0,
            "dataloader_prefetch_factor": None,
        },
        "train": {
            "output_dir": str(work / f"finetune-{layout}"),
            "objective": "dpo",
            "beta": BETA,
            "micro_batch_size": args.rows_per_batch if packed else args.pairs_per_batch,
            "gradient_accumulation_steps": 1,
            "max_steps": args.steps,
            "lr": LR,
            "mixed_precision": args.precision,
            "gradient_checkpointing": args.gradient_checkpointing,
            "log_steps": 1,
            "eval_steps": None,
            "save_steps": 0,
            "save_epochs": 0,
            "save_hf_weights": False,
            "log_format": "structured",
            "seed": 0,
        },
        "lora": {
            "enable_lora": True,
            "lora_rank": LORA["r"],
            "lora_alpha": LORA["lora_alpha"],
            "lora_dropout": LORA["lora_dropout"],
            "lora_target_modules": LORA["target_modules"],
        },
    }
    path = work / f"finetune-{layout}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    # Prepare first, so the timed run only trains (its data time is not what is compared).
    sub = run_kwargs(args.threads)
    check(subprocess.run([sys.executable, "-m", "finetune.cli", "prepare-dataset", str(path)], **sub))
    started = time.perf_counter()
    check(subprocess.run([sys.executable, "-m", "finetune.cli", "train", str(path)], **sub))
    wall = time.perf_counter() - started
    out = work / f"finetune-{layout}" / "progress.jsonl"
    steps = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    steps = [r for r in steps if r.get("event") is None and r.get("pairs_per_sec")]
    timed = [r for r in steps if r["step"] > args.warmup]
    return {
        "pairs_per_sec": statistics.median(r["pairs_per_sec"] for r in timed),
        "pairs_per_step": statistics.mean(r["pairs"] for r in timed),
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps) or None,
        "host_rss_gib": max(r["host_rss_gib"] for r in steps),
        "final_loss": steps[-1]["loss"],
        "wall_s": wall,
    }


# ----------------------------------------------------------------------------------------- TRL


def run_trl(args, work: Path, data: Path) -> dict:
    out = work / "trl.json"
    cmd = [sys.executable, __file__, "--trl-child", "--child-out", str(out), "--child-data", str(data)]
    cmd += _forwarded(args)
    started = time.perf_counter()
    check(subprocess.run(cmd, **run_kwargs(args.threads)))
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def trl_child(args) -> None:
    """Runs inside a fresh process: TRL DPOTrainer with the same settings; writes its numbers."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    # As finetune's torch_dtype auto: LoRA's frozen base in the 16-bit compute dtype, else fp32.
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    source = args.model_path or args.tokenizer
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, attn_implementation=args.attn
        )
    else:
        config = AutoConfig.for_model(**PRESETS[args.preset])
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)

    class Clock(TrainerCallback):
        """The wall time at the end of every optimizer step."""

        def __init__(self):
            self.ends: list[tuple[int, float]] = []

        def on_step_end(self, _args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append((state.global_step, time.perf_counter()))

    clock = Clock()
    config = DPOConfig(
        output_dir=str(Path(args.child_out).parent / "trl"),
        per_device_train_batch_size=args.pairs_per_batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=LR,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=args.max_length,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        bf16=args.precision == "bf16",
        use_cpu=not cuda,
        gradient_checkpointing=args.gradient_checkpointing,
        dataloader_num_workers=0,
        dataset_num_proc=1,
        seed=0,
        disable_tqdm=True,
    )
    dataset = datasets.load_dataset("json", data_files=args.child_data, split="train")
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA, task_type="CAUSAL_LM"),
        callbacks=[clock],
    )
    trainer.train()
    rates = [
        args.pairs_per_batch / (t1 - t0)
        for (s0, t0), (_, t1) in zip(clock.ends, clock.ends[1:], strict=False)
        if s0 >= args.warmup
    ]
    import resource

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(args.child_out).write_text(
        json.dumps(
            {
                "pairs_per_sec": statistics.median(rates),
                "pairs_per_step": args.pairs_per_batch,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "final_loss": losses[-1] if losses else None,
            }
        )
    )


# ---------------------------------------------------------------------------------------- report


def _forwarded(args) -> list[str]:
    out = ["--preset", args.preset, "--tokenizer", str(args.tokenizer), "--precision", args.precision]
    out += ["--pairs-per-batch", str(args.pairs_per_batch), "--steps", str(args.steps)]
    out += ["--warmup", str(args.warmup), "--max-length", str(args.max_length), "--attn", args.attn]
    if args.model_path:
        out += ["--model-path", args.model_path]
    if args.gradient_checkpointing:
        out += ["--gradient-checkpointing"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help=f"GPU defaults: {GPU_DEFAULTS}")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model shape (random init)")
    parser.add_argument("--model-path", help="a Hugging Face model folder (real weights) instead of --preset")
    parser.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "llama2-hf"))
    parser.add_argument("--data", default=str(SHARED / "gsm8k" / "train.jsonl"))
    parser.add_argument("--pairs", type=int, help="GSM8K pairs to use")
    parser.add_argument(
        "--layouts", nargs="+", choices=["padded", "packed", "trl"], default=["padded", "packed", "trl"]
    )
    parser.add_argument("--pairs-per-batch", type=int, help="pairs per micro-batch (TRL, finetune padded)")
    parser.add_argument("--row-tokens", type=int, help="tokens per packed row (finetune packed)")
    parser.add_argument("--rows-per-batch", type=int, help="packed rows per micro-batch")
    parser.add_argument("--max-length", type=int, default=512, help="longest sequence (prompt + completion)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--repeats", type=int, help="runs of each layout, interleaved; the median is shown")
    parser.add_argument("--threads", type=int, help="CPU threads per run (OMP_NUM_THREADS); 0 = all cores")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--precision", choices=["bf16", "no"])
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--child-data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in (GPU_DEFAULTS if args.gpu else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    if args.trl_child:
        trl_child(args)
        return
    names = {"padded": "finetune, 1 pair per row", "packed": f"finetune, packed rows of {args.row_tokens}"}
    names["trl"] = "TRL DPOTrainer"
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        work = Path(tmp)
        data = work / "gsm8k_pairs.jsonl"
        pairs = write_pairs(Path(args.data), data, args.pairs)
        per_pair = tokens_per_pair(args, data)

        def run(layout: str, _repeat: int) -> dict:
            return run_trl(args, work, data) if layout == "trl" else run_finetune(args, layout, work, data)

        runs = interleaved(args.layouts, args.repeats, run, lambda r: f"{r['pairs_per_sec']:.2f} pairs/s")
    results = []
    for layout, done in runs.items():
        row = medians(done) | {"layout": layout}
        row |= {
            "tokens_per_sec": row["pairs_per_sec"] * per_pair,
            "all_pairs_per_sec": [r["pairs_per_sec"] for r in done],
        }
        results.append(row)
    model = args.model_path or f"{args.preset} (random init)"
    print(
        f"\nmodel: {model}, LoRA r16 all-linear, DPO beta {BETA}; {pairs} GSM8K pairs ({per_pair:.0f} tokens per "
        f"pair); {args.steps} steps ({args.warmup} warm-up), median of {args.repeats} run(s), {args.precision}, "
        f"{args.attn}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; {machine()}"
        f"{f', {args.threads} thread(s) per run' if args.threads else ''}\n"
    )
    print(
        "| run | pairs / micro-batch | pairs/s (median) | tokens/s | vs TRL | every run's pairs/s | peak GPU GiB "
        "| host RSS GiB | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    trl = next((r for r in results if r["layout"] == "trl"), None)
    for r in results:
        ratio = f"{r['pairs_per_sec'] / trl['pairs_per_sec']:.2f}x" if trl else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
        spread = every_run(runs[r["layout"]], "pairs_per_sec")
        print(
            f"| {names[r['layout']]} | {r['pairs_per_step']:.1f} | {r['pairs_per_sec']:.2f} | "
            f"{r['tokens_per_sec']:,.0f} | {ratio} | {spread} | {mem} | {r['host_rss_gib']:.1f} | {r['wall_s']:.0f} |"
        )
    print(f"\ncommand: python benchmarks/bench_dpo.py {' '.join(sys.argv[1:])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
