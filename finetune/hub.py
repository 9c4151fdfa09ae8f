"""Push and pull to the Hugging Face Hub: folders (adapters, models) and prepared datasets.

A prepared dataset lives in a dataset repo as one `datasets` config per preparation: the parquet
shards under `<config_name>/`, written by `DatasetDict.push_to_hub`; its manifest under
`manifests/<config_name>.json`; and a section of the dataset card (README.md) that shows the
fingerprint, a summary and the manifest. Several configs share a repo without touching each other.

The token comes from the environment (`HF_TOKEN`) or a `huggingface_hub` login, never from an
argument, and is never logged. `huggingface_hub` and `datasets` are imported inside the functions
so that importing this module stays cheap.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from huggingface_hub import HfApi

logger = logging.getLogger(__name__)

MANIFESTS_DIR = "manifests"
CARD_FILENAME = "README.md"
# `data` is refused by `datasets`; `manifests` would make push_to_hub delete our manifests.
_RESERVED_CONFIG_NAMES = {"data", MANIFESTS_DIR}
_CONFIG_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_FRONT_MATTER_RE = re.compile(r"^(\s*---\r?\n[\s\S]*?\r?\n---[ \t]*(?:\r?\n|$))")
_MAX_CARD_COMMIT_ATTEMPTS = 5


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    repo_type: str = "model",
    private: bool = True,
    commit_message: str = "Upload with finetune",
    path_in_repo: str | None = None,
) -> str:
    """Upload every file of `folder` to `repo_id` in one commit and return the commit sha.

    The repo is created (private by default) if it does not exist; an existing repo keeps its
    visibility. Files identical to those already on the Hub are skipped by `huggingface_hub`.

    >>> push_folder("outputs/run1/final", "me/tiny-llama-lora")  # doctest: +SKIP
    '1f0c3e...'
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"push_folder: {folder} is not a directory; pass the folder to upload.")
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        path_in_repo=path_in_repo,
        repo_type=repo_type,
        commit_message=commit_message,
    )
    logger.info("Pushed %s to %s repo %s at commit %s", folder, repo_type, repo_id, commit.oid)
    return commit.oid


def push_prepared_dataset(
    dataset_dict: datasets.DatasetDict,
    repo_id: str,
    *,
    config_name: str,
    manifest: dict,
    private: bool = True,
) -> None:
    """Push a prepared `DatasetDict` as config `config_name` of dataset repo `repo_id`.

    Two commits: `DatasetDict.push_to_hub` (parquet shards through LFS, card metadata for this
    config), then the manifest as `manifests/<config_name>.json` together with this config's
    section of the dataset card. Other configs' shards, metadata and card sections are kept.
    """
    _check_config_name(config_name)
    manifest_json = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"  # fails early
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    data_commit = dataset_dict.push_to_hub(
        repo_id,
        config_name=config_name,
        private=private,
        commit_message=f"Upload prepared dataset config {config_name}",
    )
    api = HfApi()
    section = render_card_section(repo_id, config_name, manifest, dataset_dict)
    parent = data_commit.oid
    # The card is read, edited and committed on top of `parent`; if another push landed in
    # between (412 from the Hub), start again from the new head so no one's section is lost.
    for attempt in range(1, _MAX_CARD_COMMIT_ATTEMPTS + 1):
        card = upsert_card_section(
            _read_text(api, repo_id, CARD_FILENAME, revision=parent), config_name, section
        )
        operations = [
            CommitOperationAdd(path_in_repo=CARD_FILENAME, path_or_fileobj=card.encode()),
            CommitOperationAdd(
                path_in_repo=f"{MANIFESTS_DIR}/{config_name}.json", path_or_fileobj=manifest_json.encode()
            ),
        ]
        try:
            commit = api.create_commit(
                repo_id,
                operations,
                commit_message=f"Add manifest and card section for config {config_name}",
                repo_type="dataset",
                parent_commit=parent,
            )
            break
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status not in (409, 412) or attempt == _MAX_CARD_COMMIT_ATTEMPTS:
                raise
            parent = api.dataset_info(repo_id).sha
    logger.info("Pushed prepared dataset config %s to %s at commit %s", config_name, repo_id, commit.oid)


