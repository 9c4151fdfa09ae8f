"""finetune.plan: ZeRO paper figures, engine detection, LoRA/QLoRA counts, activations measured on CPU,
the micro-batch suggestion, and `finetune plan` on the shipped recipes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from finetune.accelerate_config import DistributedSetup
from finetune.cli import main
from finetune.data.batching.collate import collate_rows
from finetune.errors import FinetuneError
from finetune.plan import (
    Adapter,
    GiB,
    ModelInventory,
    States,
    activation_bytes,
    adapter_counts,
    estimate,
    gpu_memory_bytes,
    inventory_of,
    make_plan,
    model_states,
    qlora_bytes_per_param,
    shard_states,
    suggest,
)
from finetune.recipe import LoraSection, Recipe, validate_recipe
from tests.memory import peak_allocated_bytes, saved_tensor_bytes
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]
P, N = 7_500_000_000, 64  # the ZeRO paper's Figure 1: 7.5B parameters on 64 GPUs
LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip
LLAMA3_OVERRIDES = [
    "--model.config_path", json.dumps(LLAMA3_8B), "--model.tokenizer_path", "meta-llama/Llama-3.1-8B",
]  # fmt: skip


def _recipe(train: dict | None = None, lora: dict | None = None, model: dict | None = None) -> Recipe:
    return validate_recipe(
        {
            "model": {"config_path": dict(LLAMA3_8B), "tokenizer_path": "tok", **(model or {})},
            "data": {"datasets": [{"path": "d.jsonl", "type": "alpaca"}], "sequence_len": 1024},
            "train": {"output_dir": "out", **(train or {})},
            "lora": lora or {},
        }
    )


def _bare_inventory(total: int) -> ModelInventory:
    """Counts only: enough for the model states of full fine-tuning."""
    return ModelInventory(
        total=total, num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
        num_kv_heads=8, head_dim=128, vocab_size=128256, tied=False, layer_params=0,
        embedding_params=0, output_name="lm_head",
    )  # fmt: skip


def _tiny_llama(**overrides) -> torch.nn.Module:
    fields = {
        "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }  # fmt: skip
    return tiny_model(**{**fields, **overrides})


def _total(parts) -> float:
    return sum(p.gpu_bytes for p in parts)


# ------------------------------------------------------------------------------- ZeRO paper figures


@pytest.mark.parametrize(
    ("stage", "expected_bytes", "paper_gb"),
    [
        (0, 16 * P, 120.0),
        (1, 4 * P + 12 * P / N, 31.4),
        (2, 2 * P + 14 * P / N, 16.6),
        (3, 16 * P / N, 1.9),
    ],
)
def test_zero_paper_figures(stage, expected_bytes, paper_gb):
    # Mixed-precision Adam: 2P fp16 weights + 2P grads + 12P fp32 master/momentum/variance.
    states = States(trainable_params=P, weights=2 * P, grads=2 * P, optimizer=12 * P)
    parts = shard_states(states, DistributedSetup("deepspeed", num_processes=N, zero_stage=stage))
    assert _total(parts) == pytest.approx(expected_bytes, rel=1e-12)
    assert round(_total(parts) / 1e9, 1) == paper_gb


def test_deepspeed_model_states_are_the_paper_s():
    """The planner's own byte counts for bf16 DeepSpeed + AdamW: 2P + 2P + 12P before sharding."""
    recipe = _recipe({"mixed_precision": "bf16"})
    inv = _bare_inventory(P)
    layout = model_states(
        inv,
        Adapter(),
        recipe,
        DistributedSetup("deepspeed", num_processes=N, zero_stage=0),
        checkpointing=False,
    )
    assert (layout.states.weights, layout.states.grads, layout.states.optimizer) == (2 * P, 2 * P, 12 * P)
    expected = {0: 16 * P, 1: 4 * P + 12 * P / N, 2: 2 * P + 14 * P / N, 3: 16 * P / N}
    for stage, nbytes in expected.items():
        engine = DistributedSetup("deepspeed", num_processes=N, zero_stage=stage)
        states = model_states(inv, Adapter(), recipe, engine, checkpointing=False).states
        by_part = {p.name: p.gpu_bytes for p in shard_states(states, engine)}
        assert sum(by_part.values()) == pytest.approx(nbytes, rel=1e-12)
    zero1 = {
        p.name: p.gpu_bytes
        for p in shard_states(states, DistributedSetup("deepspeed", num_processes=N, zero_stage=1))
    }
    assert zero1 == pytest.approx({"weights": 2 * P, "gradients": 2 * P, "optimizer states": 12 * P / N})


