"""Vision-language model families in one table: what finetune needs to know about a family of
image-text-to-text models, asked by the code instead of testing `model_type` where it is used.

Who asks what:

* the model code (finetune.model.vlm): which modules are the vision tower and the projector (`towers`,
  `projectors`): what freezes, what LoRA's ``all-linear`` leaves out, what QLoRA leaves unquantized;
* the planner (finetune.plan): how many patches an image makes (`max_pixels`: dynamic resolution, else
  the vision config's fixed image_size; `max_crops`), the bytes of its pixel values
  (`frames_per_patch`), the patch-merge factor (`merge`) and whether each row gets its own rotary
  table (`rope_per_row`);
* the data path: how the image processor lays out a batch's pixels (`pixels`, `patch_grid`), so that
  a preference pair's images are processed once for its two rows (finetune.data.batching.vision), and
  which processor attributes name image markup tokens (`IMAGE_MARKUP_ATTRIBUTES`, never trained:
  finetune.data.formats.encode).

A model whose type is in no row is `GENERIC`: the module names transformers gives most of these
models, a fixed input size from its vision config, pixel tensors with one entry per image. That is
right for most LLaVA-like models (PaliGemma, Mistral 3, ...). A family gets a row when it differs:
docs/CONTRIBUTING.md, "Add a vision family".

Not per family: FSDP's wrap classes (finetune.model.vlm.block_classes finds the repeated blocks of any
model: transformers' `_no_split_modules` is wrong for several families), DeepSpeed's bucket sizes
(the config's text and vision hidden sizes), the processor's tensors (passed to the model as the
processor makes them) and the image-token types (the processor's own `create_mm_token_type_ids`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.errors import FinetuneError

PIXEL_LAYOUTS = {
    "per_row": "one entry per row, a row's images stacked in it (pixel_values [rows, images, 3, H, W])",
    "per_image": "one entry per image or crop (pixel_values [images, 3, H, W])",
    "flat_patches": "every image's patches in one flat tensor, one `patch_grid` row (t, h, w) per image",
}
"""How a family's image processor lays out a batch's pixel values (`VisionFamily.pixels`)."""

# Attributes of processors and tokenizers that name image markup tokens, which are never trained:
# image_token (every family), boi_token / eoi_token (Gemma 3), fake_image_token / global_image_token /
# global_image_tag (Idefics3, SmolVLM), vision_start_token / vision_end_token (Qwen3-VL),
# start_image_token / end_image_token (InternVL). finetune.data.formats.encode reads them.
IMAGE_MARKUP_ATTRIBUTES = (
    "image_token",
    "boi_token",
    "eoi_token",
    "fake_image_token",
    "global_image_token",
    "global_image_tag",
    "vision_start_token",
    "vision_end_token",
    "start_image_token",
    "end_image_token",
)


def any_merge(config: Any) -> int:
    """Patches per image token where the family is unknown: a Qwen-style spatial merge or an
    Idefics3-style pixel shuffle when the config names one, else 1."""
    vision = config.vision_config
    return (getattr(vision, "spatial_merge_size", None) or getattr(config, "scale_factor", None) or 1) ** 2


def spatial_merge(config: Any) -> int:
    """Qwen2-VL: the merger joins spatial_merge_size^2 neighbouring patches into one token."""
    return config.vision_config.spatial_merge_size**2


def pixel_shuffle(config: Any) -> int:
    """Idefics3 / SmolVLM: the connector's pixel shuffle folds scale_factor^2 patches into one token."""
    return config.scale_factor**2


