"""finetune.plan for online RL (finetune.plan.rollout): the rollout's parts against hand-computed values,
the generation peak against the CPU allocator's, the log-prob pass, sharded generation, the reference,
vLLM's share in the fit check, and plans of other objectives unchanged (pinned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.accelerate_config import DistributedSetup
from finetune.cli import main
from finetune.plan import GiB, estimate, format_plan, inventory_of, make_plan
from finetune.plan.activations import activation_bytes
from finetune.plan.rollout import generation_bytes, logprob_pass_bytes, training_tokens
from finetune.recipe import Recipe, validate_recipe
from tests.memory import peak_allocated_bytes
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]
PINS = Path(__file__).parent / "plan_pins"
TINY = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
}  # fmt: skip


def _recipe(
    config: dict | None = None,
    *,
    grpo: dict | None = None,
    train: dict | None = None,
    lora: dict | None = None,
    sequence_len: int = 16,
    model: dict | None = None,
) -> Recipe:
    return validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama", **TINY, **(config or {})},
                "tokenizer_path": "tok",
                "torch_dtype": "fp32",
                "attn_implementation": "sdpa",
                **(model or {}),
            },
            "data": {
                "datasets": [{"path": "p.jsonl", "type": "prompt", "field_prompt": "question"}],
                "sequence_len": sequence_len,
            },
            "train": {
                "output_dir": "out",
                "objective": "grpo",
                "micro_batch_size": 8,
                "gradient_accumulation_steps": 2,
                "mixed_precision": "no",
                **(train or {}),
            },
            "grpo": {
                "num_generations": 4,
                "max_new_tokens": 32,
                "generation_batch_size": 4,
                "rewards": [{"name": "format", "pattern": "x"}],
                **(grpo or {}),
            },
            "lora": lora or {},
        }
    )


def _net(config: dict | None = None) -> torch.nn.Module:
    # no eos: every completion runs to max_new_tokens, the longest a rollout can be
    return tiny_model(**{**TINY, **(config or {})}, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def _single(recipe: Recipe, engine: DistributedSetup | None = None):
    """The inventory of the recipe's tiny model and its estimate under `engine` (one device)."""
    config = {k: v for k, v in dict(recipe.model.config_path).items() if k != "model_type"}
    inv = inventory_of(_net(config))
    micro = recipe.train.micro_batch_size
    return inv, estimate(
        inv, recipe, engine or DistributedSetup(), micro_batch_size=micro, checkpointing=False
    )


# ------------------------------------------------------------------------- parts by hand (tiny config)


def test_generation_parts_by_hand():
    """The tiny Llama (2 layers, 2 KV heads of 16, hidden 64, intermediate 128, vocab 97), fp32: 4 prompts
    a call x 4 completions = 16 sequences, prompts of 16 tokens, 32 new tokens (the cache ends at 47)."""
    _, est = _single(_recipe())
    gen = est.rollout.generation
    assert (gen.sequences, gen.prompt_tokens, gen.cached_tokens) == (16, 16, 47)
    assert gen.kv_cache == 2 * 2 * 2 * 16 * 4 * 16 * 47  # (k, v) x layers x KV heads x dims x fp32 x N x T
    assert gen.kv_growth == 2 * 16 * 4 * 16 * 47  # one layer's keys while torch.cat grows them
    assert gen.ids == 3 * 8 * 16 * 48  # input_ids + attention mask (int64) + one growing copy
    assert gen.step_logits == 16 * 97 * (4 + 8 + 12)  # logits, fp32 copy, previous scores, sampler
    assert gen.held_scores == 8 * 16 * 97
    # each of the 4 prompts' cache made once, all but its last token (then repeated for its 4 completions)
    assert gen.prompt_kv == 2 * 2 * 2 * 16 * 4 * 4 * 15
    tokens = 4 * 15
    # embeddings, layer input, residual, normed input; the MLP's three intermediates beat attention's
    # q, repeated k and v and output; rotary cos/sin; sdpa's bool padding mask; the prompts' ids
    assert (
        gen.prefill
        == tokens * 4 * 4 * 64 + 3 * 4 * tokens * 128 + 2 * 4 * tokens * 16 + 4 * 15 * 15 + 16 * tokens
    )
    assert gen.step_activations == 16 * 4 * 4 * 64 + 2 * 4 * 16 * 16  # one new token's streams and rotary
    assert gen.decode_peak == 512_128 + gen.step_activations > gen.prefill_peak
    names = [p.name for p in est.rollout.parts]
    assert names == ["KV cache (generate)", "scores + ids (generate)"]
    assert est.rollout.total_gpu == est.rollout.resident + gen.decode_peak
    # a prompt per completion (no shared cache: e.g. layer-by-layer generation across processes)
    copied = generation_bytes(
        inventory_of(_net()), sequences=16, prompt_tokens=16, max_new_tokens=32, residual_bytes=4,
        compute_bytes=4, autocast=False, attn_implementation="sdpa",
    )  # fmt: skip
    tokens = 16 * 16
    assert copied.prompt_kv == 2 * 2 * 2 * 16 * 4 * 16 * 16
    assert (
        copied.prefill
        == tokens * 4 * 4 * 64 + 3 * 4 * tokens * 128 + 2 * 4 * tokens * 16 + 16 * 16 * 16 + 16 * tokens
    )
    assert copied.prefill_peak == 827_392
    # nothing else runs in the rollout: no reference, no old log-probs, nothing gathered
    assert est.rollout.other == () and "reference model" not in [p.name for p in est.parts]