def test_ddp_and_fsdp_hold_fp32_weights_without_deepspeed():
    """torch_dtype auto + bf16: fp32 weights, fp32 grads, fp32 AdamW states = 16P, sharded 16P/N by FSDP."""
    recipe = _recipe({"mixed_precision": "bf16"})
    inv = _bare_inventory(P)
    ddp = model_states(
        inv, Adapter(), recipe, DistributedSetup("ddp", num_processes=8), checkpointing=False
    ).states
    assert (ddp.weights, ddp.grads, ddp.optimizer) == (4 * P, 4 * P, 8 * P)
    assert _total(shard_states(ddp, DistributedSetup("ddp", num_processes=8))) == 16 * P
    fsdp = DistributedSetup("fsdp", num_processes=8, zero_stage=3)
    states = model_states(inv, Adapter(), recipe, fsdp, checkpointing=False).states
    assert _total(shard_states(states, fsdp)) == pytest.approx(16 * P / 8)
    sgd = _recipe({"mixed_precision": "bf16", "optimizer": "sgd"})
    assert model_states(inv, Adapter(), sgd, fsdp, checkpointing=False).states.optimizer == 0


def test_offload_moves_states_to_the_host():
    states = States(trainable_params=P, weights=2 * P, grads=2 * P, optimizer=12 * P)
    zero2 = {
        p.name: p
        for p in shard_states(
            states, DistributedSetup("deepspeed", num_processes=8, zero_stage=2, offload_optimizer="cpu")
        )
    }
    assert zero2["weights"].gpu_bytes == 2 * P and zero2["optimizer states"].gpu_bytes == 0
    assert zero2["optimizer states"].host_bytes == 12 * P / 8
    assert zero2["gradients"].host_bytes == 4 * P / 8  # the fp32 gradient partition
    zero3 = DistributedSetup(
        "deepspeed", num_processes=8, zero_stage=3, offload_optimizer="cpu", offload_params="cpu"
    )
    assert _total(shard_states(states, zero3)) == 0
    fsdp = DistributedSetup(
        "fsdp", num_processes=8, zero_stage=3, offload_optimizer="cpu", offload_params="cpu"
    )
    assert sum(p.host_bytes for p in shard_states(states, fsdp)) == pytest.approx(16 * P / 8)


# --------------------------------------------------------------------------------- engine detection


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------- LoRA / QLoRA


