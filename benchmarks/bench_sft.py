"""SFT throughput: finetune vs TRL's SFTTrainer on the same model, data and batch, in one run.

Both train the same architecture on GSM8K (question as prompt, answer as completion, prompt masked),
packed into rows of --seq-len tokens (finetune: multipack with position_ids; TRL: its BFD packing,
padding-free), the same micro batch, accumulation, optimizer (AdamW, fused on CUDA), precision and
gradient-checkpointing setting. Each run is a fresh subprocess; a run's throughput is the median of
the per-step tokens/s after --warmup steps (finetune: progress.jsonl; TRL: its cumulative
`num_tokens` over the wall clock between its per-step logs). MFU uses the same FLOPs-per-token
formula for both (finetune.metrics.model_flops_per_token, attention counted over the packed
sequences' lengths).

With --repeats N the tools run in turn (finetune, TRL, TRL, finetune, ...), N times each; the table
gives the median of a tool's runs and every run's figure. On CPU each run uses --threads threads
(default 1: on two shared cores, two threads per run made the same comparison read 10.2x, then
0.67x; benchmarks/_common.py says why).

    # GPU: a TinyLlama-1.1B-shaped model (random init) with the Llama-2 tokenizer, full and LoRA
    python benchmarks/bench_sft.py --preset tinyllama-1.1b --modes full lora --micro-batch 4 --seq-len 2048
    # CPU: the real SmolLM2-135M-Instruct (a Hugging Face folder), LoRA, rows of 512, 3 runs per tool
    python benchmarks/bench_sft.py --model-path PATH --modes lora --micro-batch 1 --seq-len 512 --steps 12 --repeats 3
    # smoke test (a minute on CPU): the tiny preset, 3 steps, 2 runs per tool
    python benchmarks/bench_sft.py --preset tiny --modes lora --rows 200 --seq-len 256 --micro-batch 1 --steps 3 --warmup 1

Prints a markdown table; --json FILE also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, check, every_run, interleaved, machine, medians, run_kwargs

SHARED = REPO.parent / "shared" / "data"

PRESETS = {
    # TinyLlama-1.1B's architecture (22 layers, GQA 32/4) with the Llama-2 vocabulary.
    "tinyllama-1.1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # A smoke-test size (seconds on a CPU) with the Llama-2 vocabulary.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # SmolLM2-135M's architecture (30 layers, GQA 9/3, tied embeddings) with a 49152 vocabulary.
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def write_data(source: Path, out: Path, limit: int) -> int:
    """GSM8K rows as prompt/completion jsonl (read .jsonl or .jsonl.gz)."""
    import gzip

    opener = gzip.open if source.suffix == ".gz" else open
    rows = 0
    with opener(source, "rt") as f, open(out, "w") as g:
        for line in f:
            row = json.loads(line)
            prompt = f"Question: {row['question']}\nAnswer: "
            g.write(json.dumps({"prompt": prompt, "completion": row["answer"]}) + "\n")
            rows += 1
            if rows >= limit:
                break
    return rows


# ------------------------------------------------------------------------------------- finetune


def run_finetune(args, mode: str, work: Path, data: Path, repeat: int = 1) -> dict:
    import yaml

    model: dict = {"attn_implementation": args.attn, "torch_dtype": "auto"}
    if args.model_path:
        model["model_path"] = args.model_path
    else:
        model["config_path"] = PRESETS[args.preset]
        model["tokenizer_path"] = args.tokenizer
    recipe = {
        "model": model,
        "data": {
            "datasets": [
                {
                    "path": str(data),
                    "type": "input_output",
                    "field_prompt": "prompt",
                    "field_completion": "completion",
                }
            ],
            "val_set_size": None,
            "sequence_len": args.seq_len,
            "sample_packing_sequence_len": args.seq_len,
            "dataset_prepared_path": str(work / "prepared"),
            "dataloader_num_workers": 0,
            "dataloader_prefetch_factor": None,
        },
        "train": {
            "output_dir": str(work / f"finetune-{mode}-{repeat}"),
            "micro_batch_size": args.micro_batch,
            "gradient_accumulation_steps": args.grad_accum,
            "max_steps": args.steps,
            "lr": 1e-5 if mode == "full" else 2e-4,
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
        "lora": _lora(mode),
    }
    path = work / f"finetune-{mode}-{repeat}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    sub = run_kwargs(args.threads)
    # Prepare first, so the timed run only trains (its data time is not what is compared).
    check(subprocess.run([sys.executable, "-m", "finetune.cli", "prepare-dataset", str(path)], **sub))
    started = time.perf_counter()
    check(subprocess.run([sys.executable, "-m", "finetune.cli", "train", str(path)], **sub))
    wall = time.perf_counter() - started
    records = [
        json.loads(line)
        for line in (work / f"finetune-{mode}-{repeat}" / "progress.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in records if r.get("event") is None and r.get("tokens_per_sec")]
    timed = [r for r in steps if r["step"] > args.warmup]
    return {
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps) or None,
        "host_rss_gib": max(r["host_rss_gib"] for r in steps),
        "final_loss": steps[-1]["loss"],
        # The two tools draw rows in different orders, so one step's loss says little; the mean over
        # every step is the check that both train the same objective on the same data.
        "mean_loss": statistics.mean(r["loss"] for r in steps),
        "wall_s": wall,
    }


def _lora(mode: str) -> dict:
    if mode == "full":
        return {"enable_lora": False}
    return {
        "enable_lora": True,
        "lora_rank": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "lora_target_modules": "all-linear",
    }


# ----------------------------------------------------------------------------------------- TRL


def run_trl(args, mode: str, work: Path, data: Path, repeat: int = 1) -> dict:
    out = work / f"trl-{mode}-{repeat}.json"
    cmd = [sys.executable, __file__, "--trl-child", mode, "--child-out", str(out), "--child-data", str(data)]
    cmd += _forwarded(args)
    started = time.perf_counter()
    check(subprocess.run(cmd, **run_kwargs(args.threads)))
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def trl_child(args) -> None:
    """Runs inside a fresh process: TRL SFTTrainer with the same settings; writes its numbers."""
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    mode = args.trl_child
    cuda = torch.cuda.is_available() and args.precision != "no"
    lora = mode == "lora"
    dtype = torch.bfloat16 if (lora and args.precision == "bf16") else torch.float32
    torch.manual_seed(0)
    if args.model_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        model = AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, attn_implementation=args.attn
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        config = AutoConfig.for_model(**PRESETS[args.preset])
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )

    class Clock(TrainerCallback):
        """(wall time, cumulative tokens) at every per-step log."""

        def __init__(self):
            self.points: list[tuple[int, float, float]] = []

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                self.points.append((state.global_step, time.perf_counter(), float(logs["num_tokens"])))

    clock = Clock()
    config = SFTConfig(
        output_dir=str(Path(args.child_out).with_suffix("")),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=1e-5 if mode == "full" else 2e-4,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        bf16=args.precision == "bf16",
        use_cpu=not cuda,
        packing=True,
        max_length=args.seq_len,
        gradient_checkpointing=args.gradient_checkpointing,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    dataset = datasets.load_dataset("json", data_files=args.child_data, split="train")
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[clock],
    )
    trainer.train()
    rates = [
        (t1 - t0_tokens) / (w1 - w0)
        for (s0, w0, t0_tokens), (s1, w1, t1) in zip(clock.points, clock.points[1:], strict=False)
        if s0 >= args.warmup
    ]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    import resource

    Path(args.child_out).write_text(
        json.dumps(
            {
                "tokens_per_sec": statistics.median(rates),
                "peak_mem_gib": peak,
                "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "final_loss": trainer.state.log_history[-2].get("loss")
                if len(trainer.state.log_history) > 1
                else None,
                "mean_loss": statistics.mean(h["loss"] for h in trainer.state.log_history if "loss" in h),
            }
        )
    )


# ---------------------------------------------------------------------------------------- report


def flops_per_token(args, mode: str, data: Path) -> tuple[float, int]:
    """(training FLOPs per token, parameters) with finetune's formula; attention over GSM8K lengths."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from finetune.metrics import model_flops_per_token

    if args.model_path:
        config = AutoConfig.from_pretrained(args.model_path)
        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    else:
        config = AutoConfig.for_model(**PRESETS[args.preset])
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    lengths = []
    with open(data) as f:
        for line in f:
            row = json.loads(line)
            lengths.append(len(tokenizer(row["prompt"] + row["completion"])["input_ids"]) + 1)
    seq_sq_mean = sum(n * n for n in lengths) / sum(lengths)
    trainable = params
    if mode == "lora":
        trainable = _lora_params(config)
    return model_flops_per_token(
        config, num_params=params, num_trainable=trainable, seq_len_sq_mean=seq_sq_mean
    ), params


