"""finetune.generation.prompts and the transformers backend (finetune.generation.transformers_backend):
prompt rendering, batched greedy generation, seeded sampling and streaming, on a tiny random Llama with
the demo tokenizer (ChatML), and once on the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from finetune.generation.backends import answers
from finetune.generation.prompts import (
    chat_inputs,
    decode_completion,
    decode_new_tokens,
    prompt_ids,
    stop_token_ids,
)
from finetune.generation.protocol import SamplingParams
from finetune.generation.sets import evaluate_generations
from finetune.generation.transformers_backend import SeededSampler, TransformersBackend, draw, generate_ids
from finetune.model.adapters import apply_lora
from finetune.model.inference import load_for_inference
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


def generate(model, tokenizer, prompts, **options):
    """Greedy answers through the transformers backend (what generation sets call)."""
    return answers(TransformersBackend(model, tokenizer), prompts, **options)


def stream_chat(model, tokenizer, prompt, *, max_new_tokens=512):
    """One streamed answer through the transformers backend (what `finetune chat` calls)."""
    inputs = chat_inputs(tokenizer, prompt)
    return TransformersBackend(model, tokenizer).stream(inputs, SamplingParams(max_new_tokens=max_new_tokens))


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


@pytest.mark.slow  # the real model
def test_real_model_answers(smollm2: SmolLM2) -> None:
    model, tokenizer = load_for_inference(str(smollm2.folder))
    rows = [
        {"prompt": "What is the capital of France?", "expected": "Paris"},
        {"prompt": "What is 2+3?", "expected": "Paris"},
    ]
    result = evaluate_generations(
        TransformersBackend(model, tokenizer), rows, metric="contains", max_new_tokens=12, progress=False
    )
    first, second = result["samples"]
    assert first["output"] and second["output"] and "<|im_end|>" not in first["output"]
    assert (first["correct"], second["correct"], result["score"]) == (True, False, 0.5)
    assert "".join(stream_chat(model, tokenizer, "What is the capital of France?", max_new_tokens=12)).strip()


# ------------------------------------------------------------------------------ seeded sampling


def _sample(tiny, tokenizer, prompts, seeds, *, batch_size=8, **options):
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    options = {"max_new_tokens": 12, "temperature": 1.0, "num_return_sequences": len(seeds[0]), **options}
    return generate_ids(tiny, tokenizer, encoded, seeds=seeds, batch_size=batch_size, **options)


def test_a_prompts_completions_depend_on_its_seeds_not_on_its_batch(tokenizer, tiny) -> None:
    seeds = [[10 * k + j for j in range(3)] for k in range(len(PROMPTS))]
    together = _sample(tiny, tokenizer, PROMPTS, seeds, batch_size=8)
    alone = [_sample(tiny, tokenizer, [p], [s], batch_size=1)[0] for p, s in zip(PROMPTS, seeds, strict=True)]
    assert [[c.ids for c in row] for row in together] == [[c.ids for c in row] for row in alone]
    again = _sample(tiny, tokenizer, PROMPTS, seeds, batch_size=2)
    assert [[c.ids for c in row] for row in again] == [[c.ids for c in row] for row in together]
    # Different seeds sample different completions (a random model spreads its mass widely).
    assert len({tuple(c.ids) for row in together for c in row}) > len(PROMPTS)


def test_sampling_follows_the_tempered_filtered_distribution(tokenizer) -> None:
    """One step from fixed logits: SeededSampler draws with the probabilities softmax(logits / T)
    restricted to the top_p nucleus (counted over many draws)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = []
    for seed in range(4000):
        sampler = SeededSampler([torch.Generator().manual_seed(seed)], temperature=1.0, top_p=0.8, top_k=0)
        draws.append(int(sampler(torch.zeros(1, 1, dtype=torch.long), logits.clone()).argmax()))
    counts = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    # The nucleus of 0.8 is {0.5, 0.3}: renormalised 0.625 / 0.375, nothing else.
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] - 0.625) < 0.03 and abs(counts[1] - 0.375) < 0.03
    cold = SeededSampler([torch.Generator().manual_seed(0)], temperature=0.05, top_p=1.0, top_k=0)
    assert int(cold(torch.zeros(1, 1, dtype=torch.long), logits.clone()).argmax()) == 0


