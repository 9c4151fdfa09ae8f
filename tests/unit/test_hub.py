"""finetune.hub against the test Hub (tests/hub_server.py): real HTTP, real huggingface_hub/datasets."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

import finetune.hub
from finetune.hub import pull_prepared_dataset, push_folder, push_prepared_dataset, upsert_card_section


def _packed_rows(seed: int, num_rows: int) -> dict[str, list]:
    """Rows shaped like packed training data: list-of-int columns of varying length."""
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "seq_lens": []}
    for i in range(num_rows):
        lengths = [2 + (seed + i) % 3, 1 + (seed * i) % 4]
        ids = [(seed * 31 + i * 7 + j) % 32000 for j in range(sum(lengths))]
        rows["input_ids"].append(ids)
        rows["labels"].append([-100 if j == 0 else t for j, t in enumerate(ids)])
        rows["position_ids"].append([p for n in lengths for p in range(n)])
        rows["seq_lens"].append(lengths)
    return rows


def _prepared(seed: int) -> DatasetDict:
    return DatasetDict(
        train=Dataset.from_dict(_packed_rows(seed, 5)), eval=Dataset.from_dict(_packed_rows(seed + 100, 2))
    )


def _manifest(fingerprint: str, dataset_dict: DatasetDict) -> dict:
    return {
        "fingerprint": fingerprint,
        "format_version": 1,
        "tokenizer": "llama2 | sentencepiece",
        "splits": {split: {"num_rows": ds.num_rows} for split, ds in dataset_dict.items()},
        "dropped": [{"reason": "too_long", "count": 1}],
    }


def test_push_folder_uploads_through_lfs_and_downloads(tmp_path, hub_server, hub_repo_id):
    folder = tmp_path / "adapter"
    (folder / "nested").mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}\n')
    (folder / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (folder / "nested" / "notes.txt").write_text("small text file\n")

    sha = push_folder(folder, hub_repo_id, commit_message="Upload adapter")

    assert re.fullmatch(r"[0-9a-f]{40}", sha) and sha == hub_server.head_sha(hub_repo_id)
    batch = hub_server.find_requests("POST", rf"^/{re.escape(hub_repo_id)}\.git/info/lfs/objects/batch$")
    assert [r.status for r in batch] == [200]
    assert [r.status for r in hub_server.find_requests("PUT", r"^/_lfs/upload/")][-1:] == [200]
    assert hub_server.file_entry(hub_repo_id, "adapter_model.safetensors").lfs
    assert not hub_server.file_entry(hub_repo_id, "adapter_config.json").lfs
    with pytest.raises(RepositoryNotFoundError):  # private by default: invisible without a token
        HfApi(token=False).model_info(hub_repo_id)

    local = snapshot_download(hub_repo_id, revision=sha, cache_dir=tmp_path / "cache")

    for name in ("adapter_config.json", "adapter_model.safetensors", "nested/notes.txt"):
        assert (Path(local) / name).read_bytes() == (folder / name).read_bytes()
    # The LFS file came through the "CDN" redirect, the small ones straight from /resolve.
    assert hub_server.find_requests("GET", r"^/_cdn/[0-9a-f]{64}$")


def test_push_folder_into_a_subfolder_keeps_other_files(tmp_path, hub_server, hub_repo_id):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "weights.bin").write_bytes(b"\0\1\2")
    push_folder(tmp_path / "a", hub_repo_id, path_in_repo="checkpoints/step-1")
    push_folder(tmp_path / "a", hub_repo_id, path_in_repo="checkpoints/step-2")

    assert hub_server.list_files(hub_repo_id) == [
        ".gitattributes",
        "checkpoints/step-1/weights.bin",
        "checkpoints/step-2/weights.bin",
    ]


def test_write_without_token_is_refused(tmp_path, monkeypatch, hub_server, hub_repo_id):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "x.txt").write_text("x")
    monkeypatch.delenv("HF_TOKEN")

    with pytest.raises(HfHubHTTPError) as err:
        push_folder(tmp_path / "f", hub_repo_id)

    assert err.value.response.status_code == 401
    assert not hub_server.repo_exists(hub_repo_id)
    assert hub_server.find_requests("POST", "^/api/repos/create$")[-1].status == 401


def test_prepared_dataset_round_trip_with_two_configs(hub_server, hub_repo_id):
    first, second = _prepared(seed=1), _prepared(seed=2)
    first_manifest, second_manifest = _manifest("fp-aaaa", first), _manifest("fp-bbbb", second)

    push_prepared_dataset(first, hub_repo_id, config_name="fp-aaaa", manifest=first_manifest)
    push_prepared_dataset(second, hub_repo_id, config_name="fp-bbbb", manifest=second_manifest)

    for config_name, expected, expected_manifest in (
        ("fp-aaaa", first, first_manifest),
        ("fp-bbbb", second, second_manifest),
    ):
        pulled = pull_prepared_dataset(hub_repo_id, config_name)
        assert pulled is not None
        dataset_dict, manifest = pulled
        assert manifest == expected_manifest
        assert sorted(dataset_dict) == ["eval", "train"]
        for split in ("train", "eval"):
            assert dataset_dict[split].to_list() == expected[split].to_list()
        shard = f"{config_name}/train-00000-of-00001.parquet"
        assert hub_server.file_entry(hub_repo_id, shard, repo_type="dataset").lfs

    card = hub_server.read_file(hub_repo_id, "README.md", repo_type="dataset").decode()
    configs = HfApi().dataset_info(hub_repo_id).card_data.to_dict()["configs"]
    assert sorted(c["config_name"] for c in configs) == ["fp-aaaa", "fp-bbbb"]
    for fingerprint in ("fp-aaaa", "fp-bbbb"):
        assert card.count(f"<!-- finetune:config:{fingerprint}:start -->") == 1
        assert f"Fingerprint: `{fingerprint}`" in card
    assert "llama2 \\| sentencepiece" in card  # table cells are escaped
    assert pull_prepared_dataset(hub_repo_id, "fp-cccc") is None


def test_repush_replaces_the_config_section(hub_server, hub_repo_id):
    data = _prepared(seed=3)
    push_prepared_dataset(data, hub_repo_id, config_name="fp-dddd", manifest=_manifest("fp-dddd", data))
    new_manifest = {**_manifest("fp-dddd", data), "format_version": 2}
    push_prepared_dataset(data, hub_repo_id, config_name="fp-dddd", manifest=new_manifest)

    card = hub_server.read_file(hub_repo_id, "README.md", repo_type="dataset").decode()
    assert card.count("<!-- finetune:config:fp-dddd:start -->") == 1
    assert '"format_version": 2' in card and '"format_version": 1' not in card
    manifest_file = hub_server.read_file(hub_repo_id, "manifests/fp-dddd.json", repo_type="dataset")
    assert b'"format_version": 2' in manifest_file


def test_card_commit_retries_when_another_push_lands_in_between(monkeypatch, hub_server, hub_repo_id):
    real_read_text = finetune.hub._read_text
    calls = []

    def read_text_then_someone_else_commits(api, repo_id, filename, **kwargs):
        text = real_read_text(api, repo_id, filename, **kwargs)
        if not calls:  # the first card read: a concurrent push moves the branch head
            api.upload_file(
                path_or_fileobj=b"x", path_in_repo="other.txt", repo_id=repo_id, repo_type="dataset"
            )
        calls.append(kwargs["revision"])
        return text

    monkeypatch.setattr(finetune.hub, "_read_text", read_text_then_someone_else_commits)
    data = _prepared(seed=6)
    push_prepared_dataset(data, hub_repo_id, config_name="fp-eeee", manifest=_manifest("fp-eeee", data))

    assert len(calls) == 2 and calls[0] != calls[1]  # re-read the card at the new head
    assert hub_server.find_requests("POST", r"/commit/main$")[-2].status == 412
    files = hub_server.list_files(hub_repo_id, repo_type="dataset")
    assert {"other.txt", "manifests/fp-eeee.json", "README.md"} <= set(files)


def test_pull_from_a_missing_repo_returns_none(hub_repo_id):
    assert pull_prepared_dataset(hub_repo_id, "fp-aaaa") is None


def test_pull_of_a_config_without_manifest_or_with_a_bad_token_raises(monkeypatch, hub_repo_id):
    _prepared(seed=5).push_to_hub(hub_repo_id, config_name="foreign")  # not through finetune: no manifest

    with pytest.raises(RuntimeError, match=r"no manifests/foreign\.json"):
        pull_prepared_dataset(hub_repo_id, "foreign")
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_right_token")
    with pytest.raises(RuntimeError, match="Could not read prepared dataset"):
        pull_prepared_dataset(hub_repo_id, "foreign")


def test_invalid_config_name_is_refused_before_any_upload(hub_server, hub_repo_id):
    with pytest.raises(ValueError, match="Invalid config name"):
        push_prepared_dataset(_prepared(seed=4), hub_repo_id, config_name="manifests", manifest={})
    assert not hub_server.repo_exists(hub_repo_id, repo_type="dataset")


def test_upsert_card_section_keeps_front_matter_and_other_sections():
    front_matter = "---\nconfigs:\n- config_name: a\n  data_files: a/*\n---\n"
    card = upsert_card_section(front_matter, "a", "## A v1")
    card = upsert_card_section(card, "b", "## B")
    card = upsert_card_section(card, "a", "## A v2")

    assert card.startswith(front_matter)
    assert "## A v2" in card and "## A v1" not in card
    assert card.index("finetune:config:a:start") < card.index("finetune:config:b:start")
    assert upsert_card_section(None, "a", "## A").count("<!-- finetune:config:a:end -->") == 1
