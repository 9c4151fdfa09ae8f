"""What a vision-language model's vision tower sees per row (`image_input`): images per row and
patches per image, from the recipe, the processor (when it is a local folder: the planner downloads
nothing) and the model config, or the plan's flags; each figure says where it came from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError
from finetune.model.families import family_for
from finetune.plan.activations import ImageInput
from finetune.plan.inventory import VisionInventory
from finetune.recipe import Recipe


def image_input(
    vision: VisionInventory,
    recipe: Recipe,
    *,
    images_per_row: float | None = None,
    patches_per_image: int | None = None,
) -> ImageInput:
    """Images per row (the flag, else the most in a row of the prepared data when the recipe's
    preparation is on disk, else 1) and patches per image (the flag, else the largest image the
    processor settings allow)."""
    if images_per_row is not None and images_per_row <= 0:
        raise FinetuneError(f"--images-per-row {images_per_row}: expected a positive number")
    if patches_per_image is not None and patches_per_image <= 0:
        raise FinetuneError(f"--patches-per-image {patches_per_image}: expected a positive number")
    rows, rows_text = images_per_row, "--images-per-row"
    if rows is None:
        counted = prepared_images_per_row(recipe)
        rows, rows_text = counted if counted else (1, "assumed (set --images-per-row)")
    processor = _local_image_processor(recipe)
    if patches_per_image is not None:
        # pixel_values scale with the patches: each patch is patch_size^2 RGB fp32 values per frame
        patches, how = patches_per_image, "--patches-per-image"
        pixel_bytes = 4 * 3 * vision.patch_size**2 * patches * vision.family.frames_per_patch
    else:
        patches, pixel_bytes, how = _patches(vision, recipe, processor)
    source = f"{rows:g} image(s) per row, {rows_text}; {patches} patches per image, {how}"
    return ImageInput(rows, patches, pixel_bytes, source)


def prepared_images_per_row(recipe: Recipe) -> tuple[int, str] | None:
    """(the most images in a training row, how it was found) from the recipe's prepared dataset, or None
    when it is not on disk. Looked up only when that is cheap: local data and processor (the
    fingerprint hashes them; a Hub source would need the network). Arrow's list lengths are read
    without decoding an image."""
    data = recipe.data
    entries = list(data.datasets)
    local = all(Path(getattr(e, "path", "")).exists() for e in entries)
    root = Path(data.dataset_prepared_path) if data.dataset_prepared_path else None
    if not (local and root is not None and root.is_dir() and _local(recipe.model.tokenizer_source)):
        return None
    import pyarrow.compute as pc

    from finetune.data.prepare.cache import load_complete
    from finetune.data.prepare.fingerprint import cached

    try:
        found = cached(recipe)
        prepared = load_complete(found[0]) if found else None
    except (FinetuneError, OSError, ValueError):
        return None  # no usable preparation: the default applies, and the plan says so
    if prepared is None or "images" not in prepared.train.column_names or not len(prepared.train):
        return None
    counts = pc.list_value_length(prepared.train.data.column("images"))
    most, mean = pc.max(counts).as_py() or 0, pc.mean(counts).as_py() or 0.0
    how = (
        f"the most in a row of the prepared data at {found[0]} (mean {mean:.2f}; a micro batch of such rows)"
    )
    return max(most, 1), how


def _local(source) -> bool:
    return isinstance(source, str) and Path(source).is_dir()


def _local_image_processor(recipe: Recipe) -> Any | None:
    """The recipe's image processor when its processor is a local folder (None otherwise)."""
    source = recipe.model.tokenizer_source
    if not _local(source):
        return None
    from finetune.model.vlm import auto_processor

    return auto_processor(source).image_processor


def _patches(vision: VisionInventory, recipe: Recipe, processor: Any | None) -> tuple[int, int, str]:
    """(patches per image, pixel_values bytes per image, how they were found) for the largest image, as
    its family cuts images (finetune.model.families)."""
    family, p = vision.family, vision.patch_size
    if family.max_pixels:
        # Dynamic resolution (Qwen2-VL): an image is resized to at most max_pixels (data.image_max_pixels
        # caps it first) and cut into patch x patch tiles, each repeated over frames_per_patch frames.
        max_pixels, how = _max_pixels(vision, recipe, processor)
        merge_side = p * math.isqrt(vision.merge)
        patches = (max_pixels // merge_side**2) * vision.merge
        return patches, 4 * patches * 3 * family.frames_per_patch * p * p, how
    side = vision.image_size
    if not side:  # the tower takes any size: only a family row says how large an image gets
        family_for(vision.model_type, required="the planner's patches per image (or set --patches-per-image)")
    per_crop = (side // p) ** 2
    crops, how = 1, f"one {side}px image of {per_crop} patches (model config)"
    if processor is not None and getattr(processor, "do_image_splitting", False):
        # Idefics3 / SmolVLM: up to ceil(longest_edge / crop)^2 crops plus the whole image, downscaled
        longest = processor.size.get("longest_edge", side)
        crop = (getattr(processor, "max_image_size", None) or {}).get("longest_edge", side)
        crops = math.ceil(longest / crop) ** 2 + 1
        how = f"the processor's largest split: {crops} crops of {per_crop} patches"
    elif family.max_crops > 1 and processor is None:
        how += (
            f"; {family.name} processors split large images into up to {family.max_crops} crops: "
            "set --patches-per-image"
        )
    return crops * per_crop, crops * 4 * 3 * side * side, how


def _max_pixels(vision: VisionInventory, recipe: Recipe, processor: Any | None) -> tuple[int, str]:
    if recipe.data.image_max_pixels:
        return recipe.data.image_max_pixels, f"data.image_max_pixels {recipe.data.image_max_pixels}"
    size = getattr(processor, "size", None) or {}
    limit = size.get("longest_edge") or getattr(processor, "max_pixels", None)
    if limit:
        return int(limit), f"the processor's max_pixels {int(limit)}"
    default = vision.family.max_pixels
    return default, f"{vision.family.name}'s default max_pixels {default} (set data.image_max_pixels)"