@pytest.mark.parametrize("vocab", [2, 7, 50, 1000])
def test_draw_samples_each_token_with_its_probability(vocab) -> None:
    """The sampler's two-level race draws token t with probability p_t, for vocabularies cut into equal
    blocks or with a shorter last one: 40000 draws (one generator each) within 4.5 standard deviations of
    p_t, and never a token of probability 0."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
    probs[1::3] = 0.0  # filtered out (top_k / top_p leave zeros)
    probs /= probs.sum()
    n, rows = 40000, 1000
    picks = torch.cat(
        [
            draw(
                probs.expand(rows, vocab), [torch.Generator().manual_seed(k * rows + i) for i in range(rows)]
            )
            for k in range(n // rows)
        ]
    )
    freq = torch.bincount(picks, minlength=vocab).double() / n
    assert freq[1::3].sum() == 0
    sd = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 4.5 * sd + 1e-12).all(), (freq, probs)


def test_draw_gives_each_row_the_token_of_its_own_generator() -> None:
    """A row's token depends on its generator and probabilities only, not on the other rows of the batch
    (what makes a completion independent of its batch and a resumed run sample the same)."""
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), -1)
    together = draw(probs, [torch.Generator().manual_seed(s) for s in range(5)])
    alone = [int(draw(probs[i : i + 1], [torch.Generator().manual_seed(i)])) for i in range(5)]
    assert together.tolist() == alone
    assert draw(probs, [torch.Generator().manual_seed(s) for s in range(5)]).tolist() == together.tolist()
    other = draw(probs, [torch.Generator().manual_seed(s + 100) for s in range(5)])
    assert other.tolist() != together.tolist()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_generation_runs_float32_cpu_linears_through_onednn_and_gives_them_back() -> None:
    """Inside onednn_linears (every generate call), a float32 CPU nn.Linear computes with oneDNN's linear
    (the same bits as calling it), within float32 rounding of torch's own; a bfloat16 layer and one whose
    forward was already replaced are left alone; with autograd or under autocast it is torch's own; on exit (an error
    included) every layer is the plain one again."""
    from finetune.generation.transformers_backend import onednn_linears

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False), torch.nn.Linear(4, 4)
    )
    net[2].to(torch.bfloat16)
    hooked = torch.nn.Linear(8, 8)
    hooked.forward = lambda x: x  # e.g. Accelerate's offload hook
    net.append(hooked)
    x = torch.randn(3, 5, 8)
    with torch.no_grad(), onednn_linears(net):
        assert "forward" in vars(net[0]) and "forward" in vars(net[1])
        assert "forward" not in vars(net[2]) and vars(hooked)["forward"](x) is x
        got = net[0](x)
        onednn = torch.ops.mkldnn._linear_pointwise(x, net[0].weight, net[0].bias, "none", [], "")
        assert torch.equal(got, onednn)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, net[0].weight, net[0].bias))
    with onednn_linears(net):
        assert net[0](x).grad_fn is not None  # autograd: torch's own linear
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), onednn_linears(net):
        assert net[0](x).dtype == torch.bfloat16  # mixed precision: autocast's cast, as without
    with pytest.raises(RuntimeError), onednn_linears(net):
        raise RuntimeError
    assert all("forward" not in vars(m) for m in net[:3]) and "forward" in vars(hooked)


def test_completions_say_whether_they_stopped_and_keep_the_stop_token(tokenizer, tiny) -> None:
    stops = set(stop_token_ids(tokenizer, tiny))
    rows = _sample(tiny, tokenizer, PROMPTS, [[1, 2]] * len(PROMPTS), max_new_tokens=6)
    for row in rows:
        for completion in row:
            assert len(completion.ids) <= 6
            if completion.finished:
                assert completion.ids[-1] in stops and not stops & set(completion.ids[:-1])
            else:
                assert len(completion.ids) == 6 and not stops & set(completion.ids)


def test_greedy_needs_no_seeds_and_sampling_refuses_missing_ones(tokenizer, tiny) -> None:
    encoded = [prompt_ids(tokenizer, p) for p in PROMPTS[:2]]
    greedy = generate_ids(tiny, tokenizer, encoded, max_new_tokens=5)
    texts = generate(tiny, tokenizer, PROMPTS[:2], max_new_tokens=5, progress=False)
    stops = stop_token_ids(tokenizer, tiny)
    assert [decode_completion(tokenizer, row[0].ids, stops=stops) for row in greedy] == texts
    with pytest.raises(ValueError, match="one seed per completion"):
        generate_ids(tiny, tokenizer, encoded, max_new_tokens=5, temperature=1.0, num_return_sequences=2)


def test_merged_adapters_sample_what_the_adapters_sample_without_running_them(tokenizer, tiny) -> None:
    """merge_adapters (grpo.merged_generation): the trained adapters are merged for the call, so no LoRA
    matmul runs while decoding, the completions are the unmerged backend's, and the weights after the call
    are the ones before, bit for bit."""
    import copy

    peft_model = apply_lora(
        copy.deepcopy(tiny), LoraSection(enable_lora=True, lora_rank=4), gradient_checkpointing=False
    )
    torch.manual_seed(3)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # a trained adapter (B is zero at init)
            torch.nn.init.normal_(param, std=0.05)
    encoded = [prompt_ids(tokenizer, p) for p in PROMPTS]
    seeds = [[10 * k + j for j in range(2)] for k in range(len(PROMPTS))]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, num_return_sequences=2)
    calls = []
    hooks = [
        m.register_forward_hook(lambda *_: calls.append(1))
        for name, m in peft_model.named_modules()
        if name.endswith("lora_A.default")
    ]
    unmerged = TransformersBackend(peft_model, tokenizer).generate(encoded, params, seeds=seeds)
    assert calls  # the adapters ran at every token
    calls.clear()
    weights = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    merged = TransformersBackend(peft_model, tokenizer, merge_adapters=True).generate(
        encoded, params, seeds=seeds
    )
    assert not calls  # merged: the plain layers ran
    auto = TransformersBackend(peft_model, tokenizer, merge_adapters=None)  # grpo's default: merged on CPU
    assert auto.merges and [[c.ids for c in row] for row in auto.generate(encoded, params, seeds=seeds)] == [
        [c.ids for c in row] for row in merged
    ]
    assert not calls
    for hook in hooks:
        hook.remove()
    assert [[c.ids for c in row] for row in merged] == [[c.ids for c in row] for row in unmerged]
    assert all(torch.equal(p, weights[name]) for name, p in peft_model.named_parameters())
    plain = TransformersBackend(tiny, tokenizer).generate(encoded, params, seeds=seeds)
    assert [[c.ids for c in row] for row in plain] != [[c.ids for c in row] for row in merged]  # trained


def test_the_sampler_records_each_drawn_token_s_log_prob_under_the_distribution_it_drew_from() -> None:
    """record=True (grpo.generation_dtype): the log-prob kept per row is log softmax(logits / T) of the
    drawn token, renormalised over the top_p nucleus: the sampling log-prob the correction compares with
    the trainer's."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    sampler = SeededSampler(gens, temperature=0.5, top_p=0.9, top_k=0, record=True)
    picked = sampler(torch.zeros(2, 1, dtype=torch.long), logits.clone()).argmax(-1)
    tempered = torch.softmax(logits / 0.5, -1)
    nucleus = [[0, 1], [1, 2, 3]]  # the 0.9 nucleus of each row (transformers keeps mass above 1 - top_p)
    for row, tokens in enumerate(nucleus):
        assert int(picked[row]) in tokens
        expected = torch.log(tempered[row, picked[row]] / tempered[row, tokens].sum())
        assert float(sampler.logprobs[0][row]) == pytest.approx(float(expected), abs=1e-6)
    assert SeededSampler(gens, temperature=1.0, top_p=1.0, top_k=0).logprobs is None  # off by default


