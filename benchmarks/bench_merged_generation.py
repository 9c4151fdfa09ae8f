"""Rollout generation with LoRA merged for the call (grpo.merged_generation, the default) against the
adapters computed at every token, through finetune's transformers backend, on CPU.

What it measures: the seconds of one sampled generate call (`TransformersBackend.generate`, the call an
online step's rollout makes) of --prompts prompts x --completions completions, every completion forced
to --new-tokens tokens (min_new_tokens: the two modes decode the same number of tokens whatever they
sample), on a SmolLM2-135M-shaped Llama (random init: the shape sets the speed, no download) with PEFT
LoRA r16 on every linear layer and B drawn at random (a trained adapter; B = 0 would be the same
arithmetic). The modes alternate (merged, unmerged, unmerged, merged, ...) for --repeats rounds in one
process with --threads threads; the table gives each mode's median and every run, and checks that the
weights after the merged calls are the ones before, bit for bit.

    python benchmarks/bench_merged_generation.py                    # what RESULTS.md reports
    python benchmarks/bench_merged_generation.py --layers 2 --repeats 1 --new-tokens 8   # smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--completions", type=int, default=8, help="per prompt (grpo.num_generations)")
    parser.add_argument("--prompt-tokens", type=int, default=80)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from benchmarks._common import machine
    from finetune.generation.protocol import SamplingParams
    from finetune.generation.transformers_backend import TransformersBackend, generate_batch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(  # SmolLM2-135M's shape
        hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
    )  # fmt: skip
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)

    class Tokenizer:  # what the backend asks of one: pad 0, no stop token (every completion runs to the end)
        pad_token_id, eos_token_id, all_special_tokens = 0, None, []

        def convert_tokens_to_ids(self, token):
            return None

    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(1, 49152, (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.prompts)
    ]
    seeds = [[100 * k + j for j in range(args.completions)] for k in range(args.prompts)]
    params = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=1.0, num_return_sequences=args.completions
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    backends = {
        "merged": TransformersBackend(model, Tokenizer(), merge_adapters=True),
        "unmerged": TransformersBackend(model, Tokenizer(), merge_adapters=False),
    }
    # every completion decodes --new-tokens tokens in both modes
    import finetune.generation.transformers_backend as tb

    def forced(model_, batch, kwargs, **rest):
        return generate_batch(model_, batch, {**kwargs, "min_new_tokens": args.new_tokens}, **rest)

    tb.generate_batch = forced
    times: dict[str, list[float]] = {name: [] for name in backends}
    for mode in backends.values():  # warm-up
        mode.generate(prompts, SamplingParams(max_new_tokens=2, temperature=1.0, num_return_sequences=1),
                      seeds=[[0]] * len(prompts))  # fmt: skip
    for repeat in range(args.repeats):
        order = ["merged", "unmerged"] if repeat % 2 == 0 else ["unmerged", "merged"]
        for name in order:
            start = time.perf_counter()
            out = backends[name].generate(prompts, params, seeds=seeds, batch_size=args.prompts)
            times[name].append(time.perf_counter() - start)
            assert all(len(c.ids) == args.new_tokens for row in out for c in row)
            print(f"{name} run {repeat + 1}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    exact = all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    sequences = args.prompts * args.completions
    print(
        f"\nSmolLM2-135M shape ({args.layers} layers, random init), fp32, LoRA r{args.rank} on every linear layer; "
        f"{args.prompts} prompts x {args.completions} completions of {args.new_tokens} tokens after "
        f"{args.prompt_tokens}-token prompts, sampled; {args.threads} thread(s); {machine(cpu=True)}\n"
    )
    print("| generation | s per call (median) | every run | tokens/s |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {median:.2f} | {runs} | {sequences * args.new_tokens / median:.0f} |")
    ratio = statistics.median(times["unmerged"]) / statistics.median(times["merged"])
    print(
        f"\nmerged is {ratio:.2f}x the speed of unmerged; weights after the merged calls unchanged: {exact}"
    )
    print(f"command: python benchmarks/bench_merged_generation.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
