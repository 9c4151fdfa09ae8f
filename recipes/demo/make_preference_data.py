#!/usr/bin/env python
"""Generate the demo's preference data from its arithmetic rows (data/arithmetic.jsonl).

* ``data/preferences.jsonl``: ``{"prompt", "chosen", "rejected"}`` pairs: the prompt is the row's
  instruction (and input after a blank line), chosen its answer, rejected the same answer with its
  last number changed (so the arithmetic is wrong). Rows whose answer has no number are skipped.
* ``data/kto.jsonl``: ``{"prompt", "completion", "label"}``: the same rows, alternately the right
  answer (label true) and the wrong one (label false).

The output is byte-identical for the same ``--seed``. Regenerate the shipped files with::

    python recipes/demo/make_preference_data.py
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)", re.DOTALL)


def wrong_answer(answer: str, rng: random.Random) -> str | None:
    """`answer` with its last number replaced by a different one, or None when it has none.

    >>> wrong_answer("12 * 6 = 72.", random.Random(0)) != "12 * 6 = 72."
    True
    """
    match = LAST_NUMBER.search(answer)
    if match is None:
        return None
    value = int(match.group(1))
    other = value + rng.choice([-3, -2, -1, 1, 2, 3, 10])
    other = other if other >= 0 and other != value else value + 1
    return answer[: match.start()] + str(other) + answer[match.end() :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", default=str(HERE / "data" / "arithmetic.jsonl"))
    parser.add_argument("--out-dir", default=str(HERE / "data"))
    parser.add_argument("--num-rows", type=int, default=600, help="pairs to write (and kto examples)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    pairs = []
    for line in Path(args.source).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        rejected = wrong_answer(row["output"], rng)
        if rejected is None:
            continue
        prompt = f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]
        pairs.append({"prompt": prompt, "chosen": row["output"], "rejected": rejected})
        if len(pairs) == args.num_rows:
            break
    kto = [
        {"prompt": p["prompt"], "completion": p["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
        for i, p in enumerate(pairs)
    ]
    out = Path(args.out_dir)
    for name, rows in (("preferences.jsonl", pairs), ("kto.jsonl", kto)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {len(rows)} rows to {out / name}")


if __name__ == "__main__":
    main()
