"""Which accelerate config for which model size: `finetune plan` over Llama-3 sizes, engines and modes.

    python benchmarks/plan_table.py [--num-gpus 8] [--gpu-memory 80GiB] [--seq-len 4096]
    python benchmarks/plan_table.py --vs-deepspeed     # model states next to DeepSpeed's estimators

Prints a Markdown table of predicted GiB per GPU (and host GiB per GPU where states are offloaded)
for full fine-tuning, LoRA and QLoRA of Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B (configs given
inline: nothing is downloaded, weights are never loaded). Micro batch 1, the given sequence length,
gradient checkpointing on, bf16. These are predictions; see benchmarks/RESULTS.md for what was
measured.
"""

from __future__ import annotations

import argparse
import json

from finetune.plan import make_plan
from finetune.recipe import load_recipe

BASE_RECIPE = "recipes/llama3/llama3_8b_full_fsdp2.yaml"
LLAMA = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
MODELS = {
    "Llama-3.2-1B": {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "tie_word_embeddings": True},
    "Llama-3.1-8B": {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "tie_word_embeddings": False},
    "Llama-3.1-70B": {**LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "tie_word_embeddings": False},
}  # fmt: skip
MODES = {
    "full": [],
    "LoRA r16": ["--lora.enable_lora", "true"],
    "QLoRA r16": ["--lora.enable_lora", "true", "--lora.enable_qlora", "true"],
}
ENGINES = ["multi_gpu", "zero2", "zero3", "fsdp2", "zero3_offload"]


STATE_PARTS = ("weights", "gradients", "optimizer states")


def vs_deepspeed(num_gpus: int) -> None:
    """Model-state bytes (weights + gradients + optimizer) for full fine-tuning with bf16 Adam: the
    planner, the ZeRO paper's formula and DeepSpeed's own estimators
    (estimate_zero2/3_model_states_mem_needs), per GPU and host, in GiB."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    paper = {"zero2": lambda p, n: 2 * p + 14 * p / n, "zero3": lambda p, n: 16 * p / n}
    print(f"Model states per GPU (GiB) for a full fine-tune, bf16 + AdamW, {num_gpus} GPUs on 1 node\n")
    print(
        "| model | engine | planner GPU | planner host | ZeRO paper GPU | DeepSpeed estimator GPU | DeepSpeed estimator host |"
    )
    print("|---|---|---|---|---|---|---|")
    for model_name, config in MODELS.items():
        recipe = load_recipe(BASE_RECIPE, ["--model.config_path", json.dumps(config)])
        for engine in ("zero2", "zero2_offload", "zero3", "zero3_offload"):
            plan = make_plan(recipe, accelerate_config=engine, num_gpus=num_gpus, gpu_memory="80GiB")
            parts = [p for p in plan.estimate.parts if p.name in STATE_PARTS]
            gpu = sum(p.gpu_bytes for p in parts) / 2**30
            host = sum(p.host_bytes for p in parts) / 2**30
            params = plan.inventory.total
            offload = engine.endswith("offload")
            if engine.startswith("zero2"):
                ds_host, ds_gpu = estimate_zero2_model_states_mem_needs(
                    params, num_gpus_per_node=num_gpus, cpu_offload=offload, additional_buffer_factor=1.0
                )
            else:
                inv = plan.inventory  # DeepSpeed's "largest layer": a decoder layer or the embedding
                largest = max(inv.layer_params, inv.vocab_size * inv.hidden_size)
                ds_host, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
                    params, largest, num_gpus_per_node=num_gpus, cpu_offload=offload,
                    cpu_offload_params=offload, additional_buffer_factor=1.0,
                )  # fmt: skip
            formula = "-" if offload else f"{paper[engine[:5]](params, num_gpus) / 2**30:.1f}"
            print(
                f"| {model_name} | {engine} | {gpu:.1f} | {host:.1f} | {formula} | {ds_gpu / 2**30:.1f} | "
                f"{ds_host / num_gpus / 2**30:.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-gpus", type=int, default=8)
    parser.add_argument("--gpu-memory", default="80GiB")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--vs-deepspeed", action="store_true", help="model states next to DeepSpeed's estimators"
    )
    args = parser.parse_args()
    if args.vs_deepspeed:
        vs_deepspeed(args.num_gpus)
        return
    print(
        f"GiB per GPU on {args.num_gpus} GPUs of {args.gpu_memory}, micro batch 1 x {args.seq_len} tokens, "
    )
    print("gradient checkpointing, bf16 (host GiB per GPU in brackets when states are offloaded); * = fits\n")
    print("| model | mode | " + " | ".join(ENGINES) + " |")
    print("|---|---|" + "---|" * len(ENGINES))
    for model_name, config in MODELS.items():
        for mode, extra in MODES.items():
            cells = []
            for engine in ENGINES:
                overrides = [
                    "--model.config_path",
                    json.dumps(config),
                    "--train.micro_batch_size",
                    "1",
                    "--train.gradient_checkpointing",
                    "true",
                    "--data.sequence_len",
                    str(args.seq_len),
                    "--data.sample_packing_sequence_len",
                    str(args.seq_len),
                    *extra,
                ]
                recipe = load_recipe(BASE_RECIPE, overrides)
                plan = make_plan(
                    recipe, accelerate_config=engine, num_gpus=args.num_gpus, gpu_memory=args.gpu_memory
                )
                gpu = plan.estimate.total_gpu / 2**30
                host = plan.estimate.total_host / 2**30
                cell = f"{gpu:.1f}" + (f" [{host:.0f}]" if host >= 0.05 else "")
                cells.append(cell + ("*" if plan.fits else ""))
            print(f"| {model_name} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
