"""Images of vision-language chat rows: where an image comes from, and the check that it opens.

A message's content may be a list of parts (``{"type": "image", "image": "images/0001.png"}``,
``{"type": "text", "text": "..."}``), or a string with ``<image>`` placeholders whose images are in a
column of the row (LLaVA style, ``field_images``). Either way an image is one of: a path relative
to the data file (never a URL: the prepared dataset must not depend on the network), a Parquet /
``datasets.Image`` struct ``{"bytes", "path"}``, raw bytes, or a decoded ``PIL.Image``.

Every image is opened and fully decoded at prepare time (`load_image`), so a missing, truncated or
non-image file is a bad row naming the row, the field and the path (an error, or a counted drop with
``data.on_bad_row: skip``), never a crash in the middle of training. The prepared rows keep the
image bytes (after the ``data.image_max_pixels`` resize), so training needs neither the raw files
nor the paths.

>>> fits(640, 480, None), fits(640, 480, 100_000)
((640, 480), (365, 273))
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from finetune.data.formats.rows import MISSING_FIELD, WRONG_TYPE, BadRow

# Bad-row reasons of images (the manifest counts them as "bad_row:<reason>").
IMAGE_MISSING = "image_missing"
IMAGE_UNREADABLE = "image_unreadable"
IMAGE_COUNT_MISMATCH = "image_count_mismatch"
IMAGE_OUTSIDE = "image_outside_data_folder"
"""Bad-row reason: an image path that resolves (symlinks followed) outside the data file's folder: a data
row must not pull any file of the machine into the prepared data (data.allow_image_paths_outside)."""
# A row with images for a model that cannot read them (model.kind is not vlm): an error whatever
# data.on_bad_row says, as every such row would lose its images.
IMAGES_NEED_VLM = "images_need_vlm"

IMAGE_PLACEHOLDER = "<image>"
"""Where an image of the row's ``field_images`` column goes in a message's text (LLaVA style)."""

SENTINEL = "\ue002"
"""Stands for an image inside a normalized message's text (a private-use character: no data or
template produces it). finetune.data.formats.encode turns it back into an image part for the template."""


def fits(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """(width, height) scaled down, aspect kept, so that width * height <= max_pixels."""
    if not max_pixels or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def image_bytes(value: Any, where: str, base_dir: Path | None, *, outside_ok: bool = False) -> bytes | BadRow:
    """The encoded bytes of one image reference, or the bad row saying why there are none. A path must
    resolve inside `base_dir` (the data file's folder; symlinks followed) unless `outside_ok`: it is
    checked before the file is opened."""
    from PIL import Image

    if value is None:
        return BadRow(where, MISSING_FIELD, "the image is missing or null")
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):  # a Parquet / datasets.Image struct
        if value.get("bytes"):
            return bytes(value["bytes"])
        return image_bytes(value.get("path"), where, base_dir, outside_ok=outside_ok)
    if not isinstance(value, str):
        return BadRow(
            where,
            WRONG_TYPE,
            f"an image should be a path, bytes or an image, got {type(value).__name__}",
        )
    if "://" in value:
        detail = (
            f"{where!r} is a URL ({value}): images must be local files (relative to the data file) or bytes"
        )
        return BadRow(where, WRONG_TYPE, detail)
    if base_dir is None and not Path(value).is_absolute():
        detail = f"relative image path {value!r} in a dataset that is not a local file"
        return BadRow(
            where, IMAGE_MISSING, detail + "; store the images as bytes (Parquet) or use absolute paths"
        )
    path = Path(value) if base_dir is None else base_dir / value
    if not outside_ok:
        outside = outside_folder(path, base_dir)
        if outside is not None:
            return BadRow(where, IMAGE_OUTSIDE, f"{where!r}: image path {value!r} {outside}")
    try:
        return path.read_bytes()
    except OSError as exc:
        detail = (
            f"{where!r}: image file {value!r} cannot be read (resolved to {path.resolve()}): {exc.strerror}"
        )
        return BadRow(where, IMAGE_MISSING, detail)


def outside_folder(path: Path, base_dir: Path | None) -> str | None:
    """Why `path` may not be read as a data row's image (it resolves outside `base_dir`, symlinks
    followed, or there is no folder to be inside: a Hub dataset's row naming a local file), or None.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> outside_folder(root / "images" / "a.png", root) is None
    True
    >>> outside_folder(root / ".." / "etc" / "passwd", root).startswith("resolves to")
    True
    """
    fix = "keep the images in the data file's folder, or set data.allow_image_paths_outside: true if you trust the data"
    if base_dir is None:
        return f"names a local file, and the dataset has no local folder to hold it; {fix}"
    resolved, root = path.resolve(), base_dir.resolve()
    if resolved == root or root in resolved.parents:
        return None
    return f"resolves to {resolved}, outside the data file's folder {root}; {fix}"


def load_image(
    value: Any, where: str, base_dir: Path | None, max_pixels: int | None, *, outside_ok: bool = False
) -> bytes | BadRow:
    """One image's bytes, opened and fully decoded here (so a damaged file fails now, not in training),
    resized to ``max_pixels`` when larger (then re-encoded as PNG); or the bad row of why it can't be. A
    path outside `base_dir` is a bad row unless `outside_ok` (`image_bytes`)."""
    from PIL import Image

    data = image_bytes(value, where, base_dir, outside_ok=outside_ok)
    if isinstance(data, BadRow):
        return data
    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # the container and its checksums
        image = Image.open(io.BytesIO(data))
        image.load()  # every pixel: verify() does not decode, so a truncated file would pass it
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError...)
        return BadRow(where, IMAGE_UNREADABLE, f"not a readable image ({describe(value)}): {exc}")
    size = fits(image.width, image.height, max_pixels)
    if size == (image.width, image.height):
        return data
    buffer = io.BytesIO()
    image.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(buffer, format="PNG")
    return buffer.getvalue()


def decode(data: bytes):
    """An RGB ``PIL.Image`` of prepared image bytes (what the processor gets)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    return image.convert("RGB")


def describe(value: Any) -> str:
    """How an image reference is named in an error: its path, else its kind and size."""
    if isinstance(value, str):
        return f"path {value!r}"
    if isinstance(value, dict) and value.get("path") and not value.get("bytes"):
        return f"path {value['path']!r}"
    if isinstance(value, dict):
        value = value.get("bytes") or b""
    return f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else type(value).__name__


def base_dir(path: str) -> Path | None:
    """Where relative image paths of a dataset entry start: the data file's folder (the folder itself
    for a directory source); None for Hub ids and URLs."""
    local = Path(path).expanduser()
    if "://" in path or not local.exists():
        return None
    return local if local.is_dir() else local.parent


def parts_text(parts: list, where: str) -> tuple[str, list[Any]] | BadRow:
    """A message content that is a list of parts, as its text with a `SENTINEL` per image, and the
    image references in order; or the bad row of a malformed part.

    >>> parts_text([{"type": "image", "image": "a.png"}, {"type": "text", "text": "Colour?"}], "messages[0].content")
    ('\\ue002Colour?', ['a.png'])
    """
    text, refs = [], []
    for k, part in enumerate(parts):
        at = f"{where}[{k}]"
        if isinstance(part, str):  # a bare string among the parts is text (transformers accepts it)
            text.append(part)
            continue
        if not isinstance(part, dict):
            return BadRow(at, WRONG_TYPE, f"{at!r} should be a part mapping, got {type(part).__name__}")
        kind = part.get("type") or ("image" if part.get("image") is not None else "text")
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind == "image":
            refs.append(part.get("image") if part.get("image") is not None else part.get("path"))
            text.append(SENTINEL)
        else:
            detail = f"{at!r} is a part of type {kind!r} without its value; parts are {{type: text, text}} or {{type: image, image}}"
            return BadRow(at, WRONG_TYPE, detail)
    return "".join(text), refs


def placeholders(text: str, refs: list[Any], where: str) -> tuple[str, list[Any]] | BadRow:
    """LLaVA style: `IMAGE_PLACEHOLDER` in a conversation's text replaced by `SENTINEL`s, checked
    against the row's image list (one image per placeholder, in order)."""
    count = text.count(IMAGE_PLACEHOLDER)
    if count != len(refs):
        detail = (
            f"the messages have {count} {IMAGE_PLACEHOLDER} placeholder(s) but {where!r} holds {len(refs)} image(s); "
            "each image needs one placeholder where it goes in the text"
        )
        return BadRow(where, IMAGE_COUNT_MISMATCH, detail)
    return text.replace(IMAGE_PLACEHOLDER, SENTINEL), refs


def as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a vision-language chat template: every content a list of parts, each `SENTINEL`
    an image part (templates such as SmolVLM's read only lists), the image references left out.

    >>> as_parts([{"role": "user", "content": "\\ue002Hi", "images": ["a.png"]}])
    [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'Hi'}]}]
    """
    out = []
    for message in messages:
        content = message.get("content")
        rest = {k: v for k, v in message.items() if k not in ("content", "images")}
        if isinstance(content, str):
            parts: list[dict[str, Any]] = []
            for k, piece in enumerate(content.split(SENTINEL)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            content = parts or [{"type": "text", "text": ""}]
        out.append({**rest, "content": content})
    return out
