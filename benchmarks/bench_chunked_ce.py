"""Chunked linear cross-entropy (finetune.losses.chunked_ce): peak memory and time, chunked vs unchunked.

1. step (default): one training step (forward, backward, AdamW step) of a Llama-style model whose head
   dominates: Llama-3 vocabulary (128256), hidden 512, 2 layers, one packed row of 4096 tokens, with
   the model's own loss (`model(...).loss`, full logits) and with `causal_lm_loss`.
2. --head: the output head alone (hidden states -> summed cross-entropy, forward + backward): the
   unchunked loss, the fused path (plain nn.Linear) and the checkpointed path (any head module), over
   chunk sizes. What the choice of paths and the default chunk size rest on.

Every variant runs in a fresh subprocess, so its peak belongs to it alone: on CPU the process RSS
high-water mark (`ru_maxrss`, read in the child), also minus the RSS after the model (and optimizer)
were built; with --gpu `torch.cuda.max_memory_allocated`, and Liger's LigerFusedLinearCrossEntropyLoss
as a third variant when liger_kernel is importable.

With --repeats N the variants run in turn (A B, B A, ...), N times each, with --threads CPU threads per
child (default 1 on CPU; benchmarks/_common.py says why); the table gives each variant's medians and
every run's s / step.

    python benchmarks/bench_chunked_ce.py [--tokens 4096] [--vocab 128256] [--steps 3] [--repeats 2]
    python benchmarks/bench_chunked_ce.py --tokens 512 --vocab 32000 --hidden 64 --steps 2   # smoke test
    python benchmarks/bench_chunked_ce.py --gpu [--tokens 8192]
    python benchmarks/bench_chunked_ce.py --head [--tokens 2048 --vocab 32000 --hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, child_env, every_run, interleaved, medians

sys.path.insert(0, str(REPO))
MIB = 1 << 20


# ------------------------------------------------------------------------------------ in the child


def _rss_mib() -> float:
    """Current resident set size (Linux /proc; the high-water mark elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _peak_rss_mib()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()  # sync point: the timings must include the queued kernels


def _memory(device, baseline: float) -> dict:
    import torch

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / MIB
        return {"peak_mib": peak, "baseline_mib": baseline, "delta_mib": peak - baseline}
    peak = _peak_rss_mib()
    return {"peak_mib": peak, "baseline_mib": baseline, "delta_mib": peak - baseline}


def _baseline(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / MIB
    return _rss_mib()


def _model(cfg: dict, device):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["hidden"] * 8 // 3 // 64 * 64,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["hidden"] // 64,
        num_key_value_heads=cfg["hidden"] // 64,
        max_position_embeddings=cfg["tokens"],
        tie_word_embeddings=False,  # as Llama-3 8B: a separate [vocab x hidden] head
    )
    dtype = torch.bfloat16 if cfg["bf16"] else torch.float32
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model if str(device) == "meta" else model.to(device)


def _row(cfg: dict, device) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (1, cfg["tokens"]), generator=g)
    labels = ids.clone()
    labels[0, 0] = -100
    # One packed row: position_ids and no attention mask, as the collator makes them.
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(cfg["tokens"])[None]}
    return {k: v.to(device) for k, v in batch.items()}