@pytest.mark.parametrize(
    "lora",
    [
        {"lora_target_modules": "all-linear"},
        {"lora_target_modules": ["q_proj", "v_proj"], "lora_rank": 8},
        {"lora_target_modules": "all-linear", "modules_to_save": ["lm_head", "embed_tokens"]},
        {"lora_target_modules": ["q_proj", "down_proj"], "use_dora": True},
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_lora_counts_equal_peft(lora, tied):
    from peft import LoraConfig, get_peft_model

    section = LoraSection(enable_lora=True, **lora)
    net = _tiny_llama(num_hidden_layers=2, tie_word_embeddings=tied)
    inv = inventory_of(net)
    assert inv.total == sum(p.numel() for p in net.parameters()) and inv.tied == tied
    adapter = adapter_counts(inv, section)
    peft_model = get_peft_model(
        net,
        LoraConfig(
            r=section.lora_rank,
            target_modules=section.lora_target_modules,
            modules_to_save=section.modules_to_save or None,
            use_dora=section.use_dora,
            task_type="CAUSAL_LM",
        ),
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert adapter.trainable == trainable


def test_lora_target_errors():
    inv = inventory_of(_tiny_llama(num_hidden_layers=1))
    with pytest.raises(FinetuneError, match="no module"):
        adapter_counts(inv, LoraSection(enable_lora=True, lora_target_modules=["query"]))
    with pytest.raises(FinetuneError, match="not Linear"):
        adapter_counts(inv, LoraSection(enable_lora=True, lora_target_modules=["input_layernorm"]))


def test_qlora_bytes():
    assert qlora_bytes_per_param(double_quant=False) == 0.5 + 4 / 64
    assert qlora_bytes_per_param(double_quant=True) == 0.5 + 1 / 64 + 4 / (64 * 256)
    net = _tiny_llama(num_hidden_layers=2)
    inv = inventory_of(net)
    recipe = _recipe(
        {"mixed_precision": "bf16"}, {"enable_qlora": True, "double_quant": True}, {"torch_dtype": "bf16"}
    )
    adapter = adapter_counts(inv, recipe.lora)
    states = model_states(inv, adapter, recipe, DistributedSetup(), checkpointing=True).states
    linear = sum(
        m.weight.numel() for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    )
    # 4-bit linears; embeddings, norms and lm_head in fp32 (prepare_model_for_kbit_training upcasts them)
    assert states.frozen == pytest.approx(linear * qlora_bytes_per_param(True) + 4 * (inv.total - linear))
    assert states.weights == 4 * adapter.lora_params


# -------------------------------------------------------------------------------------- activations


def _activations(inv: ModelInventory, micro: int, attn: str = "sdpa", seq: int = 512):
    return activation_bytes(
        inv, micro_batch_size=micro, seq_len=seq, attn_implementation=attn, residual_bytes=4,
        compute_bytes=2, autocast=True,
    )  # fmt: skip


def test_activations_checkpointing_and_batch_scaling():
    inv = inventory_of(_tiny_llama())
    one, two, three = (_activations(inv, m) for m in (1, 2, 3))
    assert one.peak(True) < one.peak(False)
    assert two.saved == pytest.approx(2 * one.saved)  # linear in the micro batch
    assert three.peak(False) - two.peak(False) == pytest.approx(two.peak(False) - one.peak(False))
    assert three.peak(True) - two.peak(True) == pytest.approx(two.peak(True) - one.peak(True))
    long_eager, long_sdpa = _activations(inv, 1, "eager", 2048), _activations(inv, 1, "sdpa", 2048)
    assert long_eager.per_layer > 2 * long_sdpa.per_layer  # the s^2 attention probabilities


def _packed_batch(rows: int, seq: int, vocab: int) -> dict:
    """Packed rows as training sees them: two sequences per row, position_ids restarting."""
    torch.manual_seed(1)
    first = seq // 3
    samples = [
        {
            "input_ids": torch.randint(0, vocab, (seq,)).tolist(),
            "labels": torch.randint(0, vocab, (seq,)).tolist(),
            "position_ids": list(range(first)) + list(range(seq - first)),
        }
        for _ in range(rows)
    ]
    return collate_rows(samples, pad_token_id=0, packed=True)


@pytest.mark.parametrize(
    ("attn", "train", "lora", "model"),
    [
        ("sdpa", {"mixed_precision": "no"}, {}, {"torch_dtype": "fp32"}),
        ("eager", {"mixed_precision": "no"}, {}, {"torch_dtype": "fp32"}),
        ("sdpa", {"mixed_precision": "bf16"}, {}, {}),  # fp32 weights, bf16 autocast
        ("sdpa", {"mixed_precision": "bf16"}, {"enable_lora": True}, {"torch_dtype": "bf16"}),
    ],
)
def test_predicted_activations_match_saved_tensors(attn, train, lora, model):
    """The formula against what autograd really saves in a packed forward on CPU (within 1%: it
    matches to a few bytes; LoRA's dropout-free inputs within 0.1%)."""
    from finetune.model.adapters import apply_lora

    recipe = _recipe(train, lora, {"attn_implementation": attn, **model})
    net = _tiny_llama(
        attn=attn, dtype=torch.bfloat16 if model.get("torch_dtype") == "bf16" else torch.float32
    )
    inv = inventory_of(net)
    if recipe.lora.enable_lora:
        net = apply_lora(net, recipe.lora, gradient_checkpointing=False)
    net.train()
    micro, seq = 2, 512
    measured = saved_tensor_bytes(
        net, _packed_batch(micro, seq, inv.vocab_size), autocast=train["mixed_precision"] != "no"
    )
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"sequence_len": seq})})
    est = estimate(inv, recipe, DistributedSetup(), micro_batch_size=micro, checkpointing=False)
    predicted = est.activations.saved + est.layout.autocast_copies  # autocast's weight casts are saved too
    assert predicted == pytest.approx(measured, rel=0.01)


# ----------------------------------------------------------------- logits + loss, peak measured on CPU


