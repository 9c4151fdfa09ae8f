"""EXIF-aware decoding, buckets, resize and crop (finetune.diffusion.images)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from finetune.diffusion import images as img


def _jpeg_with_orientation(path: Path, orientation: int) -> None:
    """A 40x20 (w x h) JPEG, left half red, right half blue, with an EXIF orientation tag."""
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.save(path, exif=exif.tobytes(), quality=95)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    path = tmp_path / "rotated.jpg"
    _jpeg_with_orientation(path, 6)  # "rotate 90 CW to display"
    with Image.open(path) as raw:
        assert raw.size == (40, 20)  # stored as taken
    loaded = img.load_image(path)
    assert loaded.size == (20, 40) and loaded.mode == "RGB"
    array = np.asarray(loaded).astype(int)
    # Rotated clockwise: the stored left (red) half ends up on top.
    assert array[5, 10, 0] > 200 and array[5, 10, 2] < 60
    assert array[35, 10, 2] > 200 and array[35, 10, 0] < 60
    assert img.load_image(path.read_bytes()).size == (20, 40)  # bytes (Hub rows) too


def test_unreadable_images_raise_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(img.UnreadableImage):
        img.load_image(b"\x89PNG but not really")
    truncated = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(truncated, "PNG")
    (tmp_path / "cut.png").write_bytes(truncated.getvalue()[:60])
    with pytest.raises(img.UnreadableImage):
        img.load_image(tmp_path / "cut.png")


def test_buckets_keep_the_pixel_budget_and_multiple() -> None:
    buckets = img.make_buckets(512, 64, enabled=True)
    assert (512, 512) in buckets and len(buckets) == len(set(buckets)) > 3
    for h, w in buckets:
        assert h % 64 == 0 and w % 64 == 0
        assert 0.8 < h * w / 512**2 < 1.2
    assert img.make_buckets(32, 4, enabled=False) == [(32, 32)]


@pytest.mark.parametrize(
    ("height", "width", "shape"),
    [
        (100, 100, "square"),
        (100, 300, "wide"),
        (300, 100, "tall"),
        (400, 500, "wide"),
        (500, 400, "tall"),
        (600, 400, "tall"),
        (700, 1000, "wide"),
        (1080, 1920, "wide"),
        (999, 1000, "square"),
    ],
)
def test_images_go_to_the_bucket_of_their_shape(height: int, width: int, shape: str) -> None:
    buckets = img.make_buckets(512, 64, enabled=True)
    index = img.nearest_bucket(height, width, buckets)
    h, w = buckets[index]
    assert {"square": h == w, "wide": w > h, "tall": h > w}[shape]
    # Exactly the bucket of the closest aspect ratio (|log ratio| apart), and that bucket is unique.
    gaps = [abs(np.log((bh / bw) / (height / width))) for bh, bw in buckets]
    assert gaps[index] == min(gaps) and sorted(gaps)[1] > min(gaps)


def test_resize_and_crop_covers_the_bucket() -> None:
    image = Image.new("RGB", (90, 30), (9, 9, 9))
    cropped, crop = img.resize_and_crop(image, (24, 44), center=True)
    assert cropped.size == (44, 24)
    assert crop.original_size == (30, 90) and crop.resized_size[0] >= 24 and crop.resized_size[1] >= 44
    assert crop.top == (crop.resized_size[0] - 24) // 2 and crop.left == (crop.resized_size[1] - 44) // 2
    assert crop.left_flipped == crop.resized_size[1] - crop.left - 44


def test_random_crops_depend_on_seed_and_image_not_on_order() -> None:
    image = Image.new("RGB", (200, 50))
    first = img.resize_and_crop(image, (32, 32), center=False, rng=img.crop_rng(1, "a.png"))[1]
    img.resize_and_crop(image, (32, 32), center=False, rng=img.crop_rng(1, "b.png"))
    again = img.resize_and_crop(image, (32, 32), center=False, rng=img.crop_rng(1, "a.png"))[1]
    assert first == again
    lefts = {
        img.resize_and_crop(image, (32, 32), center=False, rng=img.crop_rng(s, "a.png"))[1].left
        for s in range(8)
    }
    assert len(lefts) > 1


def test_pixels_are_chw_in_minus_one_one() -> None:
    pixels = img.to_pixels(Image.new("RGB", (3, 2), (255, 0, 127)))
    assert pixels.shape == (3, 2, 3) and pixels.dtype == np.float32
    assert pixels[0].max() == 1.0 and pixels[1].min() == -1.0
