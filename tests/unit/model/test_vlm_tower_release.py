"""finetune.model.vlm.release_frozen_towers on tiny Idefics3 (the demo's config) and Gemma 3 (SigLIP) models:
under gradient checkpointing a frozen vision tower runs no backward (its output needs no gradient, a
backward hook on a tower layer never fires) while the trained parts get exactly the gradients they get
without the release and without checkpointing; a tower that trains (fully, or with LoRA) keeps its
hook and its gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForImageTextToText, Gemma3Config

from finetune.model import vlm
from finetune.plan.inventory import inspect_model
from finetune.recipe import validate_recipe

DEMO = Path(__file__).resolve().parents[3] / "recipes/demo/tiny_vlm_cpu.yaml"
ROWS, SEQ = 2, 24


def idefics3():
    """The demo's inline config with a 2-layer tower."""
    config = dict(yaml.safe_load(DEMO.read_text())["model"]["config_path"])
    config["vision_config"] = {**config["vision_config"], "num_hidden_layers": 2}
    return AutoConfig.for_model(config.pop("model_type"), **config)


def gemma3():
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision |= {"image_size": 32, "patch_size": 8}
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 1, "vocab_size": 64, "head_dim": 16}
    return Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, image_token_index=60)


# id: (config, image token id, image tokens per image, the tower layer list's module path)
ARCHS = {
    "idefics3": (idefics3, 705, 4, "model.vision_model.encoder.layers"),
    "gemma3": (gemma3, 60, 4, "model.vision_tower.encoder.layers"),
}


def _batch(image_token: int, image_tokens: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, min(vocab, 700) - 10, (ROWS, SEQ), generator=gen)
    ids[:, 2 : 2 + image_tokens] = image_token
    labels = ids.clone()
    labels[:, : 2 + image_tokens] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    batch["pixel_values"] = torch.randn(ROWS, 3, 32, 32, generator=gen)
    if image_token == 705:  # Idefics3: images per row, and which pixels are real
        batch["pixel_values"] = batch["pixel_values"][:, None]
        batch["pixel_attention_mask"] = torch.ones(ROWS, 1, 32, 32, dtype=torch.bool)
    else:  # Gemma 3 attends bidirectionally within an image
        batch["token_type_ids"] = (ids == image_token).long()
    return batch


def _run(arch: str, *, checkpointing: bool, release: bool, tower: bool = False, lora: bool = False):
    """One forward and backward as training sets the model up (finetune.model.build.build_model, apply_lora,
    finetune.objectives.lm): (trained parameters' gradients, tower layer backward calls, whether the
    tower's output required grad)."""
    config_fn, image_token, image_tokens, layers = ARCHS[arch]
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(config_fn(), attn_implementation="eager")
    if arch == "gemma3":  # its projector starts at zero, which would pass the tower no gradient
        torch.nn.init.normal_(net.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    if checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        settings = vlm.lora_settings(net, "all-linear", [], train_vision_tower=tower, train_projector=False)
        net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **settings))
    else:
        vlm.freeze(net, train_vision_tower=tower, train_projector=True)
    if release:
        vlm.release_frozen_towers(net)
    net.train()
    tower_layers = next(m for n, m in net.named_modules() if n.endswith(layers))
    fired, out_grad = [], []
    tower_layers[0].register_full_backward_hook(lambda *_: fired.append(1))
    tower_layers[-1].register_forward_hook(lambda m, a, out: out_grad.append(out[0].requires_grad))
    vocab = net.config.get_text_config().vocab_size
    net(**_batch(image_token, image_tokens, vocab)).loss.backward()
    grads = {n.replace("base_model.model.", ""): p.grad for n, p in net.named_parameters() if p.requires_grad}
    return grads, len(fired), out_grad[0]


def _assert_equal(grads: dict, reference: dict) -> None:
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        if grad is None:  # a part the model does not use (SigLIP's pooling head in Gemma 3)
            assert reference[name] is None, name
            continue
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_frozen_tower_runs_no_backward_and_gradients_are_unchanged(arch, lora):
    """Projector trained fully or LoRA on the language model: the released tower's last layer output needs
    no gradient and its first layer sees no backward, where without the release it does; the trained
    parameters' gradients equal those without the release and those without checkpointing."""
    released, fired, requires_grad = _run(arch, checkpointing=True, release=True, lora=lora)
    assert (fired, requires_grad) == (0, False)
    hooked, fired_before, requires_grad_before = _run(arch, checkpointing=True, release=False, lora=lora)
    assert fired_before > 0 and requires_grad_before  # what the release saves
    plain, _, _ = _run(arch, checkpointing=False, release=False, lora=lora)
    assert len(released) > 0
    _assert_equal(released, hooked)
    _assert_equal(released, plain)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_trained_tower_keeps_its_hook_and_gradients(arch, lora):
    """train_vision_tower (full, or LoRA on the tower): the release leaves the tower alone; its
    parameters get the gradients they get without checkpointing."""
    grads, fired, requires_grad = _run(arch, checkpointing=True, release=True, tower=True, lora=lora)
    assert fired > 0 and requires_grad
    plain, _, _ = _run(arch, checkpointing=False, release=False, tower=True, lora=lora)
    towers = [n for n in grads if ".vision_model." in n or ".vision_tower." in n]
    assert towers and all(grads[n].abs().sum() > 0 for n in towers if ".head." not in n)
    _assert_equal(grads, plain)


def test_the_release_keeps_the_language_models_hook():
    """Only the tower's hook goes: the text embeddings' output still requires grad under checkpointing."""
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(idefics3())
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    vlm.freeze(net, train_vision_tower=False, train_projector=False)
    assert vlm.release_frozen_towers(net) == ["model.vision_model"]
    out = net.get_input_embeddings()(torch.tensor([[1, 2]]))
    assert out.requires_grad
    assert vlm.release_frozen_towers(net) == []  # nothing left to remove


def test_planner_sees_the_released_tower():
    """The planner asks finetune.model.vlm.keeps_input_grad for a frozen tower: training removes its hook, so
    the plan has the tower run no backward; a trained tower would keep it."""
    inv = inspect_model(validate_recipe(yaml.safe_load(DEMO.read_text())).model)
    assert not inv.vision.checkpointing_input_grad
    tower = AutoModelForImageTextToText.from_config(idefics3()).model.vision_model
    assert vlm.keeps_input_grad(tower, trains=True)
    assert not vlm.keeps_input_grad(tower, trains=False)


def test_qwen2_vl_tower_hooks_are_removed_after_peft():
    """Qwen2-VL's `visual` (its merger inside) is hooked by checkpointing and again by PEFT; the release
    removes every such hook from its patch embedding, none from the language model's embeddings."""
    from transformers import Qwen2VLConfig

    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 1, "vocab_size": 64}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 14}
    net = AutoModelForImageTextToText.from_config(Qwen2VLConfig(vision_config=vision, text_config=text))
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    settings = vlm.lora_settings(net, "all-linear", [], train_vision_tower=False, train_projector=False)
    net = get_peft_model(net, LoraConfig(r=2, **settings))
    (patches,) = vlm.hooked_input_embeddings(net.get_submodule("base_model.model.model.visual"))
    assert len(patches._forward_hooks) == 2  # activation_checkpointing_enable's and PeftModel's
    assert vlm.release_frozen_towers(net) == ["base_model.model.model.visual"]
    assert len(patches._forward_hooks) == 0
    assert len(net.get_input_embeddings()._forward_hooks) == 2
