#!/usr/bin/env python
"""A frozen vision tower under gradient checkpointing, with and without its input-require-grads hook
(finetune.model.vlm.release_frozen_towers): the CPU allocator's peak of a later micro step's forward and
backward (tests/memory.py) and the time of a forward + backward, on the demo VLM
(recipes/demo/tiny_vlm_cpu.yaml's inline Idefics3 config, its tower frozen, projector trained),
with the demo's 1-layer tower and with a larger one (--tower-layers, --image-size, --intermediate).

    python benchmarks/bench_vlm_tower_release.py --rows 16 --repeats 7

One CPU thread; the two variants interleaved, medians reported (benchmarks/_common.py says why).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: E402

from finetune.losses.causal_lm import forward  # noqa: E402
from finetune.model import vlm  # noqa: E402
from tests.memory import peak_allocated_bytes  # noqa: E402

SEQ = 64


def build(args, release: bool) -> torch.nn.Module:
    """The demo VLM as training sets it up: checkpointing, tower frozen, then (or not) the release."""
    config = dict(
        yaml.safe_load((REPO / "recipes/demo/tiny_vlm_cpu.yaml").read_text())["model"]["config_path"]
    )
    vision = {"num_hidden_layers": args.tower_layers, "image_size": args.image_size}
    config["vision_config"] = {**config["vision_config"], **vision}
    if args.intermediate:
        config["vision_config"]["intermediate_size"] = args.intermediate
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config), attn_implementation="sdpa"
    )
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    vlm.freeze(net, train_vision_tower=False, train_projector=True)
    if release:
        vlm.release_frozen_towers(net)
    return net.train()


def batch(args, net) -> dict:
    torch.manual_seed(0)
    tokens = (args.image_size // 8) ** 2 // net.config.scale_factor**2
    ids = torch.randint(10, 700, (args.rows, SEQ))
    ids[:, 5 : 5 + tokens] = net.config.image_token_id
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "pixel_values": torch.randn(args.rows, 1, 3, args.image_size, args.image_size),
        "pixel_attention_mask": torch.ones(args.rows, 1, args.image_size, args.image_size, dtype=torch.bool),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tower-layers", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nets = {name: build(args, name == "released") for name in ("hooked", "released")}
    data = batch(args, nets["hooked"])
    num_items = (data["labels"][:, 1:] != -100).sum()

    def step(net):
        forward(net, data, num_items=num_items).loss.backward()

    peaks, times = {}, {name: [] for name in nets}
    for name, net in nets.items():
        step(net)  # the weights' gradients exist, as in a later micro step
        peaks[name] = peak_allocated_bytes(lambda net=net: step(net))
    for _ in range(args.repeats):
        for name, net in nets.items():
            start = time.perf_counter()
            step(net)
            times[name].append(time.perf_counter() - start)
    for name in nets:
        print(
            f"{name:9s} peak {peaks[name] / 1e6:8.3f} MB   forward+backward {statistics.median(times[name]) * 1e3:7.1f} ms"
        )
    ratio = peaks["released"] / peaks["hooked"]
    speed = statistics.median(times["hooked"]) / statistics.median(times["released"])
    print(f"released/hooked peak {ratio:.3f}, speed-up {speed:.2f}x")


if __name__ == "__main__":
    main()
