"""finetune.plan's activation peak with gradient checkpointing on a vision-language model, against the
CPU allocator's peak (tests/memory.py) of one forward and backward of the demo VLM
(recipes/demo/tiny_vlm_cpu.yaml) as training runs it (activation_checkpointing_enable, non-reentrant).

Measured in a later micro step of gradient accumulation, when the weights' gradients exist already:
the plan counts them in full beside the activations, and the peak of the micro step is then the
activations' alone (in a first micro step it lies between the two, as only some gradients exist).
Checkpointing would make even a frozen vision tower run a backward (transformers hooks the tower's input
embeddings to require grad); training removes that hook (finetune.model.vlm.release_frozen_towers), so a frozen
tower saves nothing. The peak is a decoder layer's recomputation and backward, or, with a large trained
tower, the tower's own, last."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForImageTextToText, LlamaConfig, LlamaForCausalLM

from finetune.accelerate_config import DistributedSetup
from finetune.losses.causal_lm import forward
from finetune.model import vlm
from finetune.model.adapters import apply_lora
from finetune.plan import estimate
from finetune.plan.images import image_input
from finetune.plan.inventory import inspect_model, inventory_of
from finetune.recipe import validate_recipe
from tests.memory import peak_allocated_bytes

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes/demo/tiny_vlm_cpu.yaml"
ROWS, SEQ = 8, 64


def _batch(image_tokens: int, side: int, *, images: bool = True) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(10, 700, (ROWS, SEQ))
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, 50:] = 0  # one padded row: transformers makes its attention mask, as the plan assumes
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
    if images:
        ids[:, 5 : 5 + image_tokens] = 705  # the demo processor's <image>
        batch["pixel_values"] = torch.randn(ROWS, 1, 3, side, side)
        batch["pixel_attention_mask"] = torch.ones(ROWS, 1, side, side, dtype=torch.bool)
    return batch


def _micro_step_peak(net: torch.nn.Module, batch: dict) -> int:
    """The CPU peak of a second forward and backward, the first one's gradients still held."""
    net.train()
    num_items = (batch["labels"][:, 1:] != -100).sum()
    forward(net, batch, num_items=num_items).loss.backward()
    return peak_allocated_bytes(lambda: forward(net, batch, num_items=num_items).loss.backward())


def _vlm_case(tower: bool, checkpointing: bool, vision: dict, *, lora: bool = False) -> tuple[float, int]:
    """(planned activation peak, measured peak) for the demo VLM with `vision` config changes."""
    raw = yaml.safe_load(DEMO.read_text())
    model = raw["model"]
    model["tokenizer_path"] = str(REPO / model["tokenizer_path"])
    model["config_path"]["vision_config"].update(vision)
    model.update(train_vision_tower=tower, train_projector=tower)
    train = {**raw["train"], "micro_batch_size": ROWS, "gradient_checkpointing": checkpointing}
    adapters = {"enable_lora": True, "lora_dropout": 0.0} if lora else {}
    recipe = validate_recipe({**raw, "train": train, "lora": adapters})
    config = dict(model["config_path"])
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config), attn_implementation="sdpa"
    )
    inv = inventory_of(net, vision_language=True)
    if checkpointing:  # before PEFT, as finetune.model does
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        settings = vlm.lora_settings(net, "all-linear", [], train_vision_tower=tower, train_projector=tower)
        net = apply_lora(net, recipe.lora, gradient_checkpointing=checkpointing, **settings)
    else:
        vlm.freeze(net, train_vision_tower=tower, train_projector=tower)
    if checkpointing:  # after PEFT, as finetune.objectives.lm does
        vlm.release_frozen_towers(net)
    side, patch = config["vision_config"]["image_size"], config["vision_config"]["patch_size"]
    patches = (side // patch) ** 2
    images = image_input(inv.vision, recipe, images_per_row=1, patches_per_image=patches)
    est = estimate(
        inv, recipe, DistributedSetup(), micro_batch_size=ROWS, checkpointing=checkpointing, images=images
    )
    batch = _batch(patches // config["scale_factor"] ** 2, side)
    return est.activations.peak(checkpointing), _micro_step_peak(net, batch)


CASES = {  # id: (train_vision_tower and projector, gradient checkpointing)
    "frozen-ckpt": (False, True),
    "trained-ckpt": (True, True),
    "frozen": (False, False),
    "trained": (True, False),
}


@pytest.mark.parametrize(("tower", "checkpointing"), CASES.values(), ids=CASES)
def test_demo_vlm_peak_with_and_without_checkpointing(tower, checkpointing):
    """A 4-layer tower: the peak is a decoder layer's recomputation and backward (checkpointing) or the
    start of the backward (none), within 1% as the planner's other peak tests."""
    planned, measured = _vlm_case(tower, checkpointing, {"num_hidden_layers": 4})
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("tower", [False, True], ids=["frozen", "adapted"])
def test_lora_checkpointed_peak(tower):
    """LoRA (the tower frozen, or adapted with the projector saved): the frozen embeddings' output, made
    a leaf that requires grad by checkpointing's hook, stays alive to the end too."""
    planned, measured = _vlm_case(tower, True, {"num_hidden_layers": 4}, lora=True)
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("tower", [False, True], ids=["frozen", "trained"])
def test_large_tower_backward_sets_the_checkpointed_peak(tower):
    """64 patches per image and a wide MLP: a trained tower's own recomputation and backward, last, is
    the peak; a frozen tower runs none (its checkpointing hook removed), and a decoder layer's sets it."""
    vision = {"num_hidden_layers": 2, "image_size": 64, "intermediate_size": 2048}
    planned, measured = _vlm_case(tower, True, vision)
    assert planned == pytest.approx(measured, rel=0.01)


def test_text_model_checkpointed_peak():
    """The demo's language model alone: the recomputed decoder layer's backward (its MLP's gradients)
    and the rotary tables every layer reads, per row with position_ids."""
    raw = yaml.safe_load(DEMO.read_text())
    text = dict(raw["model"]["config_path"]["text_config"])
    recipe = validate_recipe(
        {
            "model": {"config_path": text, "tokenizer_path": "x", "torch_dtype": "fp32"},
            "data": {"datasets": [{"path": "d.jsonl", "type": "chat_template"}], "sequence_len": SEQ},
            "train": {"output_dir": "o", "micro_batch_size": ROWS, "mixed_precision": "no"},
        }
    )
    text.pop("model_type")
    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(**text, attn_implementation="sdpa"))
    est = estimate(inventory_of(net), recipe, DistributedSetup(), micro_batch_size=ROWS, checkpointing=True)
    batch = {**_batch(0, 0, images=False), "position_ids": torch.arange(SEQ).repeat(ROWS, 1)}
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert est.activations.peak(True) == pytest.approx(_micro_step_peak(net, batch), rel=0.01)


def test_inventory_sees_the_frozen_towers_hook_removed():
    """The demo's Idefics3 tower exposes its input embeddings, which checkpointing hooks and training
    removes again from a frozen tower (tests/unit/model/test_vlm_tower_release.py)."""
    raw = yaml.safe_load(DEMO.read_text())
    inv = inspect_model(validate_recipe(raw).model)
    assert not inv.vision.checkpointing_input_grad
