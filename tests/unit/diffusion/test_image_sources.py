"""Image sources -> records: captions from metadata.jsonl / .csv / .txt, DreamBooth, the Hub, bad rows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.diffusion.sources import entry_fingerprint, load_class_images, load_entry
from finetune.errors import DataError
from finetune.recipe import DatasetEntry, DiffusionSection, dataset_entry
from tests.diffusion_data import caption, write_color_folder

SETTINGS = DiffusionSection(instance_prompt="a photo of sks thing")


def _entry(path, type_="images", **kw) -> DatasetEntry:
    return dataset_entry(path=str(path), type=type_, **kw)


@pytest.mark.parametrize("captions", ["jsonl", "csv", "txt"])
def test_captions_from_each_layout(tmp_path: Path, captions: str) -> None:
    colors = write_color_folder(tmp_path / "imgs", captions=captions, count=3)
    result = load_entry(_entry(tmp_path / "imgs"), "data.datasets[0]", SETTINGS, "raise")
    assert sorted((r.key, r.caption) for r in result.records) == sorted(
        (f"{c}.png", caption(c)) for c in colors
    )
    assert result.rows_in == 3 and not result.dropped


def test_dreambooth_folder_gets_the_instance_prompt(tmp_path: Path) -> None:
    write_color_folder(tmp_path / "imgs", captions="txt", count=2)
    result = load_entry(_entry(tmp_path / "imgs", "dreambooth"), "d", SETTINGS, "raise")
    assert [r.caption for r in result.records] == ["a photo of sks thing"] * 2


def test_missing_captions_raise_with_the_file_or_are_counted(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="txt", count=3)
    (folder / "green.txt").unlink()
    with pytest.raises(DataError, match=r"green\.png has no caption .*green\.txt.*on_bad_row: skip"):
        load_entry(_entry(folder), "data.datasets[0]", SETTINGS, "raise")
    result = load_entry(_entry(folder), "data.datasets[0]", SETTINGS, "skip")
    assert len(result.records) == 2 and result.dropped == {"no_caption": 1}
    assert result.bad_rows[0]["key"] == "green.png" and result.rows_in == 3


def test_metadata_problems_are_accounted_for(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl", count=3)
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    rows[0]["text"] = ""  # empty caption
    rows.append({"file_name": "ghost.png", "text": "not there"})  # no such image
    rows.pop(1)  # an image without a row
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = load_entry(_entry(folder), "data.datasets[0]", SETTINGS, "skip")
    assert result.dropped == {"no_caption": 2, "missing_file": 1}
    assert result.rows_in == len(result.records) + sum(result.dropped.values()) == 4
    with pytest.raises(DataError, match=r"metadata\.jsonl row 1 \(red\.png\) has no text in column 'text'"):
        load_entry(_entry(folder), "data.datasets[0]", SETTINGS, "raise")


def test_caption_column_and_conflicting_metadata(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl", count=2)
    settings = DiffusionSection(caption_column="prompt")
    with pytest.raises(DataError, match=r"set diffusion.caption_column"):
        load_entry(_entry(folder), "x", settings, "raise")
    (folder / "metadata.csv").write_text("file_name,text\n")
    with pytest.raises(DataError, match=r"both metadata.jsonl and metadata.csv"):
        load_entry(_entry(folder), "x", SETTINGS, "raise")


def test_bad_paths_are_clear(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist"):
        entry_fingerprint(_entry(tmp_path / "nope"))
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(DataError, match=r"is a folder of images"):
        entry_fingerprint(_entry(tmp_path / "file.png"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no images found"):
        load_entry(_entry(tmp_path / "empty", "dreambooth"), "x", SETTINGS, "raise")


def test_folder_fingerprint_covers_images_and_captions_only(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="txt", count=2)
    entry = _entry(folder)
    before = entry_fingerprint(entry)
    (folder / "notes.md").write_text("unrelated")
    assert entry_fingerprint(entry) == before
    (folder / "red.txt").write_text("another caption")
    assert entry_fingerprint(entry) != before


def test_class_images_are_limited_and_marked(tmp_path: Path) -> None:
    write_color_folder(tmp_path / "class", captions="txt", count=4)
    result = load_class_images(tmp_path / "class", "a photo of a square", 3)
    assert len(result.records) == 3 and all(
        r.is_prior and r.caption == "a photo of a square" for r in result.records
    )


def test_hub_image_dataset(tmp_path: Path, hub_repo_id: str) -> None:
    import datasets
    from PIL import Image

    images = [Image.new("RGB", (40, 20), (200, 10, 10)), Image.new("RGB", (20, 40), (10, 10, 200))]
    ds = datasets.Dataset.from_dict({"image": images, "text": ["a red square", ""]})
    ds = ds.cast_column("image", datasets.Image())
    ds.push_to_hub(hub_repo_id)
    with pytest.raises(DataError, match=r"row 1 has no caption"):
        load_entry(_entry(hub_repo_id), "data.datasets[0]", SETTINGS, "raise")
    result = load_entry(_entry(hub_repo_id), "data.datasets[0]", SETTINGS, "skip")
    assert [(r.key, r.caption) for r in result.records] == [("row 0", "a red square")]
    assert result.dropped == {"no_caption": 1} and result.records[0].data[:4] == b"\x89PNG"
    assert entry_fingerprint(_entry(hub_repo_id))["kind"] == "hub"
    wrong = SimpleNamespace(**{**SETTINGS.model_dump(), "image_column": "picture"})
    with pytest.raises(DataError, match=r"no column 'picture'.*diffusion.image_column"):
        load_entry(_entry(hub_repo_id), "data.datasets[0]", wrong, "raise")
