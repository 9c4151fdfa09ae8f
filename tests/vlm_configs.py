"""Configs of tiny image-text-to-text models, one per vision family finetune knows
(finetune/model/families.py), built offline: a 2-layer language model and a 2-block vision tower each.
The towers with a fixed input size take 32-pixel images in 8-pixel patches, the size of the image
processors in tests/vlm_processors.py."""

from __future__ import annotations

from transformers import (
    Gemma3Config,
    Idefics3Config,
    LlavaConfig,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    SmolVLMConfig,
)

TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
TEXT |= {"num_key_value_heads": 1, "vocab_size": 64}
VIT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
VIT |= {"image_size": 32, "patch_size": 8}
SIGLIP = {"model_type": "siglip_vision_model", **VIT}
QWEN_VISION = {"depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 14}
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}


def idefics3():
    return Idefics3Config(vision_config=VIT, text_config={"model_type": "llama", **TEXT}, scale_factor=2)


def smolvlm():
    return SmolVLMConfig(vision_config=VIT, text_config={"model_type": "llama", **TEXT}, scale_factor=2)


def qwen2_vl():
    return Qwen2VLConfig(vision_config=QWEN_VISION, text_config={**TEXT, "rope_parameters": MROPE})


def qwen2_5_vl():
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    return Qwen2_5_VLConfig(vision_config=vision, text_config={**TEXT, "rope_parameters": MROPE})


def gemma3():
    return Gemma3Config(vision_config=VIT, text_config={**TEXT, "head_dim": 16}, mm_tokens_per_image=4)


def llava():
    return LlavaConfig(vision_config=SIGLIP, text_config={"model_type": "llama", **TEXT})


CONFIGS = {
    "idefics3": idefics3,
    "smolvlm": smolvlm,
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_5_vl,
    "gemma3": gemma3,
    "llava": llava,
}
"""model_type -> a function making the config of a tiny model of that type."""
