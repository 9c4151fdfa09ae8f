"""The planner under tensor, sequence and context parallel and activation offloading
(finetune.plan.parallel): states divided by the TP plan, activations and logits by the sequence shards,
offloaded activations on the host, and `finetune plan --sequence-len` recommending sequence parallel
when activations dominate. (What autograd saves on a sequence-parallel rank is compared with the
activation term in tests/integration/test_sequence_parallel.py: it needs 2 processes.)"""

from __future__ import annotations

import json

import pytest

from finetune.accelerate_config import DistributedSetup
from finetune.cli import main
from finetune.plan import estimate
from finetune.plan.activations import activation_bytes
from finetune.plan.inventory import inspect_model
from finetune.plan.parallel import Split, offloaded_bytes, planned_fraction, shard_len, tensor_view
from finetune.recipe import validate_recipe

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}  # fmt: skip
DDP8 = DistributedSetup("ddp", num_processes=8)
FSDP8 = DistributedSetup("fsdp", num_processes=8, zero_stage=3)


def recipe(train: dict | None = None, data: dict | None = None):
    return validate_recipe(
        {
            "model": {"config_path": dict(LLAMA3_8B), "tokenizer_path": "tok", "attn_implementation": "sdpa"},
            "data": {
                "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                "sequence_len": 8192,
                **(data or {}),
            },
            "train": {
                "output_dir": "out",
                "mixed_precision": "bf16",
                "gradient_checkpointing": True,
                **(train or {}),
            },
        }
    )


def parts(r, engine) -> dict[str, object]:
    est = estimate(inspect_model(r.model), r, engine, micro_batch_size=1, checkpointing=True)
    return {p.name: p for p in est.parts}


def test_tensor_parallel_divides_the_planned_weights_and_their_states():
    # Full logits in both: training under TP never chunks the loss (the plan splits the head it replaces).
    whole, split = (
        parts(recipe({"loss_chunk_size": 0}), DDP8),
        parts(recipe({"tensor_parallel_size": 8}), DDP8),
    )
    inv = inspect_model(recipe().model)
    share = planned_fraction(inv)
    assert 0.999 < share < 1  # every Linear and the embeddings; the norms stay whole
    for name in ("weights", "gradients", "optimizer states"):
        assert split[name].gpu_bytes == pytest.approx(whole[name].gpu_bytes * (1 - share + share / 8))
    assert "DDP gradient buckets" in whole and "DDP gradient buckets" not in split  # TP runs without DDP
    # Activations: heads and MLP columns / 8, the residual stream and norms whole: less, not an 8th.
    per_layer = [
        estimate(inv, recipe(train), DDP8, micro_batch_size=1, checkpointing=True).activations.per_layer
        for train in ({"loss_chunk_size": 0}, {"tensor_parallel_size": 8})
    ]
    assert per_layer[0] / 8 < per_layer[1] < 0.6 * per_layer[0]  # the mask, norms and inputs stay whole
    assert split["logits + loss"].gpu_bytes == whole["logits + loss"].gpu_bytes  # the head gathers them


def test_tensor_parallel_with_data_parallel_shards_the_states_over_the_groups():
    """TP=2 on 8 processes: transformers' FSDP2 shards each rank's TP shards over the 4 groups (weights,
    gradients, optimizer states / 4) and gathers one unit at a time (FSDP2's working set, TP-split)."""
    tp = recipe({"tensor_parallel_size": 2})
    alone, beside = parts(tp, DistributedSetup("ddp", num_processes=2)), parts(tp, DDP8)
    for name in ("weights", "gradients", "optimizer states"):
        assert beside[name].gpu_bytes == pytest.approx(alone[name].gpu_bytes / 4)
        assert "FSDP2 across the TP groups" in beside[name].note
    assert "gathered params" in beside and "gathered params" not in alone
    inv = inspect_model(tp.model)
    whole = parts(recipe({"loss_chunk_size": 0}), FSDP8)["gathered params"].gpu_bytes
    share = planned_fraction(inv)
    # transformers' FSDP2 has no mixed-precision policy by default (DistributedConfig
    # fsdp_mixed_precision False): it gathers the fp32 weights, where Accelerate's under bf16 gathers bf16.
    assert beside["gathered params"].gpu_bytes == pytest.approx(2 * whole * (1 - share + share / 2))


