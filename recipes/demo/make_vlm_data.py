#!/usr/bin/env python
"""Generate the tiny vision-language demo (recipes/demo/tiny_vlm_cpu.yaml): its processor and its data.

``vlm_processor/``: an Idefics3 (SmolVLM) processor built here, offline: the demo's BPE tokenizer with
the image tokens added, SmolVLM-Instruct's chat template, and a PIL image processor that resizes to
32x32 without tiling (so every image is 4 tokens for the demo model, see the recipe's vision config).

``data/vlm/{train,eval}.jsonl`` and ``data/vlm/images/*.png``: a coloured shape (circle, square or
triangle; 6 colours) on a white background, with a question about it; the answer depends only on the
pixels::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/00007.png"},
                                               {"type": "text", "text": "What colour is the shape?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]}

``data/vlm/pairs_{train,eval}.jsonl``: preference pairs on the same pictures for the DPO demo
(recipes/demo/tiny_vlm_dpo_cpu.yaml): "What colour is the shape?", chosen the right colour, rejected a
wrong one. The training pairs hold the image as a part of the prompt's message, the held-out pairs in
LLaVA style (an ``images`` column and an ``<image>`` placeholder), so the demo reads both shapes::

    {"prompt": [{"role": "user", "content": [{"type": "image", "image": "images/00007.png"},
                                             {"type": "text", "text": "What colour is the shape?"}]}],
     "chosen": [{"role": "assistant", "content": "blue"}], "rejected": [{"role": "assistant", "content": "red"}]}
    {"prompt": "<image>What colour is the shape?", "images": ["images/00500.png"], "chosen": "red", "rejected": "green"}

``data/vlm/kto_{train,eval}.jsonl``: kto examples on the same pictures for the KTO demo
(recipes/demo/tiny_vlm_kto_cpu.yaml): the colour question and one answer, desirable when it is the
picture's colour, undesirable when it is a wrong one (about half each); LLaVA style in training, image
parts held out (the reverse of the pairs, so the demo's files stay under their size limit)::

    {"prompt": "<image>What colour is the shape?", "images": ["images/00007.png"], "completion": "red", "label": false}

``data/vlm/prompts_{train,eval}.jsonl``: prompts for the GRPO demo (recipes/demo/tiny_vlm_grpo_cpu.yaml) on the
same pictures: the colour question alone, the picture's colour in a ``colour`` column that the demo's reward
reads (recipes/demo/rewards.py:colour_named); LLaVA style in training, image parts held out::

    {"prompt": "<image>What colour is the shape?", "images": ["images/00007.png"], "colour": "blue"}

``data/vlm/colours.jsonl``: a generation set (eval.generation_sets) of the first held-out pictures,
each asked "What colour is the shape?", with its colour expected::

    {"prompt": [{"role": "user", "content": [{"type": "image", "image": "images/00480.png"},
                                             {"type": "text", "text": "What colour is the shape?"}]}],
     "expected": "purple"}

Synthetic, produced here; byte-identical for the same --seed.

    python recipes/demo/make_vlm_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 210, 20),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}
IMAGE_SIZE = 32
NUM_COLOUR_PROMPTS = 16  # the generation set: few, so scoring it during training stays cheap
# SmolVLM-Instruct's chat template (HuggingFaceTB/SmolVLM-Instruct, chat_template.json; also in
# tests/unit/data/templates/HuggingFaceTB-SmolVLM-Instruct.jinja).
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == "
    "'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def draw(shape: str, colour: str, rng: random.Random):
    """One IMAGE_SIZE x IMAGE_SIZE image: the shape, in the colour, at a random place and size."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    size = rng.randint(14, 24)
    x, y = rng.randint(1, IMAGE_SIZE - size - 1), rng.randint(1, IMAGE_SIZE - size - 1)
    box = (x, y, x + size, y + size)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=fill)
    return image


def pictures(count: int, seed: int):
    """(image number, shape, colour, image, question asked) of the demo's pictures, in order (the
    same sequence for the SFT rows and the preference pairs)."""
    rng = random.Random(seed)
    for k in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        image = draw(shape, colour, rng)
        yield k, shape, colour, image, rng.choice(list(QUESTIONS))