def _liger_loss(model, batch, num_items):
    """Liger's fused linear cross-entropy on the backbone's last hidden state (reduction sum / N)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    from finetune.losses.chunked_ce import next_token_labels

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    labels = next_token_labels(batch["labels"])
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return loss_fn(model.lm_head.weight, hidden.view(-1, hidden.shape[-1]), labels.view(-1)) / num_items


def _loss(variant: str, model, batch, num_items, chunk_size: int):
    from finetune.losses.chunked_ce import causal_lm_loss

    if variant == "unchunked":
        return model(**batch, use_cache=False, num_items_in_batch=num_items).loss
    if variant == "chunked":
        return causal_lm_loss(model, batch, num_items=num_items, chunk_size=chunk_size)
    return _liger_loss(model, batch, num_items)


def step_child(cfg: dict) -> dict:
    """One training step, `cfg['steps']` times; memory and the median time of the steps after the first."""
    import torch

    device = torch.device(cfg["device"])
    model = _model(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = _row(cfg, device)
    num_items = (batch["labels"][:, 1:] != -100).sum()
    baseline = _baseline(device)
    seconds, cpu_seconds, losses = [], [], []
    for _ in range(cfg["steps"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["autocast"]):
            loss = _loss(cfg["variant"], model, batch, num_items, cfg["chunk_size"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # sync point, once per step
        _sync(device)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    return {**_memory(device, baseline), **_times(seconds, cpu_seconds), "losses": losses}


def head_child(cfg: dict) -> dict:
    """The head alone: summed cross-entropy of [tokens x hidden] through a [vocab x hidden] Linear."""
    import torch
    import torch.nn.functional as F

    from finetune.losses.chunked_ce import chunked_cross_entropy

    device = torch.device(cfg["device"])
    torch.manual_seed(0)
    hidden = torch.randn(cfg["tokens"], cfg["hidden"], device=device, requires_grad=True)
    head = torch.nn.Linear(cfg["hidden"], cfg["vocab"], bias=False, device=device)
    labels = torch.randint(0, cfg["vocab"], (cfg["tokens"],), device=device)
    variant, chunk = cfg["variant"], cfg["chunk_size"]
    baseline = _baseline(device)
    seconds, cpu_seconds = [], []
    for _ in range(cfg["steps"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        if variant == "unchunked":
            loss = F.cross_entropy(head(hidden).float(), labels, reduction="sum")
        else:
            loss = chunked_cross_entropy(hidden, head if variant == "fused" else head.forward, labels, chunk)
        loss.backward()
        _sync(device)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        hidden.grad = head.weight.grad = None
    return {**_memory(device, baseline), **_times(seconds, cpu_seconds), "losses": [loss.item()]}


def _times(seconds: list[float], cpu_seconds: list[float]) -> dict:
    """Medians over the steps after the first (which also warms up and allocates AdamW's state).

    CPU seconds (all threads of the process) are reported beside wall seconds: on a shared machine they
    move less with the load of other processes.
    """
    return {
        "s_per_step": statistics.median(seconds[1:] or seconds),
        "cpu_s_per_step": statistics.median(cpu_seconds[1:] or cpu_seconds),
    }


# ----------------------------------------------------------------------------------- in the parent


def run_child(cfg: dict) -> dict:
    """Run one variant in a fresh Python process; returns its JSON report."""
    cmd = [sys.executable, __file__, "--child", json.dumps(cfg)]
    env = child_env(cfg["threads"])
    if cfg["mode"] == "head":
        # glibc serves allocations under its (adaptive, up to 32 MiB) mmap threshold from the heap, whose
        # fragmentation then shows in RSS: small chunks would look worse than the tensors they make.
        # A fixed 1 MiB threshold maps every tensor of note, so RSS follows what is alive.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        hint = ""
        if "can't allocate memory" in proc.stderr or "MemoryError" in proc.stderr:
            hint = f" (over the {cfg['limit_gib']:.1f} GiB limit: fewer --tokens, or --skip-unchunked)"
        raise SystemExit(f"{cfg['variant']} failed{hint}:\n{proc.stderr[-4000:]}")
    return {**cfg, **json.loads(proc.stdout.strip().splitlines()[-1])}


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, 1-min load average {load:.1f} at the end"


def table(rows: list[dict], *, gpu: bool) -> str:
    memory = "max_memory_allocated" if gpu else "peak RSS"
    lines = [
        f"| variant | chunk | {memory} MiB | baseline MiB | delta MiB | s / step | every run's s / step "
        "| CPU s / step | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunk = r["chunk_size"] if r["variant"] not in ("unchunked", "liger") else "-"
        lines.append(
            f"| {r['variant']} | {chunk} | {r['peak_mib']:,.0f} | {r['baseline_mib']:,.0f} | "
            f"{r['delta_mib']:,.0f} | {r['s_per_step']:.2f} | {every_run(r['runs'], 's_per_step')} | "
            f"{'-' if gpu else format(r['cpu_s_per_step'], '.2f')} | {r['losses'][0]:.6f} |"
        )
    ref = rows[0]
    lines.append(f"\nRatios to {ref['variant']}:\n")
    for r in rows[1:]:
        lines.append(
            f"- {r['variant']} (chunk {r['chunk_size']}): peak {r['peak_mib'] / ref['peak_mib']:.2f}x, delta "
            f"{r['delta_mib'] / max(ref['delta_mib'], 1):.2f}x, time {r['s_per_step'] / ref['s_per_step']:.2f}x "
            f"(CPU time {r['cpu_s_per_step'] / ref['cpu_s_per_step']:.2f}x)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="run on CUDA (memory: max_memory_allocated)")
    parser.add_argument("--head", action="store_true", help="the head alone: fused vs checkpointed paths")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant; the first is not timed")
    parser.add_argument(
        "--chunk-sizes", default=None, help="comma-separated; default: default_chunk_size(vocab)"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (GPU: the usual full-bf16 setup)")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast over fp32 weights")
    parser.add_argument("--skip-unchunked", action="store_true", help="when the full logits would not fit")
    parser.add_argument(
        "--limit-gib", type=float, help="address-space limit per CPU child (default: 80%% of MemAvailable)"
    )
    parser.add_argument(
        "--repeats", type=int, help="runs of each variant, interleaved (default: 2 on CPU, 1 on GPU)"
    )
    parser.add_argument("--threads", type=int, help="CPU threads per child (default: 1 on CPU; 0 = all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.gpu else 2)
    args.threads = args.threads if args.threads is not None else (0 if args.gpu else 1)
    if args.child:
        cfg = json.loads(args.child)
        _limit_address_space(cfg.get("limit_gib"))
        print(json.dumps((head_child if cfg["mode"] == "head" else step_child)(cfg)))
        return

    from finetune.losses.chunked_ce import default_chunk_size

    device = "cuda" if args.gpu else "cpu"
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device here")
    chunks = (
        [int(c) for c in args.chunk_sizes.split(",")]
        if args.chunk_sizes
        else [default_chunk_size(args.vocab)]
    )
    common = {
        "mode": "head" if args.head else "step", "device": device, "tokens": args.tokens, "vocab": args.vocab,
        "hidden": args.hidden, "layers": args.layers, "steps": args.steps, "bf16": args.bf16,
        "autocast": args.autocast, "chunk_size": chunks[0], "threads": args.threads,
        "limit_gib": None if args.gpu else args.limit_gib or 0.8 * (_available_gib() or 0) or None,
    }  # fmt: skip
    variants = [] if args.skip_unchunked else [("unchunked", chunks[0])]
    if args.head:
        variants += [(v, c) for c in chunks for v in ("fused", "checkpoint")]
    else:
        variants += [("chunked", c) for c in chunks]
        if args.gpu and _liger_available():
            variants.append(("liger", chunks[0]))
    by_name = {f"{variant} {chunk}": (variant, chunk) for variant, chunk in variants}

    def run(name: str, _repeat: int) -> dict:
        variant, chunk = by_name[name]
        return run_child({**common, "variant": variant, "chunk_size": chunk})

    runs = interleaved(list(by_name), args.repeats, run, json.dumps)
    rows = [medians(done) | {"runs": done} for done in runs.values()]
    what = "head alone (forward + backward)" if args.head else "training step (forward, backward, AdamW)"
    layers = "" if args.head else f", {args.layers} layers"
    print(
        f"\n### {what}: vocab {args.vocab}, hidden {args.hidden}{layers}, one row of "
        f"{args.tokens} tokens{', bf16 weights' if args.bf16 else ''}{', bf16 autocast' if args.autocast else ''}\n"
    )
    print(table(rows, gpu=args.gpu))
    if not args.head:
        print(planner_lines(common, rows))
    threads = f", {args.threads} thread(s) per run" if args.threads and not args.gpu else ""
    print(f"\nMedians of {args.repeats} interleaved run(s) per variant. Machine: {machine(device)}{threads}.")


def planner_lines(cfg: dict, rows: list[dict]) -> str:
    """`finetune plan`'s logits term for this model and row, full and chunked, beside the measured
    difference of the two peaks (what chunking saves is the logits term, the rest being equal)."""
    import torch

    from finetune.plan import activation_bytes, inventory_of

    with torch.device("meta"):
        inv = inventory_of(_model({**cfg, "bf16": False}, "meta"))
    r, c = (2, 2) if cfg["bf16"] else (4, 2) if cfg["autocast"] else (4, 4)
    terms = {}
    for chunk in (0, cfg["chunk_size"]):
        acts = activation_bytes(
            inv, micro_batch_size=1, seq_len=cfg["tokens"], attn_implementation="sdpa", residual_bytes=r,
            compute_bytes=c, autocast=cfg["autocast"], loss_chunk=chunk,
        )  # fmt: skip
        terms[chunk] = acts.logits_and_loss / 2**20
    by_variant = {row["variant"]: row for row in rows}
    lines = [
        f"\nPlanner (`finetune plan`'s logits + loss term): {terms[0]:,.0f} MiB with full logits, "
        f"{terms[cfg['chunk_size']]:,.0f} MiB chunked ({cfg['chunk_size']} tokens); predicted saving "
        f"{terms[0] - terms[cfg['chunk_size']]:,.0f} MiB."
    ]
    if "unchunked" in by_variant and "chunked" in by_variant:
        measured = by_variant["unchunked"]["delta_mib"] - by_variant["chunked"]["delta_mib"]
        lines.append(f"Measured saving (difference of the peaks above baseline): {measured:,.0f} MiB.")
    return "\n".join(lines)


def _available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def _limit_address_space(limit_gib: float | None) -> None:
    """On a shared machine a variant that outgrows the memory left should fail itself (an allocation
    error) rather than wake the OOM killer. Address space runs ~0.5 GiB above RSS for torch on CPU;
    CUDA maps far more, so GPU runs are not limited."""
    if limit_gib:
        limit = int(limit_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _liger_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


if __name__ == "__main__":
    main()
