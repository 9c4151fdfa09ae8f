#!/usr/bin/env python
"""Generate the embedded demo's data sets and tokenizer.

Everything written here is synthetic and produced by this script (no third-party data, no downloads):

* ``data/arithmetic.jsonl``: Alpaca-style rows (``instruction``, ``input``, ``output``) of templated
  arithmetic, comparison, counting, sorting and word-list reversal questions with short answers.
* ``data/chat.jsonl``: OpenAI-style ``{"messages": [...]}`` conversations (optional system prompt,
  1-3 user/assistant turns; follow-ups build on the previous numeric answer).
* ``data/sharegpt.jsonl``: ShareGPT-style ``{"conversations": [{"from", "value"}]}`` conversations.
* ``tokenizer/``: a small byte-level BPE tokenizer trained on that text, wrapped in
  ``transformers.PreTrainedTokenizerFast`` with a ChatML chat template.

The output is byte-identical for the same ``--seed`` and ``--num-rows``.

Regenerate the shipped files with::

    python recipes/demo/make_demo_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# Tokenizer constants
# ---------------------------------------------------------------------------------------------
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order matters: these get ids 0..5.
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IM_START, IM_END]
DEFAULT_VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 2048

# ChatML. No BOS in the template: the tokenizer's post-processor prepends <s> when the rendered
# text is tokenized with add_special_tokens=True. The {% generation %} markers only matter for
# `return_assistant_tokens_mask=True` (assistant-only loss); plain rendering ignores them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ---------------------------------------------------------------------------------------------
# Task generators. Each returns (instruction, input, output, numeric_value_or_None).
# ---------------------------------------------------------------------------------------------
WORDS = [
    "apple", "pear", "plum", "cat", "dog", "bird", "fish", "red", "blue", "green", "sun", "moon",
    "star", "tree", "rock", "book", "cup", "hat", "ship", "car", "bell", "key", "lamp", "door",
]  # fmt: skip

Task = tuple[str, str, str, int | None]


def _pick(rng: random.Random, templates: list[str], **kw: object) -> str:
    return rng.choice(templates).format(**kw)


def _words(rng: random.Random, lo: int = 2, hi: int = 5) -> list[str]:
    return rng.sample(WORDS, rng.randint(lo, hi))


def task_add(rng: random.Random) -> Task:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    out = f"{a} + {b} = {a + b}."
    if rng.random() < 0.2:
        instr = rng.choice(["Add the two numbers.", "Find the sum of the numbers below."])
        return instr, f"{a} and {b}", out, a + b
    q = _pick(
        rng,
        [
            "What is {a} plus {b}?",
            "Add {a} and {b}.",
            "Compute {a} + {b}.",
            "What is the sum of {a} and {b}?",
            "What do you get when you add {a} to {b}?",
        ],
        a=a,
        b=b,
    )
    return q, "", out, a + b


def task_sub(rng: random.Random) -> Task:
    a = rng.randint(0, 99)
    b = rng.randint(0, a)
    out = f"{a} - {b} = {a - b}."
    if rng.random() < 0.2:
        return "Subtract the second number from the first.", f"{a} and {b}", out, a - b
    q = _pick(
        rng,
        [
            "What is {a} minus {b}?",
            "Subtract {b} from {a}.",
            "Compute {a} - {b}.",
            "What is {a} take away {b}?",
        ],
        a=a,
        b=b,
    )
    return q, "", out, a - b


def task_mul(rng: random.Random) -> Task:
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    out = f"{a} * {b} = {a * b}."
    q = _pick(
        rng,
        [
            "What is {a} times {b}?",
            "Multiply {a} by {b}.",
            "Compute {a} * {b}.",
            "What is {a} multiplied by {b}?",
        ],
        a=a,
        b=b,
    )
    return q, "", out, a * b


def task_compare(rng: random.Random) -> Task:
    a, b = rng.sample(range(100), 2)
    kind = rng.randrange(3)
    if kind == 0:
        if rng.random() < 0.2:
            return "Which number in the input is larger?", f"{a}, {b}", f"{max(a, b)} is larger.", None
        q = _pick(rng, ["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?"], a=a, b=b)
        return q, "", f"{max(a, b)} is larger.", None
    if kind == 1:
        q = _pick(rng, ["Which is smaller, {a} or {b}?", "Which number is less: {a} or {b}?"], a=a, b=b)
        return q, "", f"{min(a, b)} is smaller.", None
    q = f"Is {a} greater than {b}?"
    out = f"Yes, {a} is greater than {b}." if a > b else f"No, {a} is not greater than {b}."
    return q, "", out, None


def task_count(rng: random.Random) -> Task:
    items = _words(rng, 1, 7)
    n = len(items)
    out = f"There {'is 1 word' if n == 1 else f'are {n} words'}."
    listed = ", ".join(items)
    if rng.random() < 0.3:
        instr = rng.choice(["Count the words in the input.", "How many words are in the input?"])
        return instr, listed, out, n
    q = _pick(
        rng,
        [
            "How many words are in this list: {l}?",
            "Count the words: {l}.",
            "How many items are there in: {l}?",
        ],
        l=listed,
    )
    return q, "", out, n


def task_reverse(rng: random.Random) -> Task:
    items = _words(rng, 2, 5)
    out = ", ".join(reversed(items)) + "."
    listed = ", ".join(items)
    if rng.random() < 0.3:
        return "Reverse the order of the words in the input.", listed, out, None
    q = _pick(
        rng,
        [
            "Reverse the list: {l}.",
            "Write these words in reverse order: {l}.",
            "Say this list backwards: {l}.",
        ],
        l=listed,
    )
    return q, "", out, None


def task_sort(rng: random.Random) -> Task:
    nums = rng.sample(range(100), rng.randint(3, 5))
    listed = ", ".join(map(str, nums))
    if rng.random() < 0.5:
        q = f"Sort these numbers from smallest to largest: {listed}."
        out = ", ".join(map(str, sorted(nums))) + "."
    else:
        q = f"Sort these numbers from largest to smallest: {listed}."
        out = ", ".join(map(str, sorted(nums, reverse=True))) + "."
    return q, "", out, None


def task_next(rng: random.Random) -> Task:
    a = rng.randint(1, 98)
    if rng.random() < 0.5:
        q = _pick(rng, ["What number comes after {a}?", "What is the next number after {a}?"], a=a)
        return q, "", f"{a + 1} comes after {a}.", a + 1
    q = _pick(rng, ["What number comes before {a}?", "What is the number just before {a}?"], a=a)
    return q, "", f"{a - 1} comes before {a}.", a - 1


TASKS: list[tuple[Callable[[random.Random], Task], int]] = [
    (task_add, 5),
    (task_sub, 4),
    (task_mul, 3),
    (task_compare, 3),
    (task_count, 2),
    (task_reverse, 2),
    (task_sort, 1),
    (task_next, 2),
]


def random_task(rng: random.Random) -> Task:
    fns, weights = zip(*TASKS, strict=True)
    return rng.choices(fns, weights=weights, k=1)[0](rng)


# ---------------------------------------------------------------------------------------------
# Data sets
# ---------------------------------------------------------------------------------------------
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise math tutor. Answer in one short sentence.",
    "You answer number and word questions briefly.",
    "You are a friendly assistant for simple puzzles.",
]
GREETINGS = [
    ("Hi!", "Hello! Ask me a number or word question."),
    ("Hello, can you help me with some math?", "Yes. What would you like to compute?"),
    ("Thanks!", "You are welcome."),
]


def _follow_up(rng: random.Random, value: int) -> tuple[str, str, int]:
    k = rng.randint(1, 20)
    kind = rng.randrange(3)
    if kind == 0:
        q = rng.choice(["Now add {k} to that.", "And plus {k}?", "Add {k} to the result."]).format(k=k)
        return q, f"{value} + {k} = {value + k}.", value + k
    if kind == 1 and value >= k:
        q = rng.choice(["Now subtract {k}.", "And minus {k}?", "Take away {k} from that."]).format(k=k)
        return q, f"{value} - {k} = {value - k}.", value - k
    q = rng.choice(["Double it.", "What is twice that?", "Multiply that by 2."])
    return q, f"{value} * 2 = {value * 2}.", value * 2


def _question_text(instr: str, inp: str) -> str:
    return f"{instr}\n{inp}" if inp else instr


def make_arithmetic_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    rows = []
    for _ in range(n):
        instr, inp, out, _value = random_task(rng)
        rows.append({"instruction": instr, "input": inp, "output": out})
    return rows


def make_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One conversation as OpenAI-style messages (system optional, 1-3 user/assistant turns)."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns = rng.choice([1, 2, 2, 3, 3])
    if rng.random() < 0.15:
        hi, reply = GREETINGS[rng.randrange(2)]
        messages += [{"role": "user", "content": hi}, {"role": "assistant", "content": reply}]
        turns = max(1, turns - 1)
    value: int | None = None
    for _ in range(turns):
        if value is not None and rng.random() < 0.7:
            q, a, value = _follow_up(rng, value)
        else:
            instr, inp, a, value = random_task(rng)
            q = _question_text(instr, inp)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if rng.random() < 0.1:
        messages += [
            {"role": "user", "content": GREETINGS[2][0]},
            {"role": "assistant", "content": GREETINGS[2][1]},
        ]
    return messages


def make_chat_rows(rng: random.Random, n: int) -> list[dict[str, list[dict[str, str]]]]:
    return [{"messages": make_conversation(rng)} for _ in range(n)]


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def make_sharegpt_rows(rng: random.Random, n: int) -> list[dict[str, list[dict[str, str]]]]:
    return [
        {
            "conversations": [
                {"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in make_conversation(rng)
            ]
        }
        for _ in range(n)
    ]


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def render_chatml(messages: list[dict[str, str]]) -> str:
    """Same text as CHAT_TEMPLATE renders (used only to build the tokenizer's training corpus)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def corpus_texts(arith: list[dict], chat: list[dict], sharegpt: list[dict]) -> Iterator[str]:
    # The rows are rendered with the project's own Alpaca template (the demo recipe uses
    # `type: alpaca`), so the tokenizer learns the template's words instead of spelling them out.
    from finetune.data.formats.alpaca import alpaca_prompt

    for row in arith:
        yield alpaca_prompt(row["instruction"], row["input"]) + row["output"]
    for row in chat:
        yield render_chatml(row["messages"])
    for row in sharegpt:
        inv = {v: k for k, v in SHAREGPT_ROLES.items()}
        yield render_chatml([{"role": inv[t["from"]], "content": t["value"]} for t in row["conversations"]])


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE (digits split one by one) and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-style: <s> before every sequence, nothing appended.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        chat_template=CHAT_TEMPLATE,
    )


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def generate(
    out_dir: Path, num_rows: int = 3000, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> dict:
    """Write data/*.jsonl and tokenizer/ under ``out_dir``; return a small summary dict."""
    out_dir = Path(out_dir)
    # Independent streams so changing one data set's size doesn't reshuffle the others.
    arith = make_arithmetic_rows(random.Random(f"{seed}:arithmetic"), num_rows)
    chat = make_chat_rows(random.Random(f"{seed}:chat"), max(1, num_rows // 10))
    sharegpt = make_sharegpt_rows(random.Random(f"{seed}:sharegpt"), max(1, num_rows // 30))
    data_dir = out_dir / "data"
    write_jsonl(data_dir / "arithmetic.jsonl", arith)
    write_jsonl(data_dir / "chat.jsonl", chat)
    write_jsonl(data_dir / "sharegpt.jsonl", sharegpt)

    tokenizer = train_tokenizer(corpus_texts(arith, chat, sharegpt), vocab_size=vocab_size)
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    return {
        "arithmetic": len(arith),
        "chat": len(chat),
        "sharegpt": len(sharegpt),
        "vocab_size": len(tokenizer),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out-dir", type=Path, default=HERE, help="where data/ and tokenizer/ go (default: %(default)s)"
    )
    parser.add_argument(
        "--num-rows", type=int, default=3000, help="arithmetic rows; chat gets 1/10, sharegpt 1/30"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocab size upper bound"
    )
    args = parser.parse_args(argv)
    if args.num_rows < 1:
        parser.error("--num-rows must be >= 1")
    summary = generate(args.out_dir, num_rows=args.num_rows, seed=args.seed, vocab_size=args.vocab_size)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
