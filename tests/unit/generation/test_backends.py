"""The generation-backend seam (finetune.generation.backends, .protocol): the table, the transformers
backend through the protocol, and the weight sync that online RL calls after every update."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from finetune.errors import FinetuneError
from finetune.generation.backends import BACKENDS, answers, backend_for
from finetune.generation.prompts import prompt_ids
from finetune.generation.protocol import GenerationBackend, SamplingParams
from finetune.generation.transformers_backend import TransformersBackend
from finetune.recipe.grpo import GrpoSection
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")


@pytest.fixture
def tiny(tokenizer):
    torch.manual_seed(0)
    return tiny_model(
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def test_every_backend_the_recipe_offers_is_in_the_table():
    import typing

    offered = set(typing.get_args(GrpoSection.model_fields["generation_backend"].annotation))
    assert offered == set(BACKENDS)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_backend_implements_the_protocol(name):
    cls = BACKENDS[name]()  # importing the module needs no engine: it is imported when one is made
    assert cls.name == name
    for method in ("generate", "stream", "sync_weights"):
        ours = inspect.signature(getattr(cls, method))
        protocol = inspect.signature(getattr(GenerationBackend, method))
        assert list(ours.parameters) == list(protocol.parameters), f"{name}.{method}"


def test_an_unknown_backend_is_a_clear_error(tiny, tokenizer):
    with pytest.raises(FinetuneError, match=r"generation backend 'sglang' is not one of: transformers, vllm"):
        backend_for("sglang", tiny, tokenizer)


def test_the_transformers_backend_samples_one_seed_per_completion(tiny, tokenizer):
    backend = backend_for("transformers", tiny, tokenizer)
    assert isinstance(backend, TransformersBackend) and backend.processor is None
    prompts = [prompt_ids(tokenizer, "What is 2 + 3?"), prompt_ids(tokenizer, "Hi")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, num_return_sequences=3)
    seeds = [[1, 2, 3], [4, 5, 6]]
    first = backend.generate(prompts, params, seeds=seeds, batch_size=2)
    assert [len(row) for row in first] == [3, 3]
    again = backend.generate(prompts[::-1], params, seeds=seeds[::-1], batch_size=1)[::-1]
    assert [[c.ids for c in row] for row in again] == [[c.ids for c in row] for row in first]
    with pytest.raises(ValueError, match="one seed per completion"):
        backend.generate(prompts, params)


def test_a_synced_update_changes_what_the_backend_generates(tiny, tokenizer):
    """The weight sync of online RL: after an update (here: the output head changed in place, then
    sync_weights, as after_update calls it), the next generation follows the new weights."""
    backend = backend_for("transformers", tiny, tokenizer)
    before = answers(backend, ["What is 2 + 3?"], max_new_tokens=5, progress=False)
    with torch.no_grad():  # make one token the most likely everywhere
        tiny.lm_head.weight.zero_()
        tiny.lm_head.weight[tokenizer.convert_tokens_to_ids("a")] = 1.0
        tiny.model.norm.weight.fill_(1.0)
    backend.sync_weights(tiny)
    after = answers(backend, ["What is 2 + 3?"], max_new_tokens=5, progress=False)
    assert after != before and after[0].startswith("a")


def test_streaming_through_the_protocol_equals_the_batched_answer(tiny, tokenizer):
    from finetune.generation.prompts import chat_inputs

    backend = backend_for("transformers", tiny, tokenizer)
    streamed = "".join(backend.stream(chat_inputs(tokenizer, "Hi"), SamplingParams(max_new_tokens=6)))
    assert streamed.strip() == answers(backend, ["Hi"], max_new_tokens=6, progress=False)[0]


def test_the_vllm_backend_without_a_gpu_is_a_clear_error(tiny, tokenizer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FinetuneError, match=r"vllm needs a CUDA GPU .* use generation_backend: transformers"):
        backend_for("vllm", tiny, tokenizer, gpu_memory_utilization=0.3)


def test_vllm_outputs_become_completions_with_their_sampling_log_probs():
    """vLLM's CompletionOutput: ids cut after the first stop token (kept), an eos vLLM left out
    appended (as the transformers backend keeps it), and the sampled tokens' log-probs."""
    from types import SimpleNamespace as O

    from finetune.generation.vllm_backend import completion_of

    def lp(*pairs):
        return [{t: O(logprob=v)} for t, v in pairs]

    cut = completion_of(
        O(
            token_ids=[5, 2, 7],
            finish_reason="stop",
            stop_reason=2,
            logprobs=lp((5, -1.0), (2, -0.5), (7, -2.0)),
        ),
        [2],
        eos=2,
    )
    assert (cut.ids, cut.finished, cut.logprobs) == ([5, 2], True, [-1.0, -0.5])
    long = completion_of(
        O(token_ids=[5, 6], finish_reason="length", stop_reason=None, logprobs=lp((5, -1.0), (6, -0.1))),
        [2],
        eos=2,
    )
    assert (long.ids, long.finished, long.logprobs) == ([5, 6], False, [-1.0, -0.1])
    eos = completion_of(
        O(token_ids=[5], finish_reason="stop", stop_reason=None, logprobs=lp((5, -1.0))), [2], eos=2
    )
    assert (
        eos.ids == [5, 2] and eos.finished and eos.logprobs[0] == -1.0 and eos.logprobs[1] != eos.logprobs[1]
    )


def test_vllm_settings_without_the_vllm_backend_are_recipe_errors():
    from pydantic import ValidationError

    with pytest.raises(
        ValidationError, match=r"vllm_gpu_memory_utilization.*read by generation_backend: vllm only"
    ):
        GrpoSection(rewards=[{"name": "length"}], vllm_gpu_memory_utilization=0.5)
    settings = GrpoSection(rewards=[{"name": "length"}], generation_backend="vllm", vllm_max_model_len=512)
    assert settings.backend_options == {
        "gpu_memory_utilization": 0.3,
        "max_model_len": 512,
        "enable_sleep_mode": False,
    }


def test_generation_dtype_is_the_transformers_backend_s_and_takes_the_importance_sampling_settings():
    """grpo.generation_dtype samples with other numerics than the trainer's, like vLLM: the
    vllm_importance_sampling_* settings apply to it; with the vLLM backend it is an error (vLLM has its
    own dtype), and RLOO's whole-completion loss needs a sequence-level correction, as with vLLM."""
    from pydantic import ValidationError

    rewards = [{"name": "length"}]
    settings = GrpoSection(rewards=rewards, generation_dtype="bfloat16", vllm_importance_sampling_cap=2.0)
    assert settings.backend_options == {"merge_adapters": None, "dtype": "bfloat16"}
    with pytest.raises(
        ValidationError, match=r"vllm_importance_sampling_cap.*read by generation_backend: vllm"
    ):
        GrpoSection(rewards=rewards, vllm_importance_sampling_cap=2.0)  # nothing to correct without it
    with pytest.raises(ValidationError, match=r"generation_dtype.*transformers only"):
        GrpoSection(rewards=rewards, generation_backend="vllm", generation_dtype="bfloat16")
    with pytest.raises(ValidationError, match=r"loss_type rloo weighs whole completions"):
        GrpoSection(rewards=rewards, loss_type="rloo", scale_rewards="none", generation_dtype="bfloat16")
    with pytest.raises(ValidationError, match="generation_dtype"):
        GrpoSection(rewards=rewards, generation_dtype="float32")  # the training weights' own: leave it null
