"""The parallelism fields beyond data parallel (docs/scale-out.md): what the recipe refuses at validate
time (finetune.recipe.parallel), what the engine refuses at start (finetune.parallel.sizes.engine_problems,
through finetune.distributed.combination_problems), what the model refuses before its weights load
(check_model_splits), and each refusal names what works instead. Long context: model.rope_scaling and
model.max_position_embeddings in the built config (finetune.model.context), and the warning when rows
outgrow the trained context."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from finetune.accelerate_config import DistributedSetup
from finetune.distributed import combination_problems
from finetune.errors import FinetuneError
from finetune.model.context import apply_context_settings, context_warning, trained_context
from finetune.parallel.sizes import (
    check_model_splits,
    data_parallel_rank,
    data_parallel_size,
    ranks_sharing_rows,
)
from finetune.recipe import Recipe, validate_recipe
from tests.tiny import TINY_LLAMA


def recipe(train: dict | None = None, **sections) -> Recipe:
    data = {
        "model": {"model_path": "org/base"},
        "data": {"datasets": [{"path": "a.jsonl", "type": "alpaca"}]},
        "train": {"output_dir": "out", **(train or {})},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return validate_recipe(data)


def refusal(train: dict | None = None, **sections) -> str:
    with pytest.raises(ValidationError) as info:
        recipe(train, **sections)
    return str(info.value)


# ------------------------------------------------------------------------------------ recipe fields


def test_the_fields_exist_with_off_defaults():
    train = recipe().train
    assert (train.tensor_parallel_size, train.sequence_parallel_size, train.context_parallel_size) == (
        1,
        1,
        1,
    )
    assert (train.pipeline_parallel_size, train.expert_parallel_size) == (1, 1)
    assert train.activation_offloading is False
    sized = recipe({"tensor_parallel_size": 2}, lora={"lora_target_modules": ["q_proj"]}).train
    assert sized.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("field", "reason", "instead"),
    [
        ("pipeline_parallel_size", "pipeline parallel is not built", "--accelerate-config zero3 or fsdp2"),
        ("expert_parallel_size", "expert parallel is not built", "router auxiliary loss"),
    ],
)
def test_pipeline_and_expert_parallel_are_refused_with_the_reason_and_the_alternative(field, reason, instead):
    message = refusal({field: 2})
    assert f"train.{field}" in message and reason in message and instead in message
    assert recipe({field: 1}).train.model_dump()[field] == 1  # 1 = off is accepted


def test_one_split_at_a_time():
    message = refusal({"tensor_parallel_size": 2, "sequence_parallel_size": 2})
    assert "one split at a time" in message and "set the others to 1" in message


@pytest.mark.parametrize("split", ["tensor_parallel_size", "sequence_parallel_size", "context_parallel_size"])
def test_splits_train_sft_only(split):
    message = refusal(
        {split: 2, "objective": "dpo"},
        data={"datasets": [{"path": "a.jsonl", "type": "preference"}], "sample_packing": False},
        model={"attn_implementation": "sdpa"},
    )
    assert "sft objective only" in message and f"set train.{split}: 1" in message


def test_sequence_parallel_refuses_a_row_length_that_does_not_split():
    message = refusal({"sequence_parallel_size": 3})
    assert "data.pad_to_multiple_of" in message and "3 equal shards" in message
    assert "192 is one" in message  # the smallest multiple of both 64 (the default) and 3
    assert recipe({"sequence_parallel_size": 4}).train.sequence_parallel_size == 4


def test_sequence_parallel_refuses_eager_attention_and_says_which_work():
    message = refusal({"sequence_parallel_size": 2}, model={"attn_implementation": "eager"})
    assert "use sdpa or flash_attention_2 with sequence parallel" in message


def test_context_parallel_refuses_packing_and_names_sequence_parallel_instead():
    message = refusal({"context_parallel_size": 2})
    assert "data.sample_packing" in message and "train.sequence_parallel_size" in message
    assert (
        recipe({"context_parallel_size": 2}, data={"sample_packing": False}).train.context_parallel_size == 2
    )


def test_context_parallel_needs_sdpa():
    message = refusal(
        {"context_parallel_size": 2}, data={"sample_packing": False}, model={"attn_implementation": "eager"}
    )
    assert "context parallel is torch's ring attention over SDPA: set sdpa" in message


def test_tensor_parallel_refuses_qlora_and_the_chunked_loss():
    assert "QLoRA without tensor parallel" in refusal(
        {"tensor_parallel_size": 2}, lora={"enable_lora": True, "enable_qlora": True}
    )
    assert "set train.loss_chunk_size: 0" in refusal({"tensor_parallel_size": 2, "loss_chunk_size": 1024})


def test_offloading_without_checkpointing_is_a_warning_not_an_error():
    from finetune.recipe import recipe_warnings

    lines = recipe_warnings(recipe({"activation_offloading": True}))
    assert any("gradient_checkpointing" in line for line in lines)
    assert not any(
        "activation_offloading" in line
        for line in recipe_warnings(recipe({"activation_offloading": True, "gradient_checkpointing": True}))
    )


# ------------------------------------------------------------------------------------ engine checks


def problems(train: dict, engine: DistributedSetup, *, cuda: bool = False, **sections) -> list[str]:
    r = recipe(train, **sections)
    return combination_problems(
        engine, r.train, model_kind="llm", qlora=False, cuda_available=cuda, lora=r.lora.enable_lora
    )


DDP2 = DistributedSetup(kind="ddp", num_processes=2, use_cpu=True, source="multi_cpu.yaml")
DDP4 = DistributedSetup(kind="ddp", num_processes=4, source="multi_gpu.yaml")


DDP3 = DistributedSetup(kind="ddp", num_processes=3, use_cpu=True, source="multi_cpu.yaml")
DDP4_CPU = DistributedSetup(kind="ddp", num_processes=4, use_cpu=True, source="multi_cpu.yaml")


def test_tensor_parallel_size_must_divide_the_processes():
    """TP over every process, or TP groups with data parallel across them (the 2-D mesh)."""
    assert problems({"tensor_parallel_size": 2}, DDP2) == []
    assert problems({"tensor_parallel_size": 2}, DDP4, cuda=True) == []
    assert problems({"tensor_parallel_size": 2}, DDP4_CPU) == []
    (message,) = problems({"tensor_parallel_size": 2}, DDP3)
    assert "train.tensor_parallel_size 2 does not divide the 3 processes of multi_cpu.yaml" in message
    assert "use a divisor of 3 (1, 3) or --num-processes a multiple of 2" in message


def test_lora_under_tensor_and_data_parallel_is_refused_naming_what_works():
    """transformers wraps a TP model with data parallel beside it in its own FSDP2 at load; PEFT's adapters,
    added after, stay outside it (the forward fails, measured). TP over every process takes LoRA."""
    lora = {"lora_target_modules": ["q_proj"]}
    assert problems({"tensor_parallel_size": 2}, DDP2, lora={"enable_lora": True, **lora}) == []
    (message,) = problems({"tensor_parallel_size": 2}, DDP4_CPU, lora={"enable_lora": True, **lora})
    assert "runs data parallel across 2 tensor-parallel groups" in message
    assert "--num-processes 2" in message and "lora.enable_lora: false" in message
    assert problems({"tensor_parallel_size": 2}, DDP4_CPU, lora={"enable_lora": False}) == []


@pytest.mark.parametrize(
    "engine",
    [
        DistributedSetup(kind="deepspeed", num_processes=2, zero_stage=3, source="zero3.yaml"),
        DistributedSetup(kind="fsdp", num_processes=4, source="fsdp2.yaml"),
    ],
    ids=["zero3", "fsdp2"],
)
def test_tensor_parallel_runs_on_the_ddp_launcher_only(engine):
    """Under ZeRO or Accelerate's FSDP the split weights would be sharded a second time; data parallel
    beside TP comes from transformers' own FSDP2 on the DDP launcher."""
    found = problems({"tensor_parallel_size": 2}, engine, cuda=True)
    assert any("use multi_gpu (multi_cpu on CPU)" in line for line in found)


