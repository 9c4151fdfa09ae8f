"""finetune.evaluation.generate: batched greedy generation and streaming, on a tiny random Llama with
the demo tokenizer (ChatML), and once on the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from finetune.evaluation.generate import decode_new_tokens, generate, prompt_ids, stop_token_ids, stream_chat
from finetune.evaluation.run import evaluate_generations
from finetune.model import apply_lora, load_for_inference
from finetune.recipe import LoraSection
from tests.tiny import tiny_model
from tests.unit.conftest import SmolLM2

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [
    "What is 2 + 3?",
    "Sort these words: pear, apple, fig.",
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Count to three."}],
    "Hi",
    "Reverse the list: one two three four five six seven eight nine ten eleven twelve.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return tiny_model(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def test_prompt_ids_render_the_chat_template_like_training(tokenizer) -> None:
    ids = prompt_ids(tokenizer, "What is 2 + 3?")
    assert ids[0] == tokenizer.bos_token_id  # the tokenizer's own prefix, as training prepends it
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    system = prompt_ids(tokenizer, PROMPTS[2])
    assert "<|im_start|>system\nAnswer briefly.<|im_end|>" in tokenizer.decode(system)
    raw = prompt_ids(tokenizer, "### Instruction:\nSay hi.\n\n### Response:\n", use_chat_template=False)
    assert "<|im_start|>" not in tokenizer.decode(raw) and raw[0] == tokenizer.bos_token_id
    with pytest.raises(ValueError, match="string prompts"):
        prompt_ids(tokenizer, PROMPTS[2], use_chat_template=False)


def test_stop_tokens_are_eos_and_end_of_turn(tokenizer, tiny) -> None:
    stops = stop_token_ids(tokenizer, tiny)
    assert stops == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_decoding_cuts_at_the_first_stop_and_drops_special_tokens(tokenizer) -> None:
    hello = tokenizer("hello", add_special_tokens=False)["input_ids"]
    end, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    rows = torch.tensor([[*hello, end, *hello, pad], [*hello, *hello, pad, pad]])
    assert decode_new_tokens(tokenizer, rows, stops=[end]) == ["hello", "hellohello"]


def test_left_padded_batches_give_the_one_by_one_answers(tokenizer, tiny) -> None:
    batched = generate(tiny, tokenizer, PROMPTS, max_new_tokens=8, batch_size=3, progress=False)
    alone = [generate(tiny, tokenizer, [p], max_new_tokens=8, progress=False)[0] for p in PROMPTS]
    assert batched == alone
    assert batched == generate(tiny, tokenizer, PROMPTS, max_new_tokens=8, batch_size=5, progress=False)
    assert all(batched) and len(set(batched)) > 1


def test_generation_is_in_eval_mode_without_grad_and_gives_the_mode_back(tokenizer, tiny) -> None:
    seen = []
    hook = tiny.register_forward_hook(lambda m, args, out: seen.append((m.training, torch.is_grad_enabled())))
    tiny.train()
    try:
        generate(tiny, tokenizer, PROMPTS[:2], max_new_tokens=3, progress=False)
        assert "".join(stream_chat(tiny, tokenizer, PROMPTS[0], max_new_tokens=3))
    finally:
        hook.remove()
    assert seen and set(seen) == {(False, False)}
    assert tiny.training
    tiny.eval()


def test_peft_model_generates_and_a_fresh_adapter_changes_nothing(tokenizer, tiny) -> None:
    plain = generate(tiny, tokenizer, PROMPTS, max_new_tokens=6, progress=False)
    peft_model = apply_lora(tiny, LoraSection(enable_lora=True, lora_rank=4), gradient_checkpointing=False)
    try:
        assert generate(peft_model, tokenizer, PROMPTS, max_new_tokens=6, progress=False) == plain  # B = 0
    finally:
        peft_model.unload()


def test_streaming_gives_the_batched_answer(tokenizer, tiny) -> None:
    pieces = list(stream_chat(tiny, tokenizer, PROMPTS[2], max_new_tokens=8))
    assert len(pieces) > 1
    assert (
        "".join(pieces).strip()
        == generate(tiny, tokenizer, [PROMPTS[2]], max_new_tokens=8, progress=False)[0]
    )


def test_streaming_raises_the_generation_error(tokenizer, tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(tiny, "generate", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(stream_chat(tiny, tokenizer, "Hi"))


def test_real_model_answers(smollm2: SmolLM2) -> None:
    model, tokenizer = load_for_inference(str(smollm2.folder))
    rows = [
        {"prompt": "What is the capital of France?", "expected": "Paris"},
        {"prompt": "What is 2+3?", "expected": "Paris"},
    ]
    result = evaluate_generations(
        model, tokenizer, rows, metric="contains", max_new_tokens=12, progress=False
    )
    first, second = result["samples"]
    assert first["output"] and second["output"] and "<|im_end|>" not in first["output"]
    assert (first["correct"], second["correct"], result["score"]) == (True, False, 0.5)
    assert "".join(stream_chat(model, tokenizer, "What is the capital of France?", max_new_tokens=12)).strip()
