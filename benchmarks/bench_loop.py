"""Training-loop benchmarks (CPU): figures go to benchmarks/RESULTS.md.

1. Loop overhead: time per optimizer step of finetune's loop (train_loop: token-normalised
   accumulation, clipping, nonfinite check, throughput/MFU accounting, progress.jsonl every step)
   vs a bare Accelerate loop (accumulate / backward / step / zero_grad) on the same model, batches
   and optimizer. Runs are interleaved (ours, bare, bare, ours, ...) so machine load hits both, on
   --threads CPU threads (default 1: on shared cores two threads stall whenever one core is taken;
   benchmarks/_common.py); the table gives the medians and every run.
2. Packed vs padded: trainable tokens per second on GSM8K lengths (Llama-2 tokenizer), the same
   examples as packed rows (multipack, 2048 tokens) or one example per row padded per batch.

    python benchmarks/bench_loop.py [--steps 30] [--repeats 3] [--threads 1] [--skip-packing]
    python benchmarks/bench_loop.py --steps 3 --repeats 2 --skip-packing     # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO))

from _common import every_run, interleaved  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from finetune.engine.loop import setup, train_loop  # noqa: E402
from finetune.engine.state import LoopState  # noqa: E402
from finetune.metrics import ProgressLog  # noqa: E402
from finetune.objectives import objective_for  # noqa: E402
from finetune.recipe import load_recipe, recipe_to_dict  # noqa: E402


def _fresh_accelerator(recipe) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(
        mixed_precision=recipe.train.mixed_precision,
        gradient_accumulation_steps=recipe.train.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,
        cpu=True,
    )


def _setup(recipe):
    """The engine's run for a recipe (objective built, optimizer, schedule, prepare), without training."""
    return setup(
        objective_for(recipe),
        _fresh_accelerator(recipe),
        train=recipe.train,
        hub=recipe.hub,
        recipe_dict=recipe_to_dict(recipe),
    )


def _bare_loop(run, steps: int) -> float:
    """The textbook Accelerate loop on the same objects; returns seconds per optimizer step."""
    acc, model, opt, sched = run.accelerator, run.model, run.optimizer, run.scheduler
    ga = run.train.gradient_accumulation_steps
    batches = iter(run.train_loader)
    model.train()
    start = time.perf_counter()
    for _ in range(steps * ga):
        batch = next(batches)
        with acc.accumulate(model):
            loss = model(**batch, use_cache=False).loss  # mean over the micro-batch's tokens
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    return (time.perf_counter() - start) / steps


def _our_loop(run, steps: int, tmp: Path) -> float:
    run.state = LoopState()
    run.total_steps = steps
    run.stop_reason = None
    log = ProgressLog(tmp / "progress.jsonl", enabled=True, log_format="structured", total_steps=steps)
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115 - silence key=value lines
    try:
        start = time.perf_counter()
        train_loop(run, log)
        elapsed = time.perf_counter() - start
    finally:
        sys.stdout.close()
        sys.stdout = stdout
        log.close()
    return elapsed / steps