def test_sequence_parallel_size_must_divide_the_processes():
    (message,) = problems(
        {"sequence_parallel_size": 4}, DistributedSetup(kind="ddp", num_processes=6, source="x")
    )
    assert "does not divide the 6 processes" in message and "1, 2, 3, 6" in message
    assert problems({"sequence_parallel_size": 2}, DDP4, cuda=True) == []  # 2 groups of 2: SP beside DP


def test_context_parallel_on_cpu_is_refused_naming_sequence_parallel():
    (message,) = problems({"context_parallel_size": 2}, DDP2, data={"sample_packing": False})
    assert "CUDA only" in message and "_scaled_dot_product_flash_attention_for_cpu" in message
    assert "train.sequence_parallel_size 2" in message


def test_context_parallel_on_gpus_needs_fsdp2():
    (message,) = problems({"context_parallel_size": 2}, DDP4, cuda=True, data={"sample_packing": False})
    assert "--accelerate-config fsdp2" in message
    fsdp = DistributedSetup(kind="fsdp", num_processes=4, zero_stage=3, source="fsdp2.yaml")
    assert problems({"context_parallel_size": 2}, fsdp, cuda=True, data={"sample_packing": False}) == []


def test_activation_offloading_is_cuda_only():
    (message,) = problems({"activation_offloading": True, "gradient_checkpointing": True}, DistributedSetup())
    assert "no GPU" in message and "set it false" in message
    assert problems({"activation_offloading": True}, DistributedSetup(), cuda=True) == []


