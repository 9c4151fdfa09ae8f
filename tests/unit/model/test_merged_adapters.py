"""finetune.model.adapters.merged_adapters: LoRA merged for a generate call and taken out bit for bit,
checked against PEFT's own merge_and_unload; and the cases it leaves unmerged, with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from finetune.model.adapters import merged_adapters, unmergeable
from tests.tiny import tiny_model


def lora_model(**options):
    torch.manual_seed(0)
    net = get_peft_model(
        tiny_model(vocab_size=128, max_position_embeddings=64),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, **options),
    )
    for name, param in net.named_parameters():
        if "lora_B" in name:  # trained adapters: B is zero at init, which would merge nothing
            torch.nn.init.normal_(param, std=0.05)
    return net.eval()


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def test_inside_the_model_is_peft_s_merged_model_and_after_it_is_bit_for_bit_as_before():
    net = lora_model()
    with torch.no_grad():
        unmerged = net(IDS).logits
        reference = copy.deepcopy(net).merge_and_unload()(IDS).logits  # PEFT's own merge
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in net.named_parameters()}
    with merged_adapters(net) as merged, torch.no_grad():
        assert merged
        inside = net(IDS).logits
        assert all(layer.merged for layer in net.modules() if hasattr(layer, "merged_adapters"))
    torch.testing.assert_close(inside, reference, rtol=0, atol=1e-6)
    for name, p in net.named_parameters():
        storage, value = before[name]
        assert p.data_ptr() == storage and torch.equal(p.data, value), name  # the same tensor, the same bits
    assert not any(layer.merged for layer in net.modules() if hasattr(layer, "merged_adapters"))
    with torch.no_grad():
        assert torch.equal(net(IDS).logits, unmerged)  # the adapters run again, as before


def test_peft_s_merge_then_unmerge_rounds_the_base_weights():
    """Why merged_adapters keeps the original tensors: W + BA - BA is not W in floating point."""
    net = lora_model()
    before = {name: p.detach().clone() for name, p in net.named_parameters() if "base_layer" in name}
    net.merge_adapter()
    net.unmerge_adapter()
    changed = [n for n, p in net.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert changed


def test_an_exception_inside_still_gives_the_weights_back():
    net = lora_model()
    weights = {name: p.data_ptr() for name, p in net.named_parameters()}
    with pytest.raises(RuntimeError, match="generation failed"), merged_adapters(net):
        raise RuntimeError("generation failed")
    assert all(p.data_ptr() == weights[name] for name, p in net.named_parameters())
    assert not any(layer.merged for layer in net.modules() if hasattr(layer, "merged_adapters"))


def test_what_it_leaves_unmerged_and_why():
    plain = tiny_model(vocab_size=128, max_position_embeddings=64)
    assert unmergeable(plain) == "no LoRA adapters"
    dora = lora_model(use_dora=True)
    assert unmergeable(dora) == "a LoRA variant (DoRA) or a bias adapter"
    weights = {name: p.data_ptr() for name, p in dora.named_parameters()}
    with merged_adapters(dora) as merged:
        assert not merged
    assert all(p.data_ptr() == weights[name] for name, p in dora.named_parameters())
    net = lora_model()
    net.merge_adapter()
    assert unmergeable(net) == "the adapters are merged already"


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_dtype_gives_a_16_bit_merged_copy_inside_and_the_float32_weights_back_after(use_dora):
    """grpo.generation_dtype: inside, every weight is a bfloat16 copy (the adapters merged where PEFT can
    merge them, DoRA's kept and cast), so the model computes what PEFT's merged model cast to bfloat16
    computes; after, every parameter is its float32 tensor again, bit for bit."""
    net = lora_model(use_dora=use_dora)
    merged_copy = copy.deepcopy(net).merge_and_unload()
    for param in merged_copy.parameters():  # the parameters only: buffers (rotary inv_freq) stay float32
        param.data = param.data.to(torch.bfloat16)
    with torch.no_grad():
        reference = merged_copy(IDS).logits
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in net.named_parameters()}
    with merged_adapters(net, torch.bfloat16) as merged, torch.no_grad():
        assert merged is (not use_dora)
        used = {p.dtype for name, p in net.named_parameters() if use_dora or "lora_" not in name}
        assert used == {torch.bfloat16}  # merged, the adapters' own weights are unused: not copied
        inside = net(IDS).logits
    assert inside.dtype == torch.bfloat16
    # DoRA's magnitudes run unmerged in bfloat16: close to the merged copy, not equal to it
    torch.testing.assert_close(inside, reference, rtol=0, atol=0.05 if use_dora else 0.0)
    for name, p in net.named_parameters():
        storage, value = before[name]
        assert p.data_ptr() == storage and torch.equal(p.data, value), name
    assert {p.dtype for p in net.parameters()} == {torch.float32}