def pull_prepared_dataset(repo_id: str, config_name: str) -> tuple[datasets.DatasetDict, dict] | None:
    """Load config `config_name` of dataset repo `repo_id` and its manifest, or None if absent.

    None when the repo or the config does not exist (or the repo is private and the token cannot
    see it). Data and manifest are read at one commit, so they always match. Other failures
    (network, auth, a config without manifest) raise with the reason.
    """
    _check_config_name(config_name)
    import datasets
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    api = HfApi()
    manifest_path = f"{MANIFESTS_DIR}/{config_name}.json"
    try:
        info = api.dataset_info(repo_id)
        try:
            manifest_text = _read_text(api, repo_id, manifest_path, revision=info.sha, missing_ok=False)
        except RemoteEntryNotFoundError:
            if config_name in _card_config_names(info.card_data):
                raise RuntimeError(
                    f"Dataset repo {repo_id} has a config {config_name!r} but no {manifest_path}: it was not "
                    "pushed by finetune, or the push stopped half way. Push it again with push_prepared_dataset."
                ) from None
            return None
    except RepositoryNotFoundError:
        return None
    except HfHubHTTPError as err:
        raise RuntimeError(
            f"Could not read prepared dataset {repo_id} config {config_name!r}: {err}"
        ) from err
    manifest = json.loads(manifest_text)
    dataset_dict = datasets.load_dataset(repo_id, config_name, revision=info.sha)
    return dataset_dict, manifest


def render_card_section(
    repo_id: str, config_name: str, manifest: dict, dataset_dict: datasets.DatasetDict
) -> str:
    """The dataset card section of one config: fingerprint, splits, manifest summary and JSON."""
    fingerprint = manifest.get("fingerprint", "(not recorded)")
    lines = [
        f"## Config `{config_name}`",
        "",
        f"Prepared with finetune. Fingerprint: `{fingerprint}`.",
        "",
        "```python",
        "from datasets import load_dataset",
        f'dataset = load_dataset("{repo_id}", "{config_name}")',
        "```",
        "",
        "| split | rows | columns |",
        "|---|---|---|",
        *(
            f"| {_cell(split)} | {ds.num_rows} | {_cell(', '.join(ds.column_names))} |"
            for split, ds in dataset_dict.items()
        ),
    ]
    scalars = {k: v for k, v in manifest.items() if v is None or isinstance(v, (str, int, float, bool))}
    if scalars:
        lines += ["", "| manifest field | value |", "|---|---|"]
        lines += [f"| {_cell(key)} | {_cell(json.dumps(value))} |" for key, value in sorted(scalars.items())]
    manifest_json = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False)
    longest_run = max((len(run) for run in re.findall(r"`+", manifest_json)), default=0)
    fence = "`" * max(3, longest_run + 1)
    lines += [
        "",
        f"<details><summary>{MANIFESTS_DIR}/{config_name}.json</summary>",
        "",
        f"{fence}json",
        manifest_json,
        fence,
        "",
        "</details>",
    ]
    return "\n".join(lines)


def upsert_card_section(card: str | None, config_name: str, section: str) -> str:
    """Put `section` between this config's markers in the card, replacing an older one.

    The YAML front matter (where `datasets` keeps every config's metadata) and the rest of the
    body are kept byte for byte.

    >>> card = upsert_card_section("---\\nconfigs: []\\n---\\n", "a", "## A")
    >>> upsert_card_section(card, "a", "## A2").count("## A")
    1
    """
    start, end = (
        f"<!-- finetune:config:{config_name}:start -->",
        f"<!-- finetune:config:{config_name}:end -->",
    )
    block = f"{start}\n{section.strip()}\n{end}"
    card = card or ""
    match = _FRONT_MATTER_RE.match(card)
    front_matter, body = (match.group(1), card[match.end() :]) if match else ("", card)
    existing = re.compile(re.escape(start) + r"[\s\S]*?" + re.escape(end))
    if existing.search(body):
        body = existing.sub(lambda _: block, body, count=1)
    else:
        if not body.strip():
            body = "\n# Prepared datasets\n\nPushed by finetune: one config per preparation, with its manifest.\n"
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    return front_matter + body


def _read_text(
    api: HfApi, repo_id: str, filename: str, *, revision: str, missing_ok: bool = True
) -> str | None:
    """A text file of a dataset repo at `revision`; None if it does not exist and `missing_ok`."""
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        path = api.hf_hub_download(repo_id, filename, repo_type="dataset", revision=revision)
    except RemoteEntryNotFoundError:
        if missing_ok:
            return None
        raise
    return Path(path).read_text(encoding="utf-8")


def _card_config_names(card_data: Any) -> set[str]:
    configs = (card_data.to_dict() if card_data is not None else {}).get("configs") or []
    return {c.get("config_name") for c in configs if isinstance(c, dict)}


def _check_config_name(config_name: str) -> None:
    if not _CONFIG_NAME_RE.fullmatch(config_name) or config_name in _RESERVED_CONFIG_NAMES:
        raise ValueError(
            f"Invalid config name {config_name!r}: use letters, digits, '_', '.' or '-' (it names a folder "
            f"of the repo), and none of {sorted(_RESERVED_CONFIG_NAMES)}."
        )


def _cell(value: object) -> str:
    """Text safe inside a markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")