def test_who_reads_which_rows():
    tp = recipe({"tensor_parallel_size": 2}).train
    sp = recipe({"sequence_parallel_size": 2}).train
    # A TP group reads one batch together; an SP group's processes read different rows (DeepSpeed's
    # adapter exchanges them), so its data parallel size is every process.
    assert ranks_sharing_rows(tp) == 2 and data_parallel_size(tp, 4) == 2
    assert [data_parallel_rank(tp, process_index=i) for i in range(4)] == [0, 0, 1, 1]
    assert ranks_sharing_rows(sp) == 1 and data_parallel_size(sp, 4) == 4


# ------------------------------------------------------------------------------------ model checks


def test_tensor_parallel_refuses_a_model_without_a_tp_plan():
    gpt2 = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2)
    with pytest.raises(FinetuneError) as info:
        check_model_splits(gpt2, recipe({"tensor_parallel_size": 2}).train)
    message = str(info.value)
    assert "no TP plan for gpt2" in message and "train.sequence_parallel_size" in message
    assert "zero3 or fsdp2" in message


def test_tensor_parallel_size_must_share_out_the_heads():
    config = LlamaConfig(**TINY_LLAMA)  # 4 heads, 2 key/value heads
    check_model_splits(config, recipe({"tensor_parallel_size": 2}).train)
    with pytest.raises(FinetuneError) as info:
        check_model_splits(config, recipe({"tensor_parallel_size": 4}).train)
    assert "4 attention heads and 2 key/value heads" in str(info.value) and "(1, 2)" in str(info.value)


def test_sequence_parallel_size_must_share_out_the_heads():
    config = LlamaConfig(
        **{**TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96}
    )
    with pytest.raises(FinetuneError) as info:
        check_model_splits(config, recipe({"sequence_parallel_size": 4}).train)
    assert "6 attention heads" in str(info.value) and "1, 2, 3, 6" in str(info.value)
    check_model_splits(config, recipe({"sequence_parallel_size": 2}).train)


# ------------------------------------------------------------------------------------ long context


def test_rope_scaling_and_positions_go_into_the_config_and_the_model_builds():
    r = recipe(model={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 512})
    config = apply_context_settings(LlamaConfig(**TINY_LLAMA, rope_theta=5000.0), r.model)
    params = config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 4.0
    assert params["rope_theta"] == 5000.0  # the model's own, kept
    assert params["original_max_position_embeddings"] == 128  # the trained context
    assert config.max_position_embeddings == 512 and trained_context(config) == 128
    model = AutoModelForCausalLM.from_config(config)
    assert model.config.rope_parameters["rope_type"] == "yarn"
    # YaRN scales the attention (its mscale) and the frequencies: the rotary embedding differs from the
    # unscaled model's at the same position.
    plain = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA, rope_theta=5000.0))
    x, positions = torch.zeros(1, 4, 64), torch.arange(4)[None]
    assert not torch.allclose(
        model.model.rotary_emb(x, positions)[0], plain.model.rotary_emb(x, positions)[0]
    )


def test_rope_scaling_of_an_unknown_type_is_a_recipe_error():
    message = refusal(model={"rope_scaling": {"rope_type": "ntk", "factor": 2.0}})
    assert "rope_scaling.rope_type: must be one of linear, dynamic, yarn, llama3" in message
    assert "a number above 0" in refusal(model={"rope_scaling": {"rope_type": "linear", "factor": 0}})


def test_rope_keys_transformers_refuses_name_model_rope_scaling():
    r = recipe(model={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})  # no low/high_freq_factor
    with pytest.raises(FinetuneError) as info:
        apply_context_settings(LlamaConfig(**TINY_LLAMA), r.model)
    assert "model.rope_scaling" in str(info.value) and "modeling_rope_utils" in str(info.value)


def test_rows_longer_than_the_trained_context_warn_unless_scaled():
    config = LlamaConfig(**TINY_LLAMA)  # 128 positions
    plain = recipe().model
    assert context_warning(config, plain, 128) is None
    message = context_warning(config, plain, 512)
    assert "trained context (128 positions)" in message and "rope_type: yarn, factor: 4" in message
    scaled = recipe(model={"rope_scaling": {"rope_type": "linear", "factor": 4.0}}).model
    assert context_warning(config, scaled, 512) is None
    short = recipe(model={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}).model
    assert "raise its factor to 4" in context_warning(config, short, 512)


def test_the_training_warning_reads_the_recipe_model(tmp_path):
    from finetune.train import context_warnings

    LlamaConfig(**TINY_LLAMA).save_pretrained(tmp_path)
    r = recipe(model={"model_path": None, "config_path": str(tmp_path)}, data={"sequence_len": 512})
    (line,) = context_warnings(r)
    assert "data.sequence_len 512" in line
    assert (
        context_warnings(
            recipe(model={"model_path": None, "config_path": str(tmp_path)}, data={"sequence_len": 128})
        )
        == []
    )
