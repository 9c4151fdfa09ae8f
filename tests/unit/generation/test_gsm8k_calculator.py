"""The inline calculator on data, a tokenizer and a tool's results that are not the repository's: GSM8K's
own calculator annotations (../shared/data/gsm8k, `<<48/2=24>>24`), tokenized by Llama 2's tokenizer.

A scripted model writes each answer up to every `<<expression=`; the tool loop must see the trigger
there, hand the expression to recipes/smollm2/calc.py and insert `result>>`; the model then writes the
rest. Where the calculator gives GSM8K's number, the completed text is GSM8K's answer exactly, and only
the inserted results are marked as not the model's own."""

from __future__ import annotations

import importlib.util
import json
import re
from types import SimpleNamespace

from transformers import AutoTokenizer

from finetune.generation.protocol import Completion, SamplingParams
from finetune.generation.tools import continuation_ids, generate_with_tools, load_tools

ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def test_gsm8k_annotations_are_completed_by_the_calculator(shared_data, repo_root):
    rows = [
        json.loads(line) for line in (shared_data / "gsm8k" / "train.jsonl").read_text().splitlines()[:200]
    ]
    tok = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "llama2-hf")
    spec = importlib.util.spec_from_file_location("calc", repo_root / "recipes" / "smollm2" / "calc.py")
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    box = load_tools(
        [SimpleNamespace(function="calc.py:calculate", trigger=r"<<([^<>=]*)=", close=">>")],
        tokenizer=tok, max_tool_calls=20, timeout_s=10, base=repo_root / "recipes" / "smollm2", label="grpo",
    )  # fmt: skip
    reproduced = calls = 0
    try:
        for row in rows:
            answer = row["answer"]
            # What the model writes: the text to each trigger, then from after each result's close on.
            pieces, start = [], 0
            for found in ANNOTATION.finditer(answer):
                pieces.append(answer[start : found.start(2)])
                start = found.end()
            pieces.append(answer[start:])
            expected_calls = [m.group(1) for m in ANNOTATION.finditer(answer)]
            backend = Pieces(tok, pieces)
            [[made]] = generate_with_tools(
                backend, [[tok.bos_token_id]], SamplingParams(max_new_tokens=800), box
            )
            assert [c.arguments for c in made.calls] == [[e] for e in expected_calls]  # every trigger seen
            calls += len(made.calls)
            text = tok.decode(made.ids, skip_special_tokens=True)
            results = [
                str(calc.calculate(e)) if not c.error else c.result
                for e, c in zip(expected_calls, made.calls, strict=True)
            ]
            if results == [m.group(2) for m in ANNOTATION.finditer(answer)]:
                assert text == answer
                reproduced += 1
            inserted = [
                t for t, own in zip(made.ids, made.own or [True] * len(made.ids), strict=True) if not own
            ]
            assert tok.decode(inserted) == "".join(
                c.result + ">>" for c in made.calls
            )  # nothing else inserted
    finally:
        box.close()
    print(f"GSM8K: {reproduced} of {len(rows)} answers reproduced exactly, {calls} calls")
    assert calls > 400 and reproduced / len(rows) > 0.9, (reproduced, calls)


class Pieces:
    """A backend that writes the next scripted piece (the last one ends with eos)."""

    name, processor, copies_weights = "pieces", None, False

    def __init__(self, tokenizer, pieces):
        self.tokenizer, self.pieces, self.stops = tokenizer, list(pieces), [tokenizer.eos_token_id]
        self.first = True

    def generate(self, prompts, params, *, seeds=None, batch_size=8, images=None, progress=False):
        piece = self.pieces.pop(0)
        # The pieces after the first continue the text (no SentencePiece prefix space), as a model's do.
        ids = (
            continuation_ids(self.tokenizer, piece)
            if not self.first
            else self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        )
        self.first = False
        last = not self.pieces
        return [[Completion(ids + ([self.tokenizer.eos_token_id] if last else []), last)]]
