"""finetune.plan's QLoRA alternative for vision-language models: the 4-bit language model and the
unquantized vision tower, projector and head, against what a real QLoRA load of the tiny demo VLM holds
on CPU (bitsandbytes: finetune.model.build.build_model with finetune.model.vlm.unquantized_modules, then
apply_lora's prepare_model_for_kbit_training, which casts every weight that is not 4-bit to fp32)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForImageTextToText

from finetune.accelerate_config import DistributedSetup
from finetune.model import vlm
from finetune.model.adapters import apply_lora
from finetune.model.build import build_model
from finetune.plan import estimate, make_plan
from finetune.plan.inventory import adapter_counts, inspect_model
from finetune.plan.states import model_states
from finetune.recipe import validate_recipe

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes/demo/tiny_vlm_cpu.yaml"
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def _demo_raw() -> dict:
    raw = yaml.safe_load(DEMO.read_text())
    raw["model"]["tokenizer_path"] = str(REPO / raw["model"]["tokenizer_path"])
    raw["model"].update(train_vision_tower=False, train_projector=False)
    return raw


def _absmax_bytes(net: torch.nn.Module) -> int:
    """Bytes of bitsandbytes' per-block constants: one absmax per 64 weights (8-bit with double quant,
    plus one fp32 absmax per 256 blocks). Its code tables (16 and 256 values) and offset, about 1.1 KB
    per 4-bit linear whatever its size, are not counted by the plan."""
    total = 0
    for param in net.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            blocks = [state.absmax] + ([state.state2.absmax] if state.nested else [])
            total += sum(t.numel() * t.element_size() for t in blocks)
    return total


@needs_bnb
@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "single"])
def test_qlora_vlm_states_equal_a_real_4bit_load(tmp_path, double_quant):
    """The QLoRA plan's frozen bytes (4-bit language model linears, the rest fp32) and LoRA weights
    against the real model's parameters and quantization constants."""
    raw = _demo_raw()
    config = dict(raw["model"]["config_path"])
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config)
    ).save_pretrained(tmp_path)
    model = {**raw["model"], "model_path": str(tmp_path), "config_path": None, "torch_dtype": "bf16"}
    lora = {"enable_lora": True, "enable_qlora": True, "double_quant": double_quant, "lora_rank": 4}
    train = {**raw["train"], "mixed_precision": "bf16", "gradient_checkpointing": True}
    recipe = validate_recipe({**raw, "model": model, "lora": lora, "train": train})
    net = build_model(
        recipe.model, recipe.lora, mixed_precision="bf16", vocab_size=708, gradient_checkpointing=True
    )
    towers, projectors = vlm.parts(net)
    settings = vlm.lora_settings(net, "all-linear", [], train_vision_tower=False, train_projector=False)
    net = apply_lora(net, recipe.lora, gradient_checkpointing=True, **settings)
    quantized = [n for n, p in net.named_parameters() if p.__class__.__name__ == "Params4bit"]
    assert quantized and not [n for n in quantized if any(f"{t}." in n for t in towers + projectors)]

    inv = inspect_model(recipe.model)
    states = model_states(
        inv, adapter_counts(inv, recipe.lora, recipe.model), recipe, DistributedSetup(), checkpointing=True
    ).states
    frozen = sum(p.numel() * p.element_size() for p in net.parameters() if not p.requires_grad)
    trained = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    # the tower, projector, embeddings, norms and head whole in fp32, the language model's linears 4-bit
    assert states.frozen == pytest.approx(frozen + _absmax_bytes(net), rel=1e-4)
    assert states.weights == trained


def test_qlora_is_offered_for_a_vlm_that_does_not_fit():
    """SmolVLM-Instruct (2.25B, its published config) fully fine-tuned fits no engine on one 16 GiB GPU;
    the QLoRA alternative is offered with the bytes of its own plan (4-bit language model)."""
    from tests.unit.test_plan_vlm import SMOLVLM_INSTRUCT

    raw = {
        "model": {
            "kind": "vlm",
            "config_path": SMOLVLM_INSTRUCT,
            "tokenizer_path": "proc",
            "torch_dtype": "bf16",
        },
        "data": {"datasets": [{"path": "d.jsonl", "type": "chat_template"}], "sequence_len": 2048},
        "train": {"output_dir": "out", "micro_batch_size": 1, "gradient_checkpointing": True},
    }
    recipe = validate_recipe(raw)
    plan = make_plan(recipe, gpu_memory="16GiB", images_per_row=1)
    assert not plan.fits
    offered = {a["name"]: a for a in plan.suggestion.alternatives}
    assert "qlora" in offered  # after the offload engines, which fit too
    qlora = validate_recipe({**raw, "lora": {"enable_lora": True, "enable_qlora": True}})
    expected = estimate(
        inspect_model(qlora.model),
        qlora,
        plan.engine,
        micro_batch_size=1,
        checkpointing=True,
        images=plan.images,
    )
    assert offered["qlora"]["total_gpu_bytes"] == expected.total_gpu
    assert expected.layout.quant_bytes > 0 and expected.total_gpu < plan.estimate.total_gpu
