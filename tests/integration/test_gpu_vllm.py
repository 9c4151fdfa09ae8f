"""vLLM rollouts on a CUDA GPU (skipped without one, or without vllm installed): GRPO trains on the tiny
demo with `grpo.generation_backend: vllm` and its digits reward rises; the trainer/sampler log-prob gap is
logged; and the weight sync is real (a changed weight changes what the vLLM engine generates).

Run on a GPU machine with `pytest -m gpu tests/integration/test_gpu_vllm.py` (pip install -e ".[vllm]").
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tests.integration._run import REPO, progress, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (extra [vllm])"
    ),
]

GRPO_DEMO = REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml"


def test_grpo_with_vllm_rollouts_trains_and_logs_the_sampling_gap(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "finetune.cli", "train", str(GRPO_DEMO), "--accelerate-config", "single_gpu",
        "--grpo.generation_backend", "vllm", "--grpo.vllm_gpu_memory_utilization", "0.2",
        "--train.max_steps", "30", "--train.log_steps", "1", "--train.output_dir", str(out),
        "--data.dataset_prepared_path", str(tmp_path / "prepared"),
    ]  # fmt: skip
    result = run(cmd, unset=("ACCELERATE_USE_CPU",), quiet=False, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = [r for r in progress(out) if r.get("event") is None and "loss" in r]
    assert len(steps) == 30
    assert all("sampling/logp_gap" in r and r["sampling/logp_gap"] < 0.5 for r in steps)
    first = sum(r["reward/digits"] for r in steps[:5]) / 5
    last = sum(r["reward/digits"] for r in steps[-5:]) / 5
    assert last > first, (first, last)
    assert (out / "adapter_model.safetensors").is_file()


def test_a_synced_weight_change_changes_vllms_generation(tmp_path):
    from transformers import AutoTokenizer

    from finetune.generation.backends import backend_for
    from finetune.generation.prompts import prompt_ids
    from finetune.generation.protocol import SamplingParams
    from tests.tiny import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    model = tiny_model(
        vocab_size=len(tokenizer), max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ).to("cuda")  # fmt: skip
    backend = backend_for("vllm", model, tokenizer, gpu_memory_utilization=0.2, max_model_len=256)
    ids = [prompt_ids(tokenizer, "What is 2 + 3?")]
    greedy = SamplingParams(max_new_tokens=6)
    transformers_backend = backend_for("transformers", model, tokenizer)
    before = backend.generate(ids, greedy)[0][0].ids
    assert before == transformers_backend.generate(ids, greedy)[0][0].ids[: len(before)]
    target = tokenizer.convert_tokens_to_ids("a")
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[target] = 10.0
    assert backend.generate(ids, greedy)[0][0].ids == before  # not synced yet: vLLM has its own copy
    backend.sync_weights(model)
    after = backend.generate(ids, greedy)[0][0].ids
    assert after != before and after[0] == target
    sampled = backend.generate(ids, SamplingParams(max_new_tokens=6, temperature=1.0, num_return_sequences=2),
                               seeds=[[1, 2]])[0]  # fmt: skip
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.ids) for c in sampled)