def test_generation_batches_are_the_step_s_prompts_at_most():
    """A call holds min(generation_batch_size, prompts per step) prompts: micro 8 x accumulation 2 /
    4 completions = 4 prompts a step, whatever a larger generation_batch_size says."""
    _, est = _single(_recipe(grpo={"generation_batch_size": 32}))
    assert est.rollout.prompts_per_call == 4 and est.rollout.generation.sequences == 16
    _, small = _single(_recipe(grpo={"generation_batch_size": 1}))
    assert small.rollout.generation.sequences == 4


def test_online_training_step_is_one_packed_row_of_completions():
    """The training micro-batch: micro_batch_size completions in one row of micro x (sequence_len +
    max_new_tokens) tokens, full logits (the policy loss is never chunked)."""
    recipe = _recipe()
    inv, est = _single(recipe)
    layout = est.layout
    # 8 completions a micro-batch, 4 of each prompt: two prompt copies (grpo.share_prompts)
    assert training_tokens(8, recipe, recipe.grpo) == 2 * 16 + 8 * 32
    expected = activation_bytes(
        inv, micro_batch_size=1, seq_len=2 * 16 + 8 * 32, attn_implementation="sdpa",
        residual_bytes=layout.residual_bytes, compute_bytes=layout.compute_bytes, autocast=False,
        rotary_rows=1,
    )  # fmt: skip
    assert est.activations == expected
    plan = make_plan(recipe, inventory=inv, gpu_memory="24GiB")
    assert plan.seq_len == 2 * 16 + 8 * 32
    copied = _recipe(grpo={"share_prompts": False})
    assert make_plan(copied, inventory=inv, gpu_memory="24GiB").seq_len == 8 * 48
    assert est.total_gpu == max(est.training_gpu, est.rollout.total_gpu)


def test_decode_peak_for_long_completions():
    """Long completions make the last step the peak: the cache at prompt + max_new_tokens - 1 tokens."""
    _, est = _single(_recipe(grpo={"max_new_tokens": 256}))
    gen = est.rollout.generation
    assert gen.decode_peak > gen.prefill_peak and gen.cached_tokens == 16 + 255
    assert [p.name for p in est.rollout.parts] == ["KV cache (generate)", "scores + ids (generate)"]
    assert sum(p.gpu_bytes for p in est.rollout.parts) == gen.decode_peak
    # a large vocabulary: the last step's logits and sampling, not its forward, make the peak
    _, est = _single(_recipe({"vocab_size": 32000}, grpo={"max_new_tokens": 256}))
    gen = est.rollout.generation
    assert [p.name for p in est.rollout.parts] == ["KV cache (generate)", "logits + sampling (generate)"]
    assert sum(p.gpu_bytes for p in est.rollout.parts) == gen.decode_peak == gen.peak