def bench_overhead(steps: int, repeats: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    recipe = load_recipe(
        REPO / "recipes/demo/tiny_sft_cpu.yaml",
        [
            "--train.output_dir",
            str(tmp / "out"),
            "--data.dataset_prepared_path",
            str(tmp / "prepared"),
            "--train.gradient_accumulation_steps",
            "2",
            "--train.log_steps",
            "1",
            "--train.save_epochs",
            "0",
            "--train.eval_steps",
            "null",
            "--data.val_set_size",
            "null",
            # a larger tiny model so a step is long enough to time (~tens of ms)
            "--model.config_path.hidden_size",
            "256",
            "--model.config_path.intermediate_size",
            "688",
            "--model.config_path.num_hidden_layers",
            "4",
        ],
    )
    run = _setup(recipe)
    _our_loop(run, 3, tmp)  # warm-up both paths (allocator, autograd graph caches)
    _bare_loop(run, 3)
    loops = {"ours": lambda: _our_loop(run, steps, tmp), "bare": lambda: _bare_loop(run, steps)}
    runs = interleaved(
        list(loops),
        repeats,
        lambda name, _: {"s_per_step": loops[name]()},
        lambda r: f"{r['s_per_step'] * 1e3:.1f} ms",
    )
    ours, bare = ([r["s_per_step"] for r in runs[name]] for name in ("ours", "bare"))
    return {
        "ours_s_per_step": statistics.median(ours),
        "bare_s_per_step": statistics.median(bare),
        "ratio": statistics.median(ours) / statistics.median(bare),
        "ours_all": ours,
        "bare_all": bare,
        "ours_every_run": every_run(runs["ours"], "s_per_step", ".4f"),
        "bare_every_run": every_run(runs["bare"], "s_per_step", ".4f"),
        "steps": steps,
        "repeats": repeats,
    }


def bench_packing(steps: int, loss_chunk_size: str = "null") -> dict | None:
    """Packed vs padded GSM8K batches; `loss_chunk_size` is train.loss_chunk_size for both (null: the
    auto rule, which chunks the padded batches' 2.1 GB of logits and not the packed rows' 0.26 GB)."""
    gsm8k, tok = SHARED / "gsm8k" / "train.jsonl", SHARED / "tokenizers" / "llama2-hf"
    if not gsm8k.is_file() or not tok.is_dir():
        print(f"skipping packed vs padded: {SHARED} is absent", file=sys.stderr)
        return None
    results = {}
    for packed in (True, False):
        tmp = Path(tempfile.mkdtemp(prefix="bench-pack-"))
        recipe_path = tmp / "recipe.yaml"
        recipe_path.write_text(
            f"""
model:
  config_path: {{model_type: llama, hidden_size: 128, intermediate_size: 352, num_hidden_layers: 2,
                num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 32000, max_position_embeddings: 4096}}
  tokenizer_path: {tok}
  torch_dtype: fp32
data:
  datasets: [{{path: {gsm8k}, type: input_output, field_prompt: question, field_completion: answer}}]
  dataset_prepared_path: {tmp / "prepared"}
  dataset_num_proc: 1
  sequence_len: 2048
  sample_packing: {str(packed).lower()}
  pad_to_multiple_of: 64
  dataloader_num_workers: 0
  dataloader_prefetch_factor: null
train:
  output_dir: {tmp / "out"}
  micro_batch_size: {1 if packed else 8}
  mixed_precision: "no"
  save_epochs: 0
  log_steps: 1
  lr: 1.0e-4
  loss_chunk_size: {loss_chunk_size}
"""
        )
        recipe = load_recipe(recipe_path)
        run = _setup(recipe)
        _our_loop(run, 2, tmp)  # warm-up
        elapsed = _our_loop(run, steps, tmp) * steps
        records = [json.loads(x) for x in (tmp / "progress.jsonl").read_text().splitlines()]
        trainable = sum(r["trainable_tokens"] for r in records[-steps:] if r.get("event") is None)
        results["packed" if packed else "padded"] = {
            "trainable_tokens_per_sec": trainable / elapsed,
            "rows": len(run.train_loader.dataset),
        }
    results["ratio"] = (
        results["packed"]["trainable_tokens_per_sec"] / results["padded"]["trainable_tokens_per_sec"]
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads); 0 = all")
    parser.add_argument("--skip-packing", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument(
        "--loss-chunk-size",
        default="null",
        help="train.loss_chunk_size of both packing runs (null: auto, 0: off)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not args.skip_overhead:
        overhead = bench_overhead(args.steps, args.repeats)
        print(f"\n{torch.get_num_threads()} CPU thread(s); median of {args.repeats} interleaved run(s)")
        print("\n| loop | s / optimizer step (median) | every run (s / step) |\n|---|---|---|")
        print(
            f"| finetune train_loop | {overhead['ours_s_per_step'] * 1e3:.1f} ms | {overhead['ours_every_run']} |"
        )
        print(
            f"| bare Accelerate loop | {overhead['bare_s_per_step'] * 1e3:.1f} ms | {overhead['bare_every_run']} |"
        )
        print(f"| ratio | {overhead['ratio']:.3f}x | |")
        print(json.dumps(overhead))
    if not args.skip_packing:
        packing = bench_packing(max(4, args.steps // 3), args.loss_chunk_size)
        if packing:
            print("\n| batches | trainable tokens / s |\n|---|---|")
            print(f"| packed (multipack, 2048) | {packing['packed']['trainable_tokens_per_sec']:.0f} |")
            print(f"| padded (micro batch 8) | {packing['padded']['trainable_tokens_per_sec']:.0f} |")
            print(f"| ratio | {packing['ratio']:.2f}x |")
            print(json.dumps(packing))


if __name__ == "__main__":
    main()
