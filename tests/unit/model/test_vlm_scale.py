"""finetune.model.vlm's scale-out parts on tiny models built from configs: the FSDP wrap classes of Idefics3,
Qwen2-VL, Qwen2.5-VL, Gemma 3 and LLaVA (and why transformers' _no_split_modules is not used), the
DeepSpeed buckets filled from a VLM's text config, and QLoRA leaving the vision tower and projector
unquantized."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from transformers import AutoModelForImageTextToText

from finetune.errors import FinetuneError
from finetune.model.vlm import block_classes, scale_out_settings, unquantized_modules
from finetune.recipe import validate_recipe
from tests.vlm_configs import gemma3, idefics3, llava, qwen2_5_vl, qwen2_vl

# The repeated blocks of each model's vision tower and language model.
BLOCKS = {
    idefics3: ["Idefics3EncoderLayer", "LlamaDecoderLayer"],
    qwen2_vl: ["Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"],
    qwen2_5_vl: ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"],
    gemma3: ["Gemma3DecoderLayer", "SiglipEncoderLayer"],
    llava: ["LlamaDecoderLayer", "SiglipEncoderLayer"],
}


def build(config_fn):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config_fn())


def fsdp_accelerator(**plugin):
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **plugin
    )
    return SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))


@pytest.mark.parametrize("config_fn", list(BLOCKS), ids=lambda f: f.__name__)
def test_fsdp_wraps_every_block_of_the_tower_and_the_language_model(config_fn):
    net = build(config_fn)
    assert block_classes(net) == BLOCKS[config_fn]
    accelerator = fsdp_accelerator()
    scale_out_settings(net, accelerator)
    policy = fsdp2_prepare_auto_wrap_policy(accelerator.state.fsdp_plugin, net)  # Accelerate's own
    wrapped = [name for name, module in net.named_modules() if policy(module)]
    assert len(wrapped) == 4  # 2 vision blocks + 2 decoder layers: nothing else, nothing missed
    towers = [n for n in wrapped if "visual" in n or "vision" in n]
    assert len(towers) == 2


def test_transformers_no_split_modules_would_not_do():
    """Why the classes are derived: Accelerate's default (the model's _no_split_modules) wraps Idefics3's
    vision attention, not its encoder layer, and refuses Gemma 3 (SigLIP text classes it lacks)."""
    assert "Idefics3EncoderLayer" not in build(idefics3)._no_split_modules
    net = build(gemma3)
    default = fsdp_accelerator().state.fsdp_plugin
    with pytest.raises(ValueError, match="Could not find the transformer layer class"):
        fsdp2_prepare_auto_wrap_policy(default, net)


def test_wrap_classes_the_user_named_are_kept():
    accelerator = fsdp_accelerator(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    scale_out_settings(build(idefics3), accelerator)
    assert accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


def test_a_model_without_tower_blocks_is_an_error_naming_the_fix():
    net = build(idefics3)
    net.model.vision_model.encoder.layers = torch.nn.ModuleList()
    with pytest.raises(FinetuneError, match="fsdp_transformer_layer_cls_to_wrap"):
        block_classes(net)


def test_deepspeed_auto_buckets_come_from_the_text_config():
    """Accelerate reads config.hidden_size, which a VLM's config lacks: the auto entries are filled from
    the largest of its text and vision hidden sizes; a number the user set stays."""
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    zero["stage3_param_persistence_threshold"] = 1234
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": zero})
    accelerator = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(deepspeed_plugin=plugin)
    )
    scale_out_settings(build(gemma3), accelerator)
    assert zero["reduce_bucket_size"] == 32 * 32 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert zero["stage3_param_persistence_threshold"] == 1234


def test_qlora_skips_the_vision_tower_projector_and_head():
    assert unquantized_modules(idefics3()) == ["lm_head", "model.connector", "model.vision_model"]
    assert unquantized_modules(qwen2_vl()) == ["lm_head", "model.visual"]


def _recipe(model_path: str, **model) -> dict:
    return {
        "model": {"kind": "vlm", "model_path": model_path, "torch_dtype": "fp32", **model},
        "data": {"datasets": [{"path": "d.jsonl", "type": "chat_template"}]},
        "lora": {"enable_lora": True, "enable_qlora": True},
        "train": {"output_dir": "out", "mixed_precision": "no"},
    }


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_qlora_loads_the_language_model_in_4bit_only(tmp_path):
    import bitsandbytes as bnb

    from finetune.model.build import build_model

    build(idefics3).save_pretrained(tmp_path)
    recipe = validate_recipe(_recipe(str(tmp_path)))  # QLoRA of a VLM is a valid recipe
    net = build_model(
        recipe.model, recipe.lora, mixed_precision="no", vocab_size=64, gradient_checkpointing=False
    )
    four_bit = {name for name, m in net.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    linear = {name for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    assert four_bit and all(name.startswith("model.text_model.") for name in four_bit)
    assert {n for n in linear - four_bit if n.startswith("model.text_model.")} == set()
    assert any(n.startswith("model.vision_model.") for n in linear - four_bit)
    assert "lm_head" in linear - four_bit and "model.connector.modality_projection.proj" in linear - four_bit
