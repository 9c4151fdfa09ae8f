#!/usr/bin/env python
"""Build GSM8K preference pairs for recipes/smollm2/dpo_gsm8k_lora.yaml.

Each GSM8K train row (``question``, ``answer`` ending in ``#### N``) becomes a pair:

* ``chosen``: the reference solution as it is;
* ``rejected``: the same solution with a wrong final answer: N is replaced by another number M
  wherever it stands in the last line of the reasoning and after ``####``, consistently (so the last
  computation no longer adds up, e.g. ``<<48/2=24>>24`` becomes ``<<48/2=25>>25``).

Rows whose last reasoning line does not contain N are skipped (counted). Writes JSON lines
``{"question", "chosen", "rejected"}`` (the recipe maps ``field_prompt: question``); the same seed
gives the same file. GSM8K comes from ../shared/data (MIT licence); the output is not shipped.

    python recipes/smollm2/make_gsm8k_preferences.py            # -> outputs/gsm8k-preferences/train.jsonl
    python recipes/smollm2/make_gsm8k_preferences.py --num-rows 2000 --source path/to/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("FINETUNE_SHARED_DATA") or REPO.parent / "shared" / "data")
FINAL = re.compile(r"\n#### (-?[\d,]+(?:\.\d+)?)\s*$")


def wrong_final_answer(answer: str, rng: random.Random) -> str | None:
    """The solution with its final answer N changed to another number M in its last reasoning line
    and after ####, or None when that line does not show N.

    >>> wrong_final_answer("She has 3 + 4 = <<3+4=7>>7 apples.\\n#### 7", random.Random(1))
    'She has 3 + 4 = <<3+4=6>>6 apples.\\n#### 6'
    """
    match = FINAL.search(answer)
    if match is None:
        return None
    text = match.group(1)
    value = int(text.replace(",", "")) if re.fullmatch(r"-?[\d,]+", text) else None
    if value is None:
        return None
    other = value + rng.choice([-10, -2, -1, 1, 1, 2, 3, 10])
    other = other if other >= 0 and other != value else value + 1
    body = answer[: match.start()]
    head, _, last = body.rpartition("\n")
    # N as a whole number (not part of 17 or 1.5) in the last line; GSM8K writes 1,000 or 1000.
    pattern = re.compile(rf"(?<![\d.,]){re.escape(text)}(?![\d]|\.\d|,\d)")
    if not pattern.search(last):
        return None
    last = pattern.sub(str(other), last)
    return f"{head}\n{last}\n#### {other}" if head else f"{last}\n#### {other}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", default=str(SHARED / "gsm8k" / "train.jsonl"))
    parser.add_argument("--out", default=str(REPO / "outputs" / "gsm8k-preferences" / "train.jsonl"))
    parser.add_argument("--num-rows", type=int, default=None, help="pairs to write (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source = Path(args.source)
    if not source.is_file():
        raise SystemExit(
            f"{source} not found: pass --source or set FINETUNE_SHARED_DATA to the shared data folder"
        )
    rng = random.Random(args.seed)
    pairs, skipped = [], 0
    for line in source.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        rejected = wrong_final_answer(row["answer"], rng)
        if rejected is None:
            skipped += 1
            continue
        pairs.append({"question": row["question"], "chosen": row["answer"], "rejected": rejected})
        if args.num_rows and len(pairs) == args.num_rows:
            break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    print(
        f"wrote {len(pairs)} pairs to {out} ({skipped} rows skipped: the last line does not show the answer)"
    )


if __name__ == "__main__":
    main()