def write_data(out: Path, *, num_train: int, num_eval: int, seed: int) -> None:
    """The two splits and their images under `out` (relative image paths, as users write them)."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    made = pictures(num_train + num_eval, seed)
    held_out = []  # (image, colour) of the eval pictures: the generation set asks their colour
    for split, count in (("train", num_train), ("eval", num_eval)):
        lines = []
        for k, shape, colour, image, asked in (next(made) for _ in range(count)):
            name = f"images/{k:05d}.png"
            image.save(out / name, optimize=True)
            answer = colour if asked == "colour" else shape
            user = [{"type": "image", "image": name}, {"type": "text", "text": QUESTIONS[asked]}]
            messages = [
                {"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
            lines.append(json.dumps({"messages": messages}))
            if split == "eval":
                held_out.append((name, colour))
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_colour_prompts(out / "colours.jsonl", held_out[:NUM_COLOUR_PROMPTS])


def write_colour_prompts(path: Path, held_out: list[tuple[str, str]]) -> None:
    """The generation set: each held-out picture asked its colour, the colour expected (metric contains)."""
    lines = [json.dumps({"prompt": parts_prompt(name), "expected": colour}) for name, colour in held_out]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_pairs(out: Path, *, num_train: int, num_eval: int, seed: int) -> None:
    """Preference pairs on the pictures write_data made (their images must exist under `out`): the
    colour question, chosen the right colour, rejected another one (see the module docstring)."""
    wrong = random.Random(seed + 1)

    def pair(split: str, name: str, colour: str) -> dict:
        rejected = wrong.choice([c for c in COLOURS if c != colour])
        if split == "train":
            return {"prompt": parts_prompt(name), "chosen": [{"role": "assistant", "content": colour}],
                    "rejected": [{"role": "assistant", "content": rejected}]}  # fmt: skip
        return {
            "prompt": f"<image>{QUESTIONS['colour']}",
            "images": [name],
            "chosen": colour,
            "rejected": rejected,
        }

    write_colour_rows(out / "pairs", pair, num_train=num_train, num_eval=num_eval, seed=seed)


def write_kto(out: Path, *, num_train: int, num_eval: int, seed: int) -> None:
    """Kto examples on the pictures write_data made: the colour question, the right colour (desirable)
    or a wrong one (undesirable), picked by a seeded coin (see the module docstring)."""
    coin = random.Random(seed + 2)

    def example(split: str, name: str, colour: str) -> dict:
        desirable = coin.random() < 0.5
        answer = colour if desirable else coin.choice([c for c in COLOURS if c != colour])
        if split == "eval":  # the longer shape on the short split: the demo's files stay small
            row = {"prompt": parts_prompt(name), "completion": [{"role": "assistant", "content": answer}]}
        else:
            row = {"prompt": f"<image>{QUESTIONS['colour']}", "images": [name], "completion": answer}
        return row | {"label": desirable}

    write_colour_rows(out / "kto", example, num_train=num_train, num_eval=num_eval, seed=seed)


def write_prompts(out: Path, *, num_train: int, num_eval: int, seed: int) -> None:
    """GRPO prompts on the pictures write_data made: the colour question, the colour in a column for the
    reward (see the module docstring)."""

    def prompt(split: str, name: str, colour: str) -> dict:
        if split == "eval":
            return {"prompt": parts_prompt(name), "colour": colour}
        return {"prompt": f"<image>{QUESTIONS['colour']}", "images": [name], "colour": colour}

    write_colour_rows(out / "prompts", prompt, num_train=num_train, num_eval=num_eval, seed=seed)


def parts_prompt(name: str) -> list[dict]:
    """The colour question about image `name` as one user message with an image part."""
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": name}, {"type": "text", "text": QUESTIONS["colour"]}],
        }
    ]


def write_colour_rows(stem: Path, make_row, *, num_train: int, num_eval: int, seed: int) -> None:
    """`{stem}_train.jsonl` and `{stem}_eval.jsonl`: `make_row(split, image name, colour)` for each of the
    demo's pictures in order (the same pictures as write_data's splits)."""
    made = pictures(num_train + num_eval, seed)
    for split, count in (("train", num_train), ("eval", num_eval)):
        lines = [
            json.dumps(make_row(split, f"images/{k:05d}.png", colour))
            for k, _, colour, _, _ in (next(made) for _ in range(count))
        ]
        stem.with_name(f"{stem.name}_{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_processor(out: Path, tokenizer_dir: Path = HERE / "tokenizer") -> None:
    """An Idefics3 processor for the demo model, saved to `out` (AutoProcessor loads it)."""
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=SMOLVLM_TEMPLATE
    )
    processor.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=480)
    parser.add_argument("--num-eval", type=int, default=60)
    parser.add_argument("--data", type=Path, default=HERE / "data" / "vlm")
    parser.add_argument("--processor", type=Path, default=HERE / "vlm_processor")
    args = parser.parse_args(argv)
    write_processor(args.processor)
    write_data(args.data, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed)
    write_pairs(args.data, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed)
    write_kto(args.data, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed)
    write_prompts(args.data, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed)
    print(f"wrote {args.processor} and {args.num_train} + {args.num_eval} rows to {args.data}")


if __name__ == "__main__":
    main()