def test_tensor_view_divides_heads_and_columns():
    inv = inspect_model(recipe().model)
    view = tensor_view(inv, Split(tensor=4))
    assert (view.num_heads, view.num_kv_heads, view.intermediate_size) == (8, 2, 3584)
    assert view.hidden_size == inv.hidden_size and view.vocab_size == inv.vocab_size


@pytest.mark.parametrize("field", ["sequence_parallel_size", "context_parallel_size"])
def test_sequence_shards_divide_activations_and_logits(field):
    data = {"sample_packing": False} if field == "context_parallel_size" else {}
    full_logits = {"loss_chunk_size": 0}  # the chunked loss holds a chunk's logits, whatever the length
    whole = parts(recipe(full_logits, data=data), FSDP8)
    split = parts(recipe({field: 4, **full_logits}, data=data), FSDP8)
    assert split["logits + loss"].gpu_bytes == pytest.approx(whole["logits + loss"].gpu_bytes / 4, rel=0.01)
    acts = "activations, gradient checkpointing"
    assert split[acts].gpu_bytes < whole[acts].gpu_bytes / 4  # and the seq x seq mask is gone
    for name in ("weights", "gradients", "optimizer states"):  # the states are the engine's
        assert split[name].gpu_bytes == whole[name].gpu_bytes


def test_a_sequence_shard_is_the_activations_of_its_tokens_without_a_mask():
    inv = inspect_model(recipe().model)
    split = Split(sequence=4)
    r = recipe({"context_parallel_size": 4}, {"sample_packing": False})
    est = estimate(inv, r, FSDP8, micro_batch_size=1, checkpointing=True)
    tokens = shard_len(8192, split)
    alone = activation_bytes(
        inv,
        micro_batch_size=1,
        seq_len=tokens,
        attn_implementation="flash_attention_2",
        residual_bytes=est.layout.residual_bytes,
        compute_bytes=est.layout.compute_bytes,
        autocast=est.layout.autocast,
        loss_chunk=est.activations.loss_held and 0,
    )
    assert est.activations.per_layer == alone.per_layer and est.activations.mask == 0


def test_offloading_moves_the_kept_layer_inputs_to_the_host():
    r = recipe({"activation_offloading": True})
    est = estimate(inspect_model(r.model), r, FSDP8, micro_batch_size=1, checkpointing=True)
    named = {p.name: p for p in est.parts}
    moved = offloaded_bytes(est.activations, True)
    assert moved == 31 * est.activations.layer_input  # all but the layer being recomputed
    assert (
        named["offloaded activations"].host_bytes == moved and named["offloaded activations"].gpu_bytes == 0
    )
    plain = parts(recipe(), FSDP8)["activations, gradient checkpointing"].gpu_bytes
    assert named["activations, gradient checkpointing"].gpu_bytes == pytest.approx(plain - moved)


def plan_json(capsys, *argv: str) -> dict:
    args = ["plan", "recipes/llama3/llama3_8b_full_fsdp2.yaml", "--model.config_path", json.dumps(LLAMA3_8B)]
    args += ["--model.tokenizer_path", "meta-llama/Llama-3.1-8B", "--num-gpus", "8", "--gpu-memory", "80GB"]
    assert main([*args, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_at_128k_tokens_recommends_sequence_parallel(capsys, monkeypatch):
    from tests.unit.test_plan import REPO

    monkeypatch.chdir(REPO)
    plan = plan_json(capsys, "--sequence-len", "131072")
    assert plan["batch"]["seq_len"] == 131072 and not plan["fits"]
    names = [a["name"] for a in plan["suggestion"]["alternatives"]]
    assert names[:3] == ["sequence_parallel_2", "sequence_parallel_4", "sequence_parallel_8"]
    gib = [a["total_gpu_bytes"] / 2**30 for a in plan["suggestion"]["alternatives"][:3]]
    assert gib == sorted(gib, reverse=True) and gib[-1] < 74.5
    split = plan_json(capsys, "--sequence-len", "131072", "--train.sequence_parallel_size", "8")
    assert split["fits"]


def test_plan_at_32k_tokens_says_activations_dominate(capsys, monkeypatch):
    from tests.unit.test_plan import REPO

    monkeypatch.chdir(REPO)
    plan = plan_json(capsys, "--sequence-len", "32768")
    assert plan["fits"]
    (line,) = [x for x in plan["suggestion"]["lines"] if x.startswith("activations dominate")]
    assert "--train.sequence_parallel_size 8" in line