def _lora_params(config) -> int:
    """Rank-16 LoRA on every linear layer of a Llama block: r x (in + out) per projection."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    return layers * sum(16 * (a + b) for a, b in shapes)


def _forwarded(args) -> list[str]:
    out = ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    out += ["--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out += ["--precision", args.precision, "--attn", args.attn, "--preset", args.preset]
    out += ["--tokenizer", str(args.tokenizer)]
    if args.model_path:
        out += ["--model-path", args.model_path]
    if args.gradient_checkpointing:
        out += ["--gradient-checkpointing"]
    return out


def print_report(args, results: list[dict], runs: dict[str, dict[str, list[dict]]], rows: int) -> None:
    """The markdown table: each tool's median over its runs, and every run's tokens/s."""
    model = args.model_path or f"{args.preset} (random init)"
    threads = f", {args.threads} thread(s) per run" if args.threads else ""
    print(
        f"\nmodel: {model}; {rows} GSM8K rows packed into rows of {args.seq_len}; micro batch {args.micro_batch}, "
        f"accumulation {args.grad_accum}, {args.steps} steps ({args.warmup} warm-up), {args.precision}, "
        f"{args.attn}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; median of "
        f"{args.repeats} interleaved run(s) per tool; {machine()}{threads}\n"
    )
    print(
        "| mode | tool | tokens/s (median) | every run's tokens/s | MFU | peak GPU GiB | host RSS GiB "
        "| final loss | mean loss | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
        loss = f"{r['final_loss']:.3f}" if r.get("final_loss") is not None else "-"
        mean_loss = f"{r['mean_loss']:.3f}" if r.get("mean_loss") is not None else "-"
        every = every_run(runs[r["mode"]][r["tool"]], "tokens_per_sec", ",.1f")
        print(
            f"| {r['mode']} | {r['tool']} | {r['tokens_per_sec']:,.1f} | {every} | {mfu} | {mem} | "
            f"{r['host_rss_gib']:.1f} | {loss} | {mean_loss} | {r['wall_s']:.0f} |"
        )
    for mode, by_tool in runs.items():
        if len(by_tool) == 2:
            ft, trl = (by_tool[tool] for tool in ("finetune", "trl"))
            ratio = statistics.median(r["tokens_per_sec"] for r in ft) / statistics.median(
                r["tokens_per_sec"] for r in trl
            )
            # each repeat's pair of runs ran back to back, under about the same load
            pairs = ", ".join(
                f"{a['tokens_per_sec'] / b['tokens_per_sec']:.2f}x" for a, b in zip(ft, trl, strict=True)
            )
            print(f"{mode}: finetune / TRL tokens/s = **{ratio:.2f}x** (medians; run by run: {pairs})")
    print(f"\ncommand: python benchmarks/bench_sft.py {' '.join(sys.argv[1:])}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tinyllama-1.1b")
    parser.add_argument("--model-path", help="a Hugging Face model folder (real weights) instead of --preset")
    parser.add_argument("--tokenizer", default=str(SHARED / "tokenizers" / "llama2-hf"))
    parser.add_argument("--data", default=str(SHARED / "gsm8k" / "train.jsonl"))
    parser.add_argument("--rows", type=int, default=2000, help="GSM8K rows to use")
    parser.add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--tools", nargs="+", choices=["finetune", "trl"], default=["finetune", "trl"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--precision", choices=["bf16", "no"], default=None, help="default: bf16 on CUDA, else no"
    )
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--repeats", type=int, help="runs of each tool, interleaved (default: 2 on CPU, 1 on CUDA)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads per run (OMP_NUM_THREADS; default: 1 on CPU, 0 = all on CUDA)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--child-data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    args.precision = args.precision or ("bf16" if cuda else "no")
    args.repeats = args.repeats or (1 if cuda else 2)
    args.threads = args.threads if args.threads is not None else (0 if cuda else 1)
    if args.trl_child:
        trl_child(args)
        return
    sys.path.insert(0, str(REPO))
    from finetune.metrics import device_peak_flops

    peak = device_peak_flops(torch.device("cuda")) if cuda else None
    results, runs = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        work = Path(tmp)
        data = work / "gsm8k.jsonl"
        rows = write_data(Path(args.data), data, args.rows)
        for mode in args.modes:
            fpt, params = flops_per_token(args, mode, data)

            def run(tool: str, repeat: int, mode: str = mode) -> dict:
                return (run_finetune if tool == "finetune" else run_trl)(args, mode, work, data, repeat)

            runs[mode] = interleaved(
                args.tools, args.repeats, run, lambda r: f"{r['tokens_per_sec']:.1f} tokens/s"
            )
            for tool, done in runs[mode].items():
                result = medians(done) | {
                    "tool": tool,
                    "mode": mode,
                    "params": params,
                    "flops_per_token": fpt,
                }
                result["all_tokens_per_sec"] = [r["tokens_per_sec"] for r in done]
                result["mfu"] = result["tokens_per_sec"] * fpt / peak if peak else None
                results.append(result)
    print_report(args, results, runs, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