def test_the_memory_probe_sees_the_three_cross_entropy_buffers():
    """The peak of the bare cross entropy: its fp32 log-softmax (saved for backward), NLL's gradient
    and log-softmax's gradient are alive together in backward, three [tokens x vocab] buffers."""
    torch.manual_seed(0)
    logits = torch.randn(256, 4096, requires_grad=True)
    labels = torch.randint(0, 4096, (256,))
    peak = peak_allocated_bytes(
        lambda: torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
    )
    assert peak == pytest.approx(3 * 4 * 256 * 4096, rel=1e-4)
    assert peak_allocated_bytes(lambda: torch.ones(1024, 256) + 1) == pytest.approx(
        2 * 4 * 1024 * 256, abs=64
    )


BF16_LORA, HEAD_LORA = (
    {"enable_lora": True},
    {"enable_lora": True, "lora_target_modules": ["q_proj", "lm_head"]},
)
LOSS_CASES = {  # id: train, lora, model, hidden size
    "fp32": ({"mixed_precision": "no"}, {}, {"torch_dtype": "fp32"}, 16),
    "bf16-autocast": ({"mixed_precision": "bf16"}, {}, {}, 16),  # fp32 weights, Accelerate's autocast
    "lora-bf16": ({"mixed_precision": "bf16"}, BF16_LORA, {"torch_dtype": "bf16"}, 16),
    "chunked-fp32": ({"mixed_precision": "no", "loss_chunk_size": 64}, {}, {"torch_dtype": "fp32"}, 16),
    "chunked-lora": ({"mixed_precision": "bf16", "loss_chunk_size": 64}, BF16_LORA, {"torch_dtype": "bf16"}, 16),
    # the fused path into a trained head with 16-bit matmuls: d_weight's [V x h] products count
    "chunked-bf16-head": ({"mixed_precision": "bf16", "loss_chunk_size": 16}, {}, {}, 128),
    # LoRA on lm_head: the checkpointed path
    "chunked-lora-head": ({"mixed_precision": "bf16", "loss_chunk_size": 64}, HEAD_LORA, {"torch_dtype": "bf16"}, 16),
}  # fmt: skip


@pytest.mark.parametrize(("train", "lora", "model", "hidden"), LOSS_CASES.values(), ids=LOSS_CASES)
def test_predicted_peak_matches_cpu_with_a_large_vocabulary(
    fresh_accelerator_state, train, lora, model, hidden
):
    """A 32k vocabulary on a small hidden size, so the logits + loss term is most of the activations:
    the formula's peak (no checkpointing) against the most bytes alive in one forward and backward on
    CPU, with the loss the SFT objective computes (model(...).loss, or causal_lm_loss when chunked) on
    a model prepared by Accelerate as training prepares it (bf16: autocast, outputs cast to fp32)."""
    from accelerate import Accelerator

    from finetune.losses.causal_lm import forward
    from finetune.losses.chunked_ce import causal_lm_loss
    from finetune.model.adapters import apply_lora

    vocab, seq, chunk = 32768, 256, train.get("loss_chunk_size", 0)
    recipe = _recipe({"loss_chunk_size": 0, **train}, lora, model)
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"sequence_len": seq})})
    net = _tiny_llama(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
        dtype=torch.bfloat16 if model.get("torch_dtype") == "bf16" else torch.float32,
    )  # fmt: skip
    inv = inventory_of(net)
    if recipe.lora.enable_lora:
        net = apply_lora(net, recipe.lora, gradient_checkpointing=False)
    net = Accelerator(cpu=True, mixed_precision=train["mixed_precision"]).prepare_model(net.train())
    batch = _packed_batch(1, seq, vocab)
    num_items = (batch["labels"][:, 1:] != -100).sum()

    def step():
        if chunk:
            loss = causal_lm_loss(net, batch, num_items=num_items, chunk_size=chunk)
        else:
            loss = forward(net, batch, num_items=num_items).loss
        loss.backward()

    measured = peak_allocated_bytes(step)
    est = estimate(inv, recipe, DistributedSetup(), micro_batch_size=1, checkpointing=False)
    acts = est.activations
    assert acts.logits_and_loss > 0.6 * acts.peak(False)  # what this test is about
    predicted = acts.peak(False) + est.layout.autocast_copies  # autocast's weight casts are saved too
    if chunk and est.layout.compute_bytes != 4 and not recipe.lora.enable_lora:
        # CPU only: `fp32 d_weight += 16-bit product` makes an fp32 copy of the product first (CPU
        # kernels cast inputs to the common dtype in a temporary; CUDA kernels cast as they read).
        predicted += 4 * vocab * hidden
    assert predicted == pytest.approx(measured, rel=0.01)