def test_generation_dtype_samples_from_a_bfloat16_merged_copy_and_keeps_the_log_probs(
    tokenizer, tiny
) -> None:
    """TransformersBackend(dtype="bfloat16") samples what a bfloat16 copy of the merged model samples with
    the same seeds, gives each completion the log-prob of every token under that copy (the scores it
    drew from, aligned with the ids), and leaves the float32 training weights as they were."""
    import copy

    peaked = copy.deepcopy(tiny)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(8)  # peaked distributions: a log-prob off by one token is far off
    peft_model = apply_lora(peaked, LoraSection(enable_lora=True, lora_rank=4), gradient_checkpointing=False)
    torch.manual_seed(3)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    encoded = [prompt_ids(tokenizer, p) for p in PROMPTS]
    seeds = [[10 * k + j for j in range(2)] for k in range(len(PROMPTS))]
    params = SamplingParams(max_new_tokens=8, temperature=0.7, num_return_sequences=2)
    weights = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    cast = TransformersBackend(peft_model, tokenizer, dtype="bfloat16").generate(encoded, params, seeds=seeds)
    assert all(torch.equal(p, weights[name]) for name, p in peft_model.named_parameters())
    copy16 = copy.deepcopy(peft_model).merge_and_unload()
    for param in copy16.parameters():
        param.data = param.data.to(torch.bfloat16)
    expected = TransformersBackend(copy16, tokenizer).generate(encoded, params, seeds=seeds)
    assert [[c.ids for c in row] for row in cast] == [[c.ids for c in row] for row in expected]
    full = TransformersBackend(peft_model, tokenizer).generate(encoded, params, seeds=seeds)
    assert all(c.logprobs is None for row in full for c in row)  # float32 sampling keeps none
    gaps = []
    for prompt, row in zip(encoded, cast, strict=True):
        for c in row:
            assert len(c.logprobs) == len(c.ids)
            ids = torch.tensor([prompt + c.ids])
            with torch.no_grad():
                logits = copy16(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
            forced = torch.log_softmax(logits, -1)[torch.arange(len(c.ids)), torch.tensor(c.ids)]
            gaps.append((forced - torch.tensor(c.logprobs)).abs().max())
    # teacher-forced in one pass vs decoded with the cache: bfloat16 rounding apart, the same log-probs
    assert max(gaps) < 0.05, max(gaps)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_each_prompt_is_prefilled_once_for_all_its_completions(
    tokenizer, tiny, temperature, monkeypatch
) -> None:
    """num_return_sequences > 1: the prompts (left-padded, of different lengths) go through the model once
    each, their cache repeated for the completions, which are the ones of a prefill per completion."""
    from finetune.generation import transformers_backend as tb

    encoded = [prompt_ids(tokenizer, p) for p in PROMPTS]
    seeds = [[10 * k + j for j in range(3)] for k in range(len(PROMPTS))] if temperature else None
    options = {"max_new_tokens": 10, "temperature": temperature, "num_return_sequences": 3, "seeds": seeds}
    widths: list[tuple[int, int]] = []
    hook = tiny.model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: widths.append(tuple(args[0].shape))
    )
    try:
        shared = generate_ids(tiny, tokenizer, encoded, batch_size=2, **options)
        first_calls = list(widths)
        monkeypatch.setattr(tb, "keeps_logits", lambda model: False)  # the prefill per completion
        widths.clear()
        copied = generate_ids(tiny, tokenizer, encoded, batch_size=2, **options)
    finally:
        hook.remove()
    assert [[c.ids for c in row] for row in shared] == [[c.ids for c in row] for row in copied]
    longest = max(len(ids) for ids in encoded)  # batches go longest first
    assert first_calls[0] == (
        2,
        longest - 1,
    )  # the first batch's two prompts, once each, all but their last token
    assert widths[0] == (6, longest)  # without: each prompt once per completion