# ----------------------------------------------------------------- measured on CPU: the generation peak


class _Tokenizer:
    """What the transformers backend asks of a tokenizer: no eos, no special tokens, pad 0."""

    pad_token_id, eos_token_id, all_special_tokens = 0, None, []

    def convert_tokens_to_ids(self, token):
        return None


MEASURED = {  # id: model config, grpo, sequence_len, mixed precision (bf16: LoRA on bf16 weights, "bf16-full": fp32)
    "prefill-fp32": ({"hidden_size": 128, "intermediate_size": 384, "vocab_size": 704}, {"max_new_tokens": 12}, 64, "no"),
    "decode-fp32": ({"num_key_value_heads": 4}, {"max_new_tokens": 40}, 4, "no"),
    "vocab-top_p": ({"vocab_size": 4000}, {"max_new_tokens": 24, "top_p": 0.9, "temperature": 0.7}, 8, "no"),
    "bf16-autocast": (
        {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3, "num_attention_heads": 8, "vocab_size": 1000},
        {"max_new_tokens": 16}, 32, "bf16-full",
    ),
    # the vocabulary keeps CPU's copies of a frozen bf16 head below the peak (see the test)
    "lora-bf16": (
        {"hidden_size": 128, "intermediate_size": 384, "vocab_size": 256},
        {"max_new_tokens": 24, "merged_generation": False}, 32, "bf16",
    ),
    # merged for the call (grpo.merged_generation): the merged copies instead of the adapters' fp32 arithmetic
    "lora-bf16-merged": (
        {"hidden_size": 128, "intermediate_size": 384, "vocab_size": 256},
        {"max_new_tokens": 24, "merged_generation": True}, 32, "bf16",
    ),
    # LoRA on fp32 weights sampled from a bfloat16 copy (grpo.generation_dtype): the copy, 16-bit activations
    "lora-fp32-generation-bf16": (
        {"hidden_size": 128, "intermediate_size": 384, "vocab_size": 256},
        {"max_new_tokens": 24, "generation_dtype": "bfloat16"}, 32, "lora-fp32",
    ),
    # the same on weights already in bfloat16: used as they are, only the merged LoRA weights are new copies
    "lora-bf16-generation-bf16": (
        {"hidden_size": 128, "intermediate_size": 384, "vocab_size": 256},
        {"max_new_tokens": 24, "generation_dtype": "bfloat16"}, 32, "bf16",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("config", "grpo", "sequence_len", "mixed"), MEASURED.values(), ids=MEASURED)
def test_predicted_generation_peak_matches_cpu(fresh_accelerator_state, config, grpo, sequence_len, mixed):
    """The planner's generation peak (the rollout's generate call, weights apart) against the most bytes
    alive at once in the same call through the transformers backend on CPU (tests/memory.py): prompts at
    data.sequence_len (one a token shorter, so the batch is padded), every completion to max_new_tokens.
    bf16: Accelerate's autocast, which keeps the bf16 casts of trainable fp32 weights through a forward
    (full fine-tuning with fp32 weights; LoRA on bf16 weights, generating through PEFT: computed at every token,
    or merged into copies of the adapted weights with grpo.merged_generation)."""
    from accelerate import Accelerator

    from finetune.generation.protocol import SamplingParams
    from finetune.generation.transformers_backend import TransformersBackend
    from finetune.model.adapters import apply_lora

    lora = {"enable_lora": True} if mixed in ("bf16", "lora-fp32") else {}
    model = {
        "no": {},
        "bf16": {"torch_dtype": "bf16"},
        "bf16-full": {"torch_dtype": "auto"},
        "lora-fp32": {},
    }[mixed]
    precision = "no" if mixed == "lora-fp32" else mixed.removesuffix("-full")
    recipe = _recipe(
        config,
        grpo=grpo,
        sequence_len=sequence_len,
        train={"mixed_precision": precision},
        model=model,
        lora=lora,
    )
    net = _net({**config, "dtype": torch.bfloat16} if mixed == "bf16" else config)
    inv = inventory_of(net)
    est = estimate(inv, recipe, DistributedSetup(), micro_batch_size=8, checkpointing=False)
    if lora:
        net = apply_lora(net, recipe.lora, gradient_checkpointing=False)
    if precision != "no":
        net = Accelerator(cpu=True, mixed_precision=precision).prepare_model(net)
    settings, gen = recipe.grpo, est.rollout.generation
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, inv.vocab_size, (sequence_len - k % 2,), generator=generator).tolist()
        for k in range(est.rollout.prompts_per_call)
    ]
    seeds = [[100 * k + j for j in range(settings.num_generations)] for k in range(len(prompts))]
    params = SamplingParams(
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
        num_return_sequences=settings.num_generations,
    )  # fmt: skip
    backend = TransformersBackend(net, _Tokenizer(), **settings.backend_options)

    def rollout():
        out = backend.generate(prompts, params, seeds=seeds, batch_size=settings.generation_batch_size)
        assert all(len(c.ids) == settings.max_new_tokens for row in out for c in row)

    rollout()  # lazy initialisations out of the way
    measured = peak_allocated_bytes(rollout)
    if (
        mixed == "bf16"
    ):  # CPU only: the prompt forward's last-position logits through a frozen bf16 head make one copy
        # of its weight per prompt (bmm of a strided input on CPU); here they stay below the peak
        assert est.rollout.prompts_per_call * inv.vocab_size * inv.hidden_size * 2 < gen.peak / 2
    print(f"generation peak predicted / measured: {gen.peak:,.0f} / {measured:,} = {gen.peak / measured:.4f}")
    assert gen.peak == pytest.approx(measured, rel=0.02)