# ---------------------------------------------------------------------------------------- suggestion


def test_suggestion_keeps_the_global_batch():
    inv = inventory_of(_tiny_llama())
    recipe = _recipe({"micro_batch_size": 2, "gradient_accumulation_steps": 6, "mixed_precision": "bf16"})
    engine = DistributedSetup("ddp", num_processes=4)
    roomy = suggest(inv, recipe, engine, 80 * GiB)
    assert roomy.global_batch == 2 * 6 * 4
    assert (roomy.micro_batch_size, roomy.gradient_accumulation_steps) == (12, 1)
    sizes = {
        m: estimate(inv, recipe, engine, micro_batch_size=m, checkpointing=False).total_gpu
        for m in (1, 2, 3, 4, 6)
    }
    tight = suggest(inv, recipe, engine, (sizes[3] + sizes[4]) / 2)
    assert (tight.micro_batch_size, tight.gradient_accumulation_steps) == (3, 4)
    assert tight.micro_batch_size * tight.gradient_accumulation_steps * 4 == tight.global_batch
    assert not tight.gradient_checkpointing


def test_suggestion_turns_on_checkpointing_then_names_other_engines():
    inv = inventory_of(_tiny_llama())
    recipe = _recipe({"micro_batch_size": 1, "gradient_accumulation_steps": 2})
    engine = DistributedSetup("single")
    no_ckpt = estimate(inv, recipe, engine, micro_batch_size=1, checkpointing=False).total_gpu
    ckpt = estimate(inv, recipe, engine, micro_batch_size=1, checkpointing=True).total_gpu
    ckpt_two = estimate(inv, recipe, engine, micro_batch_size=2, checkpointing=True).total_gpu
    advice = suggest(inv, recipe, engine, (ckpt + min(no_ckpt, ckpt_two)) / 2)  # only micro 1 with it
    assert advice.gradient_checkpointing and advice.micro_batch_size == 1
    assert any("--train.gradient_checkpointing true" in line for line in advice.lines)
    stuck = suggest(inv, recipe, engine, ckpt - 1)
    assert stuck.micro_batch_size is None
    assert stuck.alternatives and stuck.alternatives[0]["total_gpu_bytes"] <= ckpt - 1
    assert any("zero" in a["name"] or "fsdp" in a["name"] or a["name"] == "qlora" for a in stuck.alternatives)


# ------------------------------------------------------------------------------------------- the CLI


def test_gpu_memory_parsing():
    assert gpu_memory_bytes("80GiB")[0] == 80 * 2**30
    assert gpu_memory_bytes("80GB")[0] == 80 * 10**9
    assert gpu_memory_bytes("24GiB")[0] == 24 * 2**30
    assert gpu_memory_bytes("81920MiB")[0] == 80 * 2**30
    with pytest.raises(FinetuneError, match="unit"):
        gpu_memory_bytes("80")
    if not torch.cuda.is_available():
        assert gpu_memory_bytes(None) == (
            80 * 2**30,
            "default 80 GiB: no CUDA device visible (set --gpu-memory)",
        )


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_plan_demo_recipe(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = _plan_json(capsys, "recipes/demo/tiny_sft_cpu.yaml", "--gpu-memory", "24GiB")
    assert plan["engine"]["name"] == "single" and plan["fits"]
    assert plan["model"]["params_total"] == 574_080
    assert plan["gpu_memory_bytes"] == 24 * GiB
    assert plan["total_gpu_bytes"] == pytest.approx(sum(p["gpu_bytes"] for p in plan["parts"]))
    acts = plan["activations"]
    assert acts["with_checkpointing_bytes"] < acts["without_checkpointing_bytes"]
    assert plan["suggestion"]["micro_batch_size"] * plan["suggestion"]["gradient_accumulation_steps"] == 4
    assert main(["plan", "recipes/demo/tiny_sft_cpu.yaml"]) == 0
    text = capsys.readouterr().out
    assert "fits in 80.00 GiB" in text and "assumptions:" in text and "<- recipe" in text


def test_cli_plan_reports_an_unreachable_config(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "recipes/llama3/llama3_8b_lora.yaml"]) == 2
    assert "--model.config_path" in capsys.readouterr().err