def pooled(config: Any) -> int:
    """Gemma 3: the projector average-pools the tower's patches down to mm_tokens_per_image tokens."""
    vision = config.vision_config
    return max((vision.image_size // vision.patch_size) ** 2 // config.mm_tokens_per_image, 1)


def one_per_patch(config: Any) -> int:
    """LLaVA: every patch of the tower's output is one image token."""
    return 1


@dataclass(frozen=True)
class VisionFamily:
    """One family of image-text-to-text models: a row of `FAMILIES`."""

    name: str
    model_types: tuple[str, ...]  # the config's model_type of its models (the top-level config's)
    towers: tuple[str, ...]  # attribute names of its vision tower
    projectors: tuple[str, ...]  # attribute names of its projector; () when it is inside the tower
    pixels: str = "per_image"  # a key of PIXEL_LAYOUTS
    patch_grid: str | None = None  # flat_patches: the tensor holding each image's patch grid (t, h, w)
    max_pixels: int | None = None  # dynamic resolution: its image processor's default max_pixels (None:
    # the tower takes images of vision_config.image_size)
    frames_per_patch: int = 1  # a patch's pixel values repeat over this many frames (temporal_patch_size)
    max_crops: int = 1  # its processor may cut a large image into up to this many crops (image splitting)
    rope_per_row: bool = False  # multimodal RoPE: every row has its own positions (the images' places)
    merge: Callable[[Any], int] = any_merge  # patches per image token, from the config


GENERIC = VisionFamily(
    name="generic",
    model_types=(),
    towers=("vision_tower", "vision_model", "visual", "vision_encoder"),
    projectors=("multi_modal_projector", "connector", "mm_projector", "multimodal_projector"),
)
"""What a model of no known family gets: the names transformers gives most towers and projectors."""

FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily(
        name="Idefics3 / SmolVLM",
        model_types=("idefics3", "smolvlm"),
        towers=("vision_model",),
        projectors=("connector",),
        pixels="per_row",
        max_crops=17,  # 4 x 4 crops of 364 pixels (the processor's defaults) + the whole image downscaled
        merge=pixel_shuffle,
    ),
    VisionFamily(
        name="Qwen2-VL / Qwen2.5-VL",
        model_types=("qwen2_vl", "qwen2_5_vl"),
        towers=("visual",),  # its merger, the projector, is inside: it trains with the tower
        projectors=(),
        pixels="flat_patches",
        patch_grid="image_grid_thw",
        max_pixels=12845056,  # what its Hub repositories' preprocessor_config.json set (16384 * 28 * 28)
        frames_per_patch=2,
        rope_per_row=True,
        merge=spatial_merge,
    ),
    VisionFamily(
        name="Gemma 3",
        model_types=("gemma3",),
        towers=("vision_tower",),
        projectors=("multi_modal_projector",),
        merge=pooled,
    ),
    VisionFamily(
        name="LLaVA",
        model_types=("llava",),
        towers=("vision_tower",),
        projectors=("multi_modal_projector",),
        merge=one_per_patch,
    ),
)


def family_for(model: Any, *, required: str | None = None) -> VisionFamily:
    """The family of a vision-language model, by its model_type (`model`: the type itself, a config,
    or a model). A type in no row gets `GENERIC`, unless `required` names something only a row can
    answer: then it is an error saying what needs it and where the row goes.

    >>> family_for("qwen2_5_vl").name, family_for("smolvlm").name, family_for("paligemma").name
    ('Qwen2-VL / Qwen2.5-VL', 'Idefics3 / SmolVLM', 'generic')
    """
    model_type = _model_type(model)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if required:
        known = ", ".join(t for family in FAMILIES for t in family.model_types)
        raise FinetuneError(
            f"{required}: model_type {model_type!r} is in no row of the vision families table (known: "
            f"{known}); add its row to finetune/model/families.py (docs/CONTRIBUTING.md, 'Add a vision family')"
        )
    return GENERIC


def patch_grid_of(keys: Any) -> str | None:
    """The tensor among `keys` (an image processor's outputs) that holds each image's patch grid, where
    a family lays its pixels out as flat patches; None when none does.

    >>> patch_grid_of(["pixel_values", "image_grid_thw"]), patch_grid_of(["pixel_values"])
    ('image_grid_thw', None)
    """
    grids = [f.patch_grid for f in FAMILIES if f.pixels == "flat_patches" and f.patch_grid in keys]
    return grids[0] if grids else None


def _model_type(model: Any) -> str:
    if isinstance(model, str):
        return model
    config = getattr(model, "config", model)  # a model (PEFT's included) or its config
    return getattr(config, "model_type", None) or ""
