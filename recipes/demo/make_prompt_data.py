#!/usr/bin/env python
"""Generate the prompts of the tiny GRPO demo (recipes/demo/tiny_grpo_cpu.yaml).

``data/prompts.jsonl``: ``{"question": "What is 12 + 7?", "answer": "#### 19"}`` rows of templated
addition and subtraction questions (synthetic, produced here; byte-identical for the same --seed).
The question is the prompt; the answer column feeds the exact_match reward.

    python recipes/demo/make_prompt_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows(num_rows: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_rows):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        if rng.random() < 0.5:
            out.append({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"})
        else:
            a, b = max(a, b), min(a, b)
            out.append({"question": f"What is {a} - {b}?", "answer": f"#### {a - b}"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-rows", type=int, default=256)
    parser.add_argument("--out", type=Path, default=HERE / "data" / "prompts.jsonl")
    args = parser.parse_args(argv)
    lines = [json.dumps(row) for row in rows(args.num_rows, args.seed)]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {args.out}")


if __name__ == "__main__":
    main()