@pytest.mark.parametrize(
    "recipe", ["llama3_8b_full_fsdp2.yaml", "llama3_8b_lora.yaml", "llama3_8b_qlora_24gb.yaml"]
)
def test_cli_plan_llama3_recipes(capsys, monkeypatch, recipe):
    monkeypatch.chdir(REPO)
    plan = _plan_json(capsys, f"recipes/llama3/{recipe}", *LLAMA3_OVERRIDES, "--gpu-memory", "80GiB")
    assert plan["model"]["params_total"] == pytest.approx(8.03e9, rel=0.005)
    if "lora" in recipe:  # r=16 on every linear but lm_head: 41,943,040
        assert plan["model"]["lora_params"] == 16 * 32 * (
            2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)
        )


def test_llama3_full_finetune_per_engine(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    zero3 = _write(
        tmp_path / "z3.yaml",
        f"distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'zero3.json'}\n",
    )
    fsdp2 = _write(
        tmp_path / "f.yaml", "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
    )
    ddp = _write(tmp_path / "d.yaml", "distributed_type: MULTI_GPU\nnum_processes: 8\n")
    args = ["recipes/llama3/llama3_8b_full_fsdp2.yaml", *LLAMA3_OVERRIDES, "--gpu-memory", "80GiB"]
    plans = {
        name: _plan_json(capsys, *args, "--accelerate-config", str(path))
        for name, path in {"ddp": ddp, "zero3": zero3, "fsdp2": fsdp2}.items()
    }
    params = plans["ddp"]["model"]["params_total"]

    def states(plan) -> float:
        return sum(p["gpu_bytes"] + p["host_bytes"] for p in plan["parts"][:3])

    assert states(plans["ddp"]) == 16 * params  # fp32 weights + grads + AdamW
    assert states(plans["fsdp2"]) == pytest.approx(16 * params / 8)
    assert states(plans["zero3"]) == pytest.approx(16 * params / 8)  # bf16 + bf16 + fp32 master/m/v
    assert not plans["ddp"]["fits"] and plans["fsdp2"]["fits"] and plans["zero3"]["fits"]
    assert plans["ddp"]["suggestion"]["alternatives"]
    assert math.isclose(plans["fsdp2"]["gpu_memory_bytes"], 80 * GiB)
    # --num-gpus overrides the config's num_processes: 16 GPUs halve the sharded states
    sixteen = _plan_json(capsys, *args, "--accelerate-config", str(fsdp2), "--num-gpus", "16")
    assert states(sixteen) == pytest.approx(states(plans["fsdp2"]) / 2)


def test_make_plan_rejects_diffusion_recipes():
    recipe = _recipe()
    if "kind" not in type(recipe.model).model_fields:
        pytest.skip("model.kind not in this Recipe")
    diffusion = recipe.model_copy(update={"model": recipe.model.model_copy(update={"kind": "diffusion"})})
    with pytest.raises(FinetuneError, match="LLM recipes"):
        make_plan(diffusion)


def test_cli_plan_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--accelerate-config", "--num-gpus", "--num-nodes", "--gpu-memory", "--json"):
        assert flag in out


def test_training_prediction_is_the_plan_of_the_recipe_and_says_why_when_there_is_none(monkeypatch):
    """What `finetune train` records in progress.jsonl ("started" record, memory_plan): the parts and
    total of `finetune plan` for the same recipe and engine; a model the planner refuses is a reason,
    and no failure of the planner stops training (finetune.train.memory_plan)."""
    import finetune.plan.inventory
    from finetune.plan import training_prediction
    from finetune.train import memory_plan

    recipe = _recipe({"micro_batch_size": 2})
    recorded = training_prediction(recipe, DistributedSetup("single"))
    plan = make_plan(recipe)
    assert recorded["total_gpu_bytes"] == plan.estimate.total_gpu and recorded["micro_batch_size"] == 2
    assert [p["name"] for p in recorded["parts"]] == [p.name for p in plan.estimate.parts]
    json.dumps(recorded)  # plain data, as progress.jsonl needs

    def refuse(model):
        raise FinetuneError(
            "model config (X) lacks hidden_size: the planner handles Llama-style decoder models"
        )

    monkeypatch.setattr(finetune.plan.inventory, "inspect_model", refuse)
    assert training_prediction(recipe, DistributedSetup("single")) == {
        "unavailable": "model config (X) lacks hidden_size: the planner handles Llama-style decoder models"
    }

    def broken(model):
        raise KeyError("num_layers")

    monkeypatch.setattr(finetune.plan.inventory, "inspect_model", broken)
    assert memory_plan(recipe) == {"unavailable": "the planner failed: KeyError: 'num_layers'"}
