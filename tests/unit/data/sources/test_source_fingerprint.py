"""What identifies a source (file contents, Hub commits, URL metadata) and a preparation, and the cache
hit that needs nothing else: `finetune prepare-dataset` on a prepared recipe imports neither torch,
transformers nor datasets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest

from finetune.data.sources.location import source_fingerprint
from finetune.data.sources.readers import load_source
from finetune.errors import DataError
from finetune.recipe import DatasetEntry, dataset_entry

ROWS = [{"text": f"row {i}", "n": i} for i in range(10)]


def entry(path, **kw) -> DatasetEntry:
    return dataset_entry(path=str(path), type=kw.pop("type", "completion"), **kw)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ sources


def test_fingerprint_local_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    fp = source_fingerprint(entry(path))
    assert fp["kind"] == "local_file"
    [f] = fp["files"]
    assert f["name"] == "d.jsonl" and f["size"] == path.stat().st_size and len(f["blake2b"]) == 32
    json.dumps(fp)  # serializable
    copy = write_jsonl(tmp_path / "other" / "d.jsonl", ROWS)
    assert source_fingerprint(entry(copy)) == fp  # same name and content, anywhere
    write_jsonl(path, [*ROWS[:-1], {"text": "row X", "n": 9}])  # same size, other content
    assert path.stat().st_size == f["size"]
    assert source_fingerprint(entry(path)) != fp


def test_fingerprint_directory_and_data_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "d" / "sub" / "b.jsonl", ROWS[4:])
    (tmp_path / "d" / "README.md").write_text("not data")
    (tmp_path / "d" / ".hidden").mkdir()
    write_jsonl(tmp_path / "d" / ".hidden" / "c.jsonl", ROWS)
    fp = source_fingerprint(entry(tmp_path / "d"))
    assert fp["kind"] == "local_dir"
    assert [f["name"] for f in fp["files"]] == ["a.jsonl", "sub/b.jsonl"]
    (tmp_path / "d" / "sub" / "b.jsonl").write_text(json.dumps({"text": "changed", "n": 0}) + "\n")
    assert source_fingerprint(entry(tmp_path / "d")) != fp
    only_a = source_fingerprint(entry(tmp_path / "d", data_files="a.jsonl"))
    assert [f["name"] for f in only_a["files"]] == ["a.jsonl"]
    with pytest.raises(DataError, match="no file"):
        source_fingerprint(entry(tmp_path / "d", data_files="zzz.jsonl"))


def test_fingerprint_directory_with_ds_type_covers_unknown_extensions(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "rows.data", ROWS)
    fp = source_fingerprint(entry(tmp_path / "d", ds_type="json"))
    assert [f["name"] for f in fp["files"]] == ["rows.data"]
    assert len(load_source(entry(tmp_path / "d", ds_type="json", data_files="rows.data"))) == 10


def test_fingerprint_saved_dataset(tmp_path: Path) -> None:
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "s"))
    fp = source_fingerprint(entry(tmp_path / "s"))
    names = [f["name"] for f in fp["files"]]
    assert fp["kind"] == "saved_dataset"
    assert "dataset_dict.json" in names and "train/state.json" in names and "train/dataset_info.json" in names
    assert any(n.startswith("train/") and n.endswith(".arrow") for n in names)


def test_fingerprint_missing_local(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        source_fingerprint(entry(tmp_path / "gone.jsonl"))


def test_fingerprint_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    seen = {}

    def dataset_info(self, repo_id, revision=None, **kwargs):
        seen.update(repo=repo_id, revision=revision)
        return SimpleNamespace(sha="0123abcd" * 5)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    fp = source_fingerprint(entry("openai/gsm8k", revision="main"))
    assert fp == {"kind": "hub", "repo": "openai/gsm8k", "revision": "main", "sha": "0123abcd" * 5}
    assert seen == {"repo": "openai/gsm8k", "revision": "main"}


def test_fingerprint_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def unreachable(self, repo_id, revision=None, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    with pytest.raises(DataError) as err:
        source_fingerprint(entry("org/name"))
    msg = str(err.value)
    assert "unreachable" in msg and "local path" in msg and "skip_prepare_dataset" in msg


def test_fingerprint_url(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    fp = source_fingerprint(entry(path.as_uri()))
    assert fp["kind"] == "url"
    [f] = fp["files"]
    assert f["size"] == str(path.stat().st_size) and "mtime" in f
    with pytest.raises(DataError, match="could not read the metadata"):
        source_fingerprint(entry((tmp_path / "missing.jsonl").as_uri()))
