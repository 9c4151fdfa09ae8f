"""Word problems for the real-model demo: short arithmetic stories answered step by step, GSM8K style.

Each answer shows its arithmetic and ends with `#### <number>`, the line `finetune eval`'s
exact_match reads. The training and test files are drawn with different seeds and share no question,
so the demo's before/after table is measured on prompts the model did not train on.

The calculator demo's files (`word_problems_calc_*`) hold the same questions with answers annotated the
way GSM8K writes them, `<<expression=result>>` before each result: a model trained on them writes
`<<24-17=` and the calculator tool (recipes/smollm2/calc.py, grpo.tools / a generation set's tools)
inserts `7>>`, so the arithmetic is the tool's and the model copies the result.

    python recipes/smollm2/make_word_problems.py      # writes recipes/smollm2/data/word_problems{,_calc}_{train,test}.jsonl

>>> problem(random.Random(0))["answer"].splitlines()[-1]
'#### 52'
>>> problem(random.Random(0), annotated=True)["answer"]
'Maya has <<18+34=52>>52 cards.\\n#### 52'
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Kira", "Leo", "Maya",
         "Noah", "Olive", "Paul", "Quinn", "Rosa", "Sam", "Tara"]  # fmt: skip
ITEMS = ["apples", "stickers", "marbles", "books", "coins", "pencils", "cards", "shells", "cookies", "stamps",
         "balloons", "crayons"]  # fmt: skip


def step(a: int, op: str, b: int, result: int, *, annotated: bool) -> str:
    """One step of arithmetic as an answer writes it: `a op b = result`, or annotated as GSM8K does,
    `<<a op b=result>>result` (no spaces inside the brackets).

    >>> step(24, "-", 17, 7, annotated=False), step(24, "-", 17, 7, annotated=True)
    ('24 - 17 = 7', '<<24-17=7>>7')
    """
    return f"<<{a}{op}{b}={result}>>{result}" if annotated else f"{a} {op} {b} = {result}"


def problem(rng: random.Random, *, annotated: bool = False) -> dict[str, str]:
    """One question and its worked answer (addition, subtraction, multiplication, or two steps); with
    `annotated`, each step carries its calculator annotation (the same draws: the same question)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        question = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        answer = f"{name} has {step(a, '+', b, a + b, annotated=annotated)} {item}.\n#### {a + b}"
    elif kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        question = f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?"
        answer = f"{name} has {step(a, '-', b, a - b, annotated=annotated)} {item} left.\n#### {a - b}"
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        question = (
            f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in all?"
        )
        answer = f"{name} has {step(a, '*', b, a * b, annotated=annotated)} {item}.\n#### {a * b}"
    else:
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        question = f"{name} has {a} {item}, buys {b} more, then gives {c} to a friend. How many {item} does {name} have now?"
        answer = (
            f"After buying, {name} has {step(a, '+', b, a + b, annotated=annotated)} {item}.\n"
            f"After giving, {name} has {step(a + b, '-', c, a + b - c, annotated=annotated)} {item}.\n"
            f"#### {a + b - c}"
        )
    return {"question": question, "answer": answer}


def generate(
    out_dir: Path, *, train_rows: int = 2000, test_rows: int = 100, annotated: bool = False
) -> dict[str, int]:
    """Write the training and test files (`word_problems_calc_*` with `annotated` answers: the same
    questions); a test question never appears in the training file."""
    train = [problem(rng, annotated=annotated) for rng in [random.Random("train")] for _ in range(train_rows)]
    seen = {row["question"] for row in train}
    rng, test = random.Random("test"), []
    while len(test) < test_rows:
        row = problem(rng, annotated=annotated)
        if row["question"] not in seen:
            seen.add(row["question"])
            test.append(row)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "word_problems_calc" if annotated else "word_problems"
    for name, rows in ((f"{stem}_train.jsonl", train), (f"{stem}_test.jsonl", test)):
        (out_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"train": len(train), "test": len(test)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=HERE / "data")
    args = parser.parse_args()
    print(json.dumps({"plain": generate(args.out_dir), "calc": generate(args.out_dir, annotated=True)}))


if __name__ == "__main__":
    main()
