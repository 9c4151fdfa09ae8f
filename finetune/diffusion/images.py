"""Image decoding (EXIF-aware), aspect-ratio buckets, resize and crop: pure functions on PIL images.

Buckets come from diffusers' `generate_aspect_ratio_buckets` (about resolution^2 pixels each, sides
multiples of the pipeline's pixel multiple) and an image goes to the closest aspect ratio
(`find_nearest_bucket`). An image is resized to cover its bucket and cropped to it: at the centre,
or at an offset drawn from (seed, image key), so the crop is the same every time the cache is built.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


class UnreadableImage(Exception):
    """The file or bytes are not an image PIL can decode."""


def load_image(source: str | Path | bytes) -> Image.Image:
    """Decode an image as RGB with its EXIF orientation applied (phone photos are stored rotated).

    >>> load_image(b"not an image")
    Traceback (most recent call last):
    ...
    finetune.diffusion.images.UnreadableImage: cannot identify image file
    """
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image = ImageOps.exif_transpose(image)  # returns a copy with orientation 1
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise UnreadableImage(_short(exc)) from None


def _short(exc: Exception) -> str:
    text = str(exc)
    return text.split(" <")[0] if "cannot identify image file" in text else text


def make_buckets(resolution: int, multiple: int, *, enabled: bool) -> list[tuple[int, int]]:
    """(height, width) buckets: aspect-ratio buckets of ~resolution^2 pixels, or one square bucket.

    >>> make_buckets(512, 64, enabled=False)
    [(512, 512)]
    >>> make_buckets(512, 64, enabled=True)[:3]
    [(512, 512), (576, 448), (448, 576)]
    """
    if not enabled:
        return [(resolution, resolution)]
    from diffusers.training_utils import generate_aspect_ratio_buckets

    return generate_aspect_ratio_buckets(resolution, divisibility=multiple)


def nearest_bucket(height: int, width: int, buckets: list[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is closest to height/width.

    >>> nearest_bucket(300, 900, [(512, 512), (384, 704), (704, 384)])
    1
    """
    from diffusers.training_utils import find_nearest_bucket

    return find_nearest_bucket(height, width, buckets)


@dataclass(frozen=True)
class Crop:
    """Where an image was cut from, in the resized image (what SDXL's time ids record)."""

    original_size: tuple[int, int]  # (h, w) after EXIF transposition, before resizing
    resized_size: tuple[int, int]  # (h, w) after resizing to cover the bucket
    top: int
    left: int
    size: tuple[int, int]  # (h, w) = the bucket

    @property
    def left_flipped(self) -> int:
        """The crop's left edge in the horizontally flipped resized image."""
        return self.resized_size[1] - self.left - self.size[1]


def crop_rng(seed: int, key: str) -> np.random.Generator:
    """The random-crop generator of one image: depends on the seed and the image, not the order."""
    return np.random.default_rng([seed, zlib.crc32(key.encode("utf-8"))])


def resize_and_crop(
    image: Image.Image, size: tuple[int, int], *, center: bool, rng: np.random.Generator | None = None
) -> tuple[Image.Image, Crop]:
    """Resize `image` to cover `size` (h, w) keeping its aspect ratio, then crop to `size`."""
    height, width = size
    scale = max(height / image.height, width / image.width)
    resized_h = max(height, round(image.height * scale))
    resized_w = max(width, round(image.width * scale))
    resized = image.resize((resized_w, resized_h), Image.Resampling.LANCZOS)
    if center:
        top, left = (resized_h - height) // 2, (resized_w - width) // 2
    else:
        if rng is None:
            raise ValueError("a random crop needs its generator")
        top = int(rng.integers(0, resized_h - height + 1))
        left = int(rng.integers(0, resized_w - width + 1))
    cropped = resized.crop((left, top, left + width, top + height))
    crop = Crop((image.height, image.width), (resized_h, resized_w), top, left, (height, width))
    return cropped, crop


def to_pixels(image: Image.Image) -> np.ndarray:
    """RGB uint8 HWC -> float32 CHW in [-1, 1] (what the VAE encodes)."""
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return np.ascontiguousarray(array.transpose(2, 0, 1))


def flip(image: Image.Image) -> Image.Image:
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
