"""What identifies a preparation of a recipe's LLM data, and what a cache hit needs, without
importing datasets or transformers.

The fingerprint (finetune.data.prepare.cache.compute_fingerprint of `fingerprint_inputs`) hashes everything
that changes the prepared output: the sources (file contents, Hub commits, URL metadata), the
tokenizer files (hashed as files: no tokenizer is loaded), the entries' settings and the data
section's. `cached` finds the complete preparation of a recipe from it, so that
`finetune prepare-dataset` on an already prepared recipe reads a few files and prints the summary
(finetune.data.prepare.manifest):
the libraries that build a preparation (datasets, transformers, torch; finetune.data.prepare.build) are
imported only when there is something to build or load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.data.prepare.cache import MANIFEST_NAME, compute_fingerprint
from finetune.data.sources.location import file_hash, image_files, looks_local, source_fingerprint
from finetune.errors import DataError

if TYPE_CHECKING:
    from finetune.recipe import Recipe

# Bump when the prepared layout or the meaning of its columns changes: old caches are then ignored.
# 2: chats with tool calls are trained (they were bad rows) and rendered with their row's tools.
# 3: message contents may be lists of parts (text; images for vision-language models): they were bad rows.
# 4: multipack's repair pass runs when greedy is within 10% of the bound (was 2%): packed rows differ.
#    One version for every preparation, so unpacked caches are rebuilt too (once).
FORMAT_VERSION = 4
# Files in a tokenizer folder that cannot change tokenization (model weights): not hashed.
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"}
# Entry fields that do not change what is prepared.
_ENTRY_FIELDS_NOT_HASHED = {"trust_remote_code"}
# The hashed settings of an entry list, besides its own fields, every field the other formats read,
# at its default, as when one entry class held the fields of every type (format version 1): so a
# recipe keeps its fingerprint and its manifest now that each type has its own schema. Frozen:
# the fields of a new format are hashed only for entries of that type. A field the entry does not
# read cannot change its output, so its value here is a constant.
_FORMAT_1_FIELDS = {
    "field_text": "text",
    "field_instruction": "instruction",
    "field_input": "input",
    "field_output": "output",
    "field_prompt": "prompt",
    "field_completion": "completion",
    "field_chosen": "chosen",
    "field_rejected": "rejected",
    "field_label": "label",
    "field_messages": "messages",
    "message_field_role": "role",
    "message_field_content": "content",
    "role_map": {},
    "train_on_inputs": False,
    "roles_to_train": ["assistant"],
    "train_on_eos": "turn",
    "apply_chat_template": False,
}
# --------------------------------------------------------------------------------------- the recipe


def fingerprint_inputs(recipe: Recipe, *, with_files: bool = True) -> dict:
    """Everything the prepared output depends on, as plain JSON data (hashed by compute_fingerprint).

    `with_files=False` leaves out the parts that read the source and tokenizer files.

    Not included, because they do not change the output: dataset_num_proc,
    num_dataset_shards_to_save, push_dataset_to_hub, skip_prepare_dataset, dataloader_*,
    dataset_prepared_path, and each entry's trust_remote_code.
    """
    data, model = recipe.data, recipe.model
    packs = data.sample_packing or (data.eval_sample_packing and has_eval(data))
    settings = {
        "sequence_len": data.sequence_len,
        "excess_length_strategy": data.excess_length_strategy,
        "on_bad_row": data.on_bad_row,
        "sample_packing": data.sample_packing,
        "val_set_size": data.val_set_size,
        "shuffle_merged_datasets": data.shuffle_merged_datasets,
        "shuffle_before_merging_datasets": data.shuffle_before_merging_datasets,
    }
    if has_eval(data):
        settings["eval_sample_packing"] = data.eval_sample_packing
    vision = model.kind == "vlm"
    if vision:  # only then: the fingerprints of text recipes stay what they were
        settings["image_max_pixels"] = data.image_max_pixels
        if data.allow_image_paths_outside:  # only when set: the fingerprints of confined data stay
            settings["allow_image_paths_outside"] = True
    if packs:
        settings |= {
            "sample_packing_method": data.sample_packing_method,
            "sample_packing_sequence_len": data.packing_len,
            "pad_to_multiple_of": data.pad_to_multiple_of,
        }
        if data.sample_packing_method == "multipack":
            settings["sample_packing_group_size"] = data.sample_packing_group_size
    return {
        "format_version": FORMAT_VERSION,
        "datasets": [_entry_inputs(e, with_files, vision) for e in data.datasets],
        "test_datasets": [_entry_inputs(e, with_files, vision) for e in data.test_datasets],
        "tokenizer": _tokenizer_inputs(model) if with_files else None,
        # None: the tokenizer's own template, which the tokenizer file hashes cover.
        "chat_template": model.resolved_chat_template,
        "special_tokens": model.special_tokens.model_dump(mode="json"),
        "data": settings,
        "seed": recipe.train.seed,
    }


def _entry_inputs(entry: Any, with_files: bool = True, vision: bool = False) -> dict:
    settings = _FORMAT_1_FIELDS | entry.model_dump(mode="json", exclude=_ENTRY_FIELDS_NOT_HASHED)
    if not vision:  # a text model reads no images: the field is left out, as before it existed
        settings.pop("field_images", None)
    if settings.get("field_margin", "") is None:
        # No margin column (preference pairs of every objective but reward): left out, as before the
        # field existed, so the fingerprints of preference recipes stay what they were.
        del settings["field_margin"]
    if settings.get("weight") == 1:
        # The default draws each row once, as before weights existed: left out, so the fingerprints
        # (and the caches) of recipes without weights stay what they were.
        del settings["weight"]
    out = {"settings": settings, "source": source_fingerprint(entry) if with_files else None}
    if vision and with_files:
        out["images"] = image_files(entry)
    return out


def has_eval(data: Any) -> bool:
    """Whether the data section makes an eval split (val_set_size or test_datasets)."""
    return bool(data.val_set_size) or bool(data.test_datasets)


def _tokenizer_inputs(model: Any) -> dict:
    """Content hashes of the tokenizer files (local folder) or the commit a Hub revision resolves to.

    A GGUF model's tokenizer is hashed in its converted folder (the files load_tokenizer reads).
    """
    from finetune.gguf.convert import resolve_model_source

    source = resolve_model_source(model).tokenizer_source
    local = Path(source).expanduser()
    if not local.exists() and looks_local(source):
        raise DataError(f"model.tokenizer_path: {source} does not exist (resolved to {local.resolve()})")
    if local.is_dir():
        files = {
            p.name: file_hash(p)
            for p in sorted(local.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.suffix not in _WEIGHT_SUFFIXES
        }
        return {"kind": "local", "files": files}
    return {
        "kind": "hub",
        "repo": source,
        "revision": model.revision,
        "sha": _hub_tokenizer_sha(source, model.revision),
    }


def _hub_tokenizer_sha(repo: str, revision: str | None) -> str:
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        return HfApi().model_info(repo, revision=revision).sha
    except Exception as exc:  # offline: the snapshot already in the cache names its commit
        for name in ("tokenizer_config.json", "tokenizer.json"):
            cached = try_to_load_from_cache(repo, name, revision=revision)
            if isinstance(cached, str) and "snapshots" in Path(cached).parts:
                parts = Path(cached).parts
                return parts[parts.index("snapshots") + 1]
        raise DataError(
            f"model.tokenizer_path: cannot resolve the Hub tokenizer {repo!r} (revision {revision or 'main'}) "
            f"to a commit: {type(exc).__name__}: {exc}. Use a local tokenizer folder or check the network."
        ) from exc


def cached(recipe: Recipe) -> tuple[Path, dict] | None:
    """(folder, manifest) of the complete preparation of `recipe` in data.dataset_prepared_path, or
    None when there is none (then finetune.data.prepare.build builds it, or pulls it from the Hub)."""
    path = Path(recipe.data.dataset_prepared_path) / compute_fingerprint(fingerprint_inputs(recipe))
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    return path, json.loads(manifest_path.read_text(encoding="utf-8"))