def test_predicted_logprob_pass_matches_cpu():
    """The log-prob pass without gradient over one packed row of 8 completions (the reference's and the
    sampling policy's): logits and their tempered copy dominate with a 4000-token vocabulary."""
    from finetune.objectives.rollout import token_logps_at

    net = _net({"vocab_size": 4000})
    inv = inventory_of(net)
    tokens = 8 * (16 + 48)
    ids = torch.randint(4, 4000, (1, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(64).repeat(8)[None], "labels": ids}

    def forward():
        with torch.no_grad():
            token_logps_at(net, batch, temperature=0.7)

    forward()
    measured = peak_allocated_bytes(forward)
    predicted = logprob_pass_bytes(
        inv, tokens=tokens, residual_bytes=4, compute_bytes=4, autocast=False,
        attn_implementation="sdpa", temperature=0.7,
    )  # fmt: skip
    print(f"log-prob pass predicted / measured: {predicted:,.0f} / {measured:,} = {predicted / measured:.4f}")
    assert predicted == pytest.approx(measured, rel=0.02)


# ---------------------------------------------------------------- log-prob passes, reference, sharding


def test_logprob_passes_and_the_reference():
    """beta > 0 with full fine-tuning: a frozen copy of the weights in the training table (stays through
    the rollout too); LoRA: none. The reference's and old log-probs' passes appear with beta > 0,
    num_iterations > 1 or a KL paid from the reward."""
    full = _recipe(grpo={"beta": 0.04, "num_iterations": 2})
    inv, est = _single(full)
    reference = next(p for p in est.parts if p.name == "reference model")
    assert reference.gpu_bytes == 4 * inv.total and "grpo.beta 0.04" in reference.note
    weights = next(p for p in est.parts if p.name == "weights").gpu_bytes
    optimizer = next(p for p in est.parts if p.name == "optimizer states").gpu_bytes
    assert est.rollout.resident == weights + optimizer + reference.gpu_bytes + GiB  # + the CUDA allowance
    passes = [p for p in est.rollout.parts + est.rollout.other if p.name == "log-prob passes (rollout)"]
    assert len(passes) == 1 and "reference's" in passes[0].note and "num_iterations 2" in passes[0].note
    assert passes[0].gpu_bytes == logprob_pass_bytes(
        inv, tokens=2 * 16 + 8 * 32, residual_bytes=4, compute_bytes=4, autocast=False, attn_implementation="sdpa",
        temperature=1.0,
    )  # fmt: skip
    _, lora = _single(_recipe(grpo={"beta": 0.04}, lora={"enable_lora": True}))
    assert "reference model" not in [p.name for p in lora.parts]
    assert any(p.name == "log-prob passes (rollout)" for p in lora.rollout.parts + lora.rollout.other)
    _, rloo = _single(_recipe(grpo={"beta": 0.05}, train={"objective": "rloo"}, lora={"enable_lora": True}))
    assert "kl_in_reward" in next(
        p.note for p in rloo.rollout.parts + rloo.rollout.other if "log-prob" in p.name
    )
    _, none = _single(_recipe())
    assert not any("log-prob" in p.name for p in none.rollout.parts + none.rollout.other)


@pytest.mark.parametrize("kind", ["deepspeed", "fsdp"])
def test_sharded_generation_gather_and_layerwise(kind):
    """ZeRO-3 / FSDP2 with LoRA in bf16: gather holds one whole copy of the weights (LoRA's too) in the
    gathered dtype beside the shards for the generate call; layerwise the units one forward gathers (the
    training working set without gradients)."""
    from finetune.plan.states import gathered_bytes

    lora = {"enable_lora": True}
    train = {"mixed_precision": "bf16"}
    engine = DistributedSetup(kind, num_processes=8, zero_stage=3)
    gather = _recipe(lora=lora, train=train, model={"torch_dtype": "auto"})
    inv, est = _single(gather, engine)
    whole = next(p for p in est.rollout.parts if p.name == "whole weights (generate)")
    assert whole.gpu_bytes == 2 * (inv.total + est.layout.states.trainable_params)
    layerwise = _recipe(
        lora=lora, train=train, model={"torch_dtype": "auto"}, grpo={"sharded_generation": "layerwise"}
    )
    _, est = _single(layerwise, engine)
    layers = next(p for p in est.rollout.parts if p.name == "gathered layers (generate)")
    assert layers.gpu_bytes == gathered_bytes(inv, est.layout, engine, 0.0).gpu_bytes < whole.gpu_bytes
    if kind == "fsdp":  # FSDP2's root unit (embeddings, lm_head) stays whole for the call
        assert layers.gpu_bytes >= 2 * inv.non_layer_params
    # ZeRO-1/2 and DDP keep whole weights: nothing to gather
    _, plain = _single(gather, DistributedSetup("deepspeed", num_processes=8, zero_stage=2))
    gathers = ("whole weights (generate)", "gathered layers (generate)")
    assert not any(p.name in gathers for p in plain.rollout.parts)
    merging = _recipe(lora=lora, train=train, model={"torch_dtype": "auto"}, grpo={"merged_generation": True})
    _, merged = _single(merging, DistributedSetup("deepspeed", num_processes=8, zero_stage=2))
    assert any(p.name == "merged LoRA weights (generate)" for p in merged.rollout.parts)  # whole: it merges
    _, sharded = _single(merging, engine)
    assert not any(p.name == "merged LoRA weights (generate)" for p in sharded.rollout.parts)  # shards: not


def test_merged_generation_by_default_on_cpu_processes_only():
    """grpo.merged_generation null (the default) merges where the backend runs on the CPU: the planner
    counts the merged copies for CPU processes, not for GPUs; false never, true on a GPU too."""
    lora = {"enable_lora": True}

    def merges(grpo, engine):
        _, est = _single(_recipe(lora=lora, grpo=grpo), engine)
        return any(p.name == "merged LoRA weights (generate)" for p in est.rollout.parts)

    cpu, gpu = DistributedSetup(use_cpu=True), DistributedSetup()
    assert merges({}, cpu) and not merges({}, gpu)
    assert not merges({"merged_generation": False}, cpu) and merges({"merged_generation": True}, gpu)


# -------------------------------------------------------------------------------------- vLLM's share


def test_vllm_share_is_not_training_s():
    """With vLLM the engine's share (vllm_gpu_memory_utilization x the device) is its own: the training
    step and the rollout must fit in the rest; with sleep mode the training step has the whole device
    (the engine is asleep), the rollout the rest; an engine share too small for its weights and one
    sequence does not fit. A 64k vocabulary makes the training step's logits larger than the rollout."""
    vocab = {"vocab_size": 64000}
    recipe = _recipe(vocab, grpo={"generation_backend": "vllm", "vllm_gpu_memory_utilization": 0.3})
    inv, est = _single(recipe)
    training, rollout = est.training_gpu, est.rollout.total_gpu
    assert est.rollout.generation is None and training > rollout / 0.7 * 0.8
    assert est.rollout.parts == ()  # the engine generates in its own share; nothing sharded to gather
    memory = training / 0.8  # the training step fits the device, not the 70% vLLM leaves
    assert est.headroom(memory) == pytest.approx(0.7 * memory - training)
    plan = make_plan(recipe, inventory=inv, gpu_memory=f"{memory / GiB:.6f}GiB")
    assert not plan.fits
    text = format_plan(plan)
    assert (
        "vLLM engine" in text and "beside vLLM's" in text and "grpo.vllm_gpu_memory_utilization 0.3" in text
    )
    assert "the online loss takes full logits" in text and "--train.loss_chunk_size" not in text  # SFT's
    assert make_plan(recipe, inventory=inv, gpu_memory=f"{training / 0.69 / GiB:.6f}GiB").fits
    asleep = _recipe(vocab, grpo={"generation_backend": "vllm", "vllm_enable_sleep_mode": True})
    _, est = _single(asleep)
    assert est.headroom(memory) == pytest.approx(min(memory - training, 0.7 * memory - rollout))
    assert make_plan(asleep, inventory=inv, gpu_memory=f"{memory / GiB:.6f}GiB").fits
    minimum = est.rollout.vllm_minimum
    assert minimum == inv.total * 4 + 2 * 2 * 2 * 16 * 4 * (16 + 32)  # fp32 weights + one sequence's KV
    assert est.rollout.vllm_weights == inv.total * 4
    tiny_share = _recipe(vocab, grpo={"generation_backend": "vllm", "vllm_gpu_memory_utilization": 0.01})
    _, est = _single(tiny_share)
    small = minimum * 90  # room for training, but 1% of it is below the engine's minimum
    assert 0.99 * small > est.training_gpu
    assert est.headroom(small) == pytest.approx(0.01 * small - minimum) and est.headroom(small) < 0


def _kv_bound(generation_batch_size: int) -> Recipe:
    """Many long completions on a short training micro-batch: the KV cache outweighs the training step."""
    return _recipe(
        grpo={"max_new_tokens": 512, "generation_batch_size": generation_batch_size, "num_generations": 8},
        train={"micro_batch_size": 1, "gradient_accumulation_steps": 64},
    )


def test_the_rollout_sets_the_peak_and_a_smaller_generation_batch_is_offered():
    """A rollout larger than the training step: the step's peak is the rollout's, and when nothing fits
    the suggestion names the largest generation_batch_size that does."""
    inv, est = _single(_kv_bound(8))
    assert est.rollout.total_gpu > est.training_gpu and est.total_gpu == est.rollout.total_gpu
    assert est.rollout.generation.sequences == 64
    _, three = _single(_kv_bound(3))
    memory = (three.total_gpu + est.total_gpu) / 2
    plan = make_plan(_kv_bound(8), inventory=inv, gpu_memory=f"{memory / GiB:.6f}GiB")
    assert not plan.fits
    largest = max(k for k in range(1, 8) if _single(_kv_bound(k))[1].headroom(memory) >= 0)
    assert 3 <= largest < 8
    assert any(f"--grpo.generation_batch_size {largest} " in line for line in plan.suggestion.lines)
    assert "peak of a step" in format_plan(plan) and "the rollout's" in format_plan(plan)


# --------------------------------------------------------------------------- the CLI, and the pins


def test_cli_plan_online_demo(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "recipes/demo/tiny_grpo_cpu.yaml", "--gpu-memory", "24GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    online = plan["online"]
    assert plan["total_gpu_bytes"] == max(
        online["training_step_gpu_bytes"], online["rollout"]["total_gpu_bytes"]
    )
    assert online["rollout"]["generation"]["sequences"] == 16  # 4 prompts a step x 4 completions
    assert plan["batch"]["seq_len"] == 2 * 64 + 8 * 12  # 2 prompts x 4 completions, each prompt once
    assert main(["plan", "recipes/demo/tiny_grpo_cpu.yaml"]) == 0
    text = capsys.readouterr().out
    assert "total (training step)" in text and "total (rollout)" in text and "KV cache" in text


def test_training_prediction_of_an_online_recipe():
    """What `finetune train` records for an online run: the training step's parts, the rollout's, and
    the larger total."""
    from finetune.plan import training_prediction

    recorded = training_prediction(_recipe(), DistributedSetup("single"))
    assert recorded["total_gpu_bytes"] == max(
        recorded["training_step_gpu_bytes"], recorded["rollout_gpu_bytes"]
    )
    assert recorded["rollout_gpu_bytes"] == pytest.approx(
        sum(p["gpu_bytes"] for p in recorded["rollout_parts"])
    )
    json.dumps(recorded)


def test_the_run_report_shows_the_rollout_beside_the_training_step(tmp_path):
    """`finetune report` lists what training recorded for an online run: the training step's parts, the
    rollout's, and the larger total as the prediction it sets beside the measured peak."""
    from finetune.plan import training_prediction
    from finetune.report import build_report

    recorded = training_prediction(_recipe(), DistributedSetup("single"))
    run = tmp_path / "grpo"
    run.mkdir()
    (run / "recipe.resolved.yaml").write_text("model:\n  model_path: null\ntrain:\n  objective: grpo\n")
    started = {"step": 0, "event": "started", "memory_plan": recorded, "device": "cuda"}
    (run / "progress.jsonl").write_text(
        json.dumps(started) + "\n" + json.dumps({"step": 1, "loss": 0.1}) + "\n"
    )
    page = build_report([str(run)], str(tmp_path / "report.html")).read_text()
    memory = page.split('<section id="memory">')[1].split("</section>")[0]
    assert "rollout: KV cache (generate)" in memory and "rollout: stays through the rollout" in memory
    assert "training step" in memory and "total predicted per device" in memory


LLAMA3 = json.dumps(
    {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    }
)  # fmt: skip
PINNED = {  # pin file: argv of `finetune plan`, as printed before online RL was planned (commit aa1f396)
    "tiny_dpo_cpu.txt": ["recipes/demo/tiny_dpo_cpu.yaml", "--gpu-memory", "24GiB"],
    "tiny_dpo_cpu.json": ["recipes/demo/tiny_dpo_cpu.yaml", "--gpu-memory", "24GiB", "--json"],
    "tiny_sft_cpu.txt": ["recipes/demo/tiny_sft_cpu.yaml", "--gpu-memory", "24GiB"],
    "llama3_8b_dpo_lora_zero3.txt": [
        "recipes/llama3/llama3_8b_dpo_lora.yaml", "--model.config_path", LLAMA3,
        "--model.tokenizer_path", "meta-llama/Llama-3.1-8B", "--accelerate-config", "zero3",
        "--num-gpus", "8", "--gpu-memory", "80GiB",
    ],
}  # fmt: skip


@pytest.mark.parametrize("pin", PINNED)
def test_other_objectives_plan_as_before(capsys, monkeypatch, pin):
    """A recipe whose objective is not online prints exactly what it printed before the rollout was
    planned (SFT, and DPO, whose reference the planner does not count yet)."""
    monkeypatch.chdir(REPO)
    assert main(["plan", *PINNED[pin]]) == 0
    assert capsys.readouterr().out == (PINS / pin).read_text()
