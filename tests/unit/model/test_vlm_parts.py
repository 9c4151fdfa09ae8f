"""finetune.model.vlm on a tiny Idefics3 built from a config: which parts train (LoRA on the language model by
default, the vision tower and projector frozen unless asked), and the recipe rules of model.kind vlm."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForImageTextToText, Idefics3Config
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from finetune.data.batching.vision import collate_vlm
from finetune.model.adapters import apply_lora
from finetune.model.vlm import freeze, lora_settings, parts
from finetune.recipe import Recipe, validate_recipe
from finetune.recipe.errors import format_validation_error

CONFIG = {
    "image_token_id": 5,
    "scale_factor": 2,
    "vision_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "image_size": 32, "patch_size": 8,
    },
    "text_config": {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
    },
}  # fmt: skip


@pytest.fixture
def net():
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(Idefics3Config(**CONFIG))


def test_parts_are_found(net):
    assert parts(net) == (["model.vision_model"], ["model.connector"])


def test_full_fine_tuning_freezes_vision_tower_and_projector_unless_asked(net):
    freeze(net, train_vision_tower=False, train_projector=True)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert not any(n.startswith("model.vision_model.") for n in trainable)
    assert any(n.startswith("model.connector.") for n in trainable)
    assert any(n.startswith("model.text_model.") for n in trainable)


@pytest.mark.parametrize("vision", [False, True])
def test_lora_all_linear_is_the_language_model(net, vision):
    lora = validate_recipe(_recipe()).lora
    targets = lora_settings(net, "all-linear", [], train_vision_tower=vision, train_projector=True)
    peft = apply_lora(net, lora, gradient_checkpointing=False, **targets)
    adapted = {n.split(".lora_A")[0] for n, _ in peft.named_parameters() if ".lora_A" in n}
    assert any(".text_model." in n for n in adapted)
    assert any(".vision_model." in n for n in adapted) == vision
    assert not any("connector" in n or "lm_head" in n for n in adapted)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert any("connector" in n and "modules_to_save" in n for n in trainable)  # the projector, fully


def test_collate_gives_the_model_what_it_needs(net):
    processor = type(
        "P",
        (),
        {
            "image_processor": Idefics3ImageProcessorPil(
                do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
            )
        },
    )()
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buffer, format="PNG")
    image_row = {
        "input_ids": [1, 6, 5, 5, 5, 5, 6, 9, 10],
        "labels": [-100] * 7 + [10, 2],
        "images": [buffer.getvalue()],
    }
    text_row = {"input_ids": [1, 9, 10], "labels": [-100, 10, 2], "images": []}
    batch = collate_vlm([image_row, text_row], pad_token_id=0, processor=processor)
    assert "position_ids" not in batch and batch["pixel_values"].shape[:2] == (1, 1)
    assert batch["attention_mask"].tolist()[1] == [1, 1, 1] + [0] * 6
    loss = net(**batch).loss
    assert torch.isfinite(loss)


def _recipe(**data) -> dict:
    return {
        "model": {"kind": "vlm", "model_path": "HuggingFaceTB/SmolVLM-Instruct"},
        "data": {"datasets": [{"path": "d.jsonl", "type": "chat_template"}], **data},
        "lora": {"enable_lora": True},
        "train": {"output_dir": "out"},
    }


def test_packing_is_refused_with_its_reason_and_off_by_default():
    assert validate_recipe(_recipe()).data.sample_packing is False
    with pytest.raises(ValidationError) as info:
        validate_recipe(_recipe(sample_packing=True))
    message = format_validation_error(info.value, Recipe)
    assert "data.sample_packing" in message and "image features" in message


def test_what_vision_language_recipes_cannot_do_yet_is_refused_with_the_reason():
    recipe = _recipe()
    recipe["train"]["objective"] = "reward"  # a sequence-classification head: not for vision-language models
    with pytest.raises(ValidationError) as info:
        validate_recipe(recipe)
    message = format_validation_error(info.value, Recipe)
    assert "train.objective" in message and "vision-language models train with" in message
