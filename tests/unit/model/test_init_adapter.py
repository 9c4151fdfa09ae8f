"""lora.init_adapter: training continues from a saved adapter (its weights, trainable), after checking
its base and LoRA settings against the recipe's."""

from __future__ import annotations

import pytest
import torch

from finetune.errors import FinetuneError
from finetune.model.adapters import apply_lora
from finetune.recipe import LoraSection
from tests.tiny import tiny_model


@pytest.fixture
def saved_adapter(tmp_path):
    base = tiny_model()
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    adapter = apply_lora(
        tiny_model(), LoraSection(enable_lora=True, lora_rank=4), gradient_checkpointing=False
    )
    with torch.no_grad():  # trained weights: not the fresh adapter's zeros
        for name, param in adapter.named_parameters():
            if "lora_B" in name:
                param.normal_()
    adapter.peft_config["default"].base_model_name_or_path = str(base_dir)
    adapter.save_pretrained(tmp_path / "adapter")
    return (
        tmp_path / "adapter",
        base_dir,
        {n: p.detach().clone() for n, p in adapter.named_parameters() if "lora" in n},
    )


def test_the_adapter_continues_with_its_weights_trainable(saved_adapter):
    folder, base_dir, weights = saved_adapter
    lora = LoraSection(enable_lora=True, lora_rank=4, init_adapter=str(folder))
    net = apply_lora(tiny_model(), lora, gradient_checkpointing=False, base=str(base_dir))
    params = dict(net.named_parameters())
    for name, value in weights.items():
        torch.testing.assert_close(params[name], value)
        assert params[name].requires_grad, name
    assert not any(p.requires_grad for n, p in params.items() if "lora" not in n)


def test_other_lora_settings_or_another_base_are_refused_naming_both(saved_adapter, tmp_path):
    folder, base_dir, _ = saved_adapter
    lora = LoraSection(enable_lora=True, lora_rank=8, lora_alpha=32, init_adapter=str(folder))
    with pytest.raises(
        FinetuneError, match=r"lora.lora_rank is 8 here, 4 in the adapter; lora.lora_alpha is 32.0"
    ):
        apply_lora(tiny_model(), lora, gradient_checkpointing=False, base=str(base_dir))
    lora = LoraSection(enable_lora=True, lora_rank=4, init_adapter=str(folder))
    with pytest.raises(FinetuneError, match=rf"its base is {base_dir}, this recipe's model is org/other"):
        apply_lora(tiny_model(), lora, gradient_checkpointing=False, base="org/other")
    with pytest.raises(FinetuneError, match=r"holds no adapter_config\.json"):
        apply_lora(
            tiny_model(),
            LoraSection(enable_lora=True, init_adapter=str(tmp_path)),
            gradient_checkpointing=False,
        )


def test_init_adapter_needs_lora():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="init_adapter"):
        LoraSection(enable_lora=False, init_adapter="somewhere")
