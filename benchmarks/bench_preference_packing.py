"""Packed vs padded preference batches (CPU): time per pair of a policy forward + backward + DPO loss.

Pairs on GSM8K lengths (Llama-2 tokenizer): prompt = a question, chosen = its answer, rejected =
another question's answer, each completion ending with eos; sequences are 100-400 tokens. Without
../shared/data the lengths are drawn at random in the same range (the script says so).

Layouts, the same pairs and the same loss (finetune.losses.preference: token_logps ->
sequence_sums -> dpo_loss, reference log-probs fixed):

* padded (TRL's layout): a micro-batch of P pairs is 2P rows (all chosen, then all rejected),
  right-padded to the batch's longest row, with an attention mask;
* packed: chosen_i and rejected_i side by side, pairs bin-packed (multipack) into rows of C tokens,
  one row per micro-batch, position_ids restarting at 0, no attention mask (transformers builds the
  block-diagonal mask from the position_ids).

Model: Llama, hidden 256, 4 layers, 4 heads (2 KV), intermediate 688, vocab 32000, fp32, sdpa.
Configurations are interleaved (one pass of each, then again in reverse order, ...) so machine load
hits all of them, on --threads CPU threads (default 1: on shared cores two threads stall whenever one
core is taken; benchmarks/_common.py); the table gives the median pass and every pass.

    python benchmarks/bench_preference_packing.py [--pairs 32] [--repeats 5] [--threads 1]
    python benchmarks/bench_preference_packing.py --pairs 4 --repeats 2      # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# ../shared/data next to the checkout (a git worktree may sit one level deeper).
SHARED = next((p / "shared" / "data" for p in REPO.parents if (p / "shared" / "data").is_dir()), REPO.parent)
sys.path.insert(0, str(REPO))

from _common import every_run, interleaved  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from finetune.data.batching.collate import collate_rows  # noqa: E402
from finetune.data.batching.packing import pack_multipack  # noqa: E402
from finetune.losses import preference as pref  # noqa: E402
from finetune.losses.causal_lm import forward  # noqa: E402

MIN_LEN, MAX_LEN = 100, 400


def gsm8k_pairs(num_pairs: int, seed: int = 0) -> tuple[list[tuple[list[int], list[int], list[int]]], str]:
    """(prompt, chosen, rejected) token ids with 100-400-token sequences, and where they came from."""
    rng = random.Random(seed)
    data, tok_dir = SHARED / "gsm8k" / "train.jsonl", SHARED / "tokenizers" / "llama2-hf"
    if not (data.exists() and tok_dir.exists()):
        print(f"{SHARED} is absent: random lengths in [{MIN_LEN}, {MAX_LEN}]", file=sys.stderr)
        out = []
        for _ in range(num_pairs):
            prompt = [rng.randrange(3, 32000) for _ in range(rng.randint(40, 90))]
            chosen, rejected = (
                [rng.randrange(3, 32000) for _ in range(rng.randint(60, 300))] for _ in range(2)
            )
            out.append((prompt, chosen, rejected))
        return out, "random lengths"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rng.shuffle(rows)
    rows = rows[: 4 * num_pairs]
    prompts = [tok(r["question"] + "\n")["input_ids"] for r in rows]
    answers = [tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    out = []
    for i in range(len(rows)):
        rejected = answers[(i + 1) % len(rows)]
        lengths = (len(prompts[i]) + len(answers[i]), len(prompts[i]) + len(rejected))
        if all(MIN_LEN <= n <= MAX_LEN for n in lengths):
            out.append((prompts[i], answers[i], rejected))
    if len(out) < num_pairs:
        raise SystemExit(f"only {len(out)} GSM8K pairs within {MIN_LEN}-{MAX_LEN} tokens; ask for fewer")
    return out[:num_pairs], "GSM8K train, Llama-2 tokenizer"


def completion_row(prompt: list[int], completion: list[int]) -> dict:
    return {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}


def padded_batches(pairs, pairs_per_batch: int) -> list[dict]:
    batches = []
    for start in range(0, len(pairs), pairs_per_batch):
        group = pairs[start : start + pairs_per_batch]
        rows = [completion_row(p, c) for p, c, _ in group] + [completion_row(p, r) for p, _, r in group]
        batch = collate_rows(rows, pad_token_id=0, packed=False)
        batch["pair_ids"] = list(range(start, start + len(group)))
        batches.append(batch)
    return batches


def packed_batches(pairs, capacity: int) -> list[dict]:
    lengths = [2 * len(p) + len(c) + len(r) for p, c, r in pairs]
    batches = []
    for pair_ids in pack_multipack(lengths, capacity):
        seqs = [completion_row(pairs[i][0], pairs[i][k]) for i in pair_ids for k in (1, 2)]
        row = {
            "input_ids": [t for s in seqs for t in s["input_ids"]],
            "labels": [t for s in seqs for t in s["labels"]],
            "position_ids": [p for s in seqs for p in range(len(s["input_ids"]))],
        }
        batch = collate_rows([row], pad_token_id=0, packed=True)
        batch["pair_ids"] = pair_ids
        batches.append(batch)
    return batches


def pair_losses(model, batch: dict, packed: bool) -> torch.Tensor:
    """Per-pair DPO losses of one micro-batch (reference log-probs fixed at -1 per completion token)."""
    inputs = {k: v for k, v in batch.items() if k != "pair_ids"}
    logps = pref.token_logps(forward(model, inputs).logits, inputs["labels"])
    mask = inputs["labels"] != -100
    if packed:
        sums, counts = pref.sequence_sums(
            logps, mask, inputs["position_ids"], num_sequences=2 * len(batch["pair_ids"])
        )
        chosen, rejected, n_chosen, n_rejected = sums[0::2], sums[1::2], counts[0::2], counts[1::2]
    else:
        sums, counts = pref.sequence_sums(logps, mask)
        (chosen, rejected), (n_chosen, n_rejected) = sums.chunk(2), counts.chunk(2)
    return pref.dpo_loss(chosen, rejected, -n_chosen.float(), -n_rejected.float(), beta=0.1).losses


def run_pass(model, batches: list[dict], packed: bool, num_pairs: int) -> tuple[float, torch.Tensor]:
    """Forward + backward over every micro-batch; seconds, and the per-pair losses in pair order."""
    losses = torch.zeros(num_pairs)
    start = time.perf_counter()
    for batch in batches:
        pair_loss = pair_losses(model, batch, packed)
        (pair_loss.sum() / num_pairs).backward()  # the loop's normalisation: sum over pairs / pairs in window
        losses[batch["pair_ids"]] = pair_loss.detach()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, losses


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def layout_stats(batches: list[dict]) -> dict:
    """Micro-batch count and tokens run through the model (padding included)."""
    processed = sum(b["input_ids"].numel() for b in batches)
    return {"micro_batches": len(batches), "tokens_processed": processed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 = torch's choice")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs, source = gsm8k_pairs(args.pairs)
    real_tokens = sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)
    configs = {f"padded, {n} pair(s) per micro-batch": (padded_batches(pairs, n), False) for n in (1, 4, 8)}
    configs |= {f"packed, rows of {c}": (packed_batches(pairs, c), True) for c in (1024, 2048)}
    model = tiny_llama()
    run_pass(model, configs[next(iter(configs))][0][:1], False, args.pairs)  # warm-up

    def one_pass(name: str, _repeat: int) -> dict:
        seconds, loss = run_pass(model, configs[name][0], configs[name][1], args.pairs)
        return {"ms_per_pair": 1000 * seconds / args.pairs, "loss": loss}

    runs = interleaved(list(configs), args.repeats, one_pass, lambda r: "")
    times = {name: [r["ms_per_pair"] / 1000 * args.pairs for r in done] for name, done in runs.items()}
    losses = {name: done[-1]["loss"] for name, done in runs.items()}
    baseline = statistics.median(times[next(iter(configs))])
    reference_losses = losses[next(iter(configs))]
    print(
        f"{args.pairs} pairs ({source}), {real_tokens} real tokens, torch threads {torch.get_num_threads()}"
    )
    print(
        "| layout | micro-batches | tokens processed / real | ms per pair (median) | every pass (ms per pair) "
        "| speed vs 1 pair padded (medians) |"
    )
    print("|---|---|---|---|---|---|")
    for name, (batches, _) in configs.items():
        stats = layout_stats(batches)
        median = 1000 * statistics.median(times[name]) / args.pairs
        print(
            f"| {name} | {stats['micro_batches']} | {stats['tokens_processed'] / real_tokens:.2f} | {median:.0f} | "
            f"{every_run(runs[name], 'ms_per_pair', '.0f')} | {baseline / statistics.median(times[name]):.2f}x |"
        )
    drift = max(float((losses[n] - reference_losses).abs().max()) for n in configs)
    print(f"largest per-pair loss difference between layouts: {drift:.2e}")
    print(json.dumps({"times_s": times, "source": source, "pairs": args.pairs}))


if __name__ == "__main__":
    main()
