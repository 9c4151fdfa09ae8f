"""LoRA variants passed through to PEFT (finetune.model.adapters.apply_lora): init_lora_weights gives PEFT's own
initial weights; PiSSA/OLoRA adapters are saved converted for the original base; LoRA+ gives PEFT's
learning rates (finetune.optim)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from finetune.model.adapters import (
    apply_lora,
    init_modifies_base,
    save_converted_adapter,
    save_initial_adapter,
)
from finetune.optim import build_optimizer
from finetune.recipe import LoraSection
from tests.tiny import tiny_model

ADAM = {"betas": (0.9, 0.999), "eps": 1e-8}


def _lora(**settings) -> LoraSection:
    return LoraSection(enable_lora=True, lora_rank=4, lora_alpha=8, **settings)


@pytest.mark.parametrize("init", [True, False, "gaussian", "pissa", "pissa_niter_2", "olora"])
def test_initial_weights_are_pefts(init):
    """The same tiny model and seed through apply_lora and through PEFT directly: every weight equal,
    base weights included (PiSSA and OLoRA subtract the adapter's start from them)."""
    torch.manual_seed(5)
    ours = apply_lora(tiny_model(), _lora(init_lora_weights=init), gradient_checkpointing=False)
    torch.manual_seed(5)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=init, task_type="CAUSAL_LM"
    )
    theirs = get_peft_model(tiny_model(), config)
    expected = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, expected[name]), name
    base = dict(tiny_model().named_parameters())
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    moved = not torch.equal(
        dict(ours.named_parameters())[q_proj], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert moved == init_modifies_base(ours) == (isinstance(init, str) and init != "gaussian")


@pytest.mark.parametrize("modules_to_save", [[], ["lm_head"]])
def test_a_pissa_adapter_is_saved_converted_for_the_original_base(tmp_path, modules_to_save):
    """After training, the saved adapter (converted against output_dir/initial_adapter, as save_lm
    does) on the original base gives the trained model's outputs, a trained modules_to_save copy
    included (PEFT's conversion alone drops it, and the adapter then fails to load)."""
    from finetune.objectives.lm import INITIAL_ADAPTER

    torch.manual_seed(0)
    lora = _lora(init_lora_weights="pissa", modules_to_save=modules_to_save)
    net = apply_lora(tiny_model(), lora, gradient_checkpointing=False)
    save_initial_adapter(net, tmp_path / INITIAL_ADAPTER, is_main_process=True)
    with torch.no_grad():  # a training run's change of the adapter (and of the saved lm_head copy)
        for param in net.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    ids = torch.randint(4, 97, (1, 10))
    trained = net(input_ids=ids).logits
    save_converted_adapter(net, tmp_path / "out", initial=tmp_path / INITIAL_ADAPTER, is_main_process=True)
    restored = PeftModel.from_pretrained(tiny_model(), tmp_path / "out")
    assert restored.peft_config["default"].r == 8  # plain LoRA of twice the rank
    torch.testing.assert_close(restored(input_ids=ids).logits, trained, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["adamw", "adamw_torch", "paged_adamw_8bit"])
def test_loraplus_groups_have_lr_and_lr_times_ratio(name):
    net = apply_lora(tiny_model(), _lora(), gradient_checkpointing=False)
    optimizer = build_optimizer(
        net, name=name, lr=1e-3, weight_decay=0.0, no_decay_params=[], loraplus_lr_ratio=16, **ADAM
    )
    names = {id(p): n for n, p in net.named_parameters()}
    lr_of = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lr_of and set(lr_of) == {n for n, p in net.named_parameters() if p.requires_grad}
    for param_name, lr in lr_of.items():
        assert lr == (pytest.approx(1e-3 * 16) if "lora_B" in param_name else pytest.approx(1e-3)), param_name


def test_loraplus_with_muon_is_refused():
    from finetune.errors import FinetuneError

    net = apply_lora(tiny_model(), _lora(), gradient_checkpointing=False)
    with pytest.raises(FinetuneError, match=r"loraplus_lr_ratio.*muon"):
        build_optimizer(
            net, name="muon", lr=1e-3, weight_decay=0.0, no_decay_params=[], loraplus_lr_ratio=4, **ADAM
        )


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"init_lora_weights": "loftq"}, "loftq is not supported"),
        ({"init_lora_weights": "pissa_niter_x"}, "is not one of true, false, gaussian, pissa, pissa_niter_N"),
        ({"init_lora_weights": "pissa", "init_adapter": "out"}, "does nothing with init_adapter"),
    ],
)
def test_unsupported_inits_are_recipe_errors(settings, expected):
    with pytest.raises(ValueError, match=expected):
        _lora(**settings)


def test_loraplus_without_lora_is_a_recipe_error():
    with pytest.raises(ValueError, match=r"loraplus_lr_ratio.*set enable_lora: true"):
        LoraSection(loraplus_lr_ratio=16)
