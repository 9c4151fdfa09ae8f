"""finetune.data.sources.location: where an entry points and which builder reads it, without heavy imports."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from finetune.data.sources.location import BUILDERS, EXTENSION_TO_BUILDER, Location, locate
from finetune.recipe.formats import CompletionEntry


def entry(path: str, ds_type: str | None = None, data_files=None) -> NS:
    return NS(path=path, ds_type=ds_type, data_files=data_files)


def test_locate_every_kind(tmp_path: Path):
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    assert locate(entry(str(tmp_path / "rows.jsonl"))) == Location("local_file", "json")
    assert locate(entry(str(tmp_path / "rows.jsonl"), ds_type="text")) == Location("local_file", "text")
    assert locate(entry(str(tmp_path / "folder"))) == Location("local_dir", None)
    assert locate(entry(str(tmp_path / "folder"), data_files=["a.csv", "b.tsv"])) == Location(
        "local_dir", "csv"
    )
    tsv = entry(str(tmp_path / "folder"), data_files="a.tsv")
    assert locate(tsv) == Location("local_dir", "csv", {"sep": "\t"})
    assert locate(entry(str(tmp_path / "saved"))) == Location("saved_dataset")
    assert locate(entry(str(tmp_path / "absent.jsonl"))) == Location("missing")
    assert locate(entry("org/name")) == Location("hub")
    assert locate(entry("s3://bucket/folder", data_files="x.parquet")) == Location("url", "parquet")
    assert locate(entry("s3://bucket/saved")) == Location("url", None)  # a save_to_disk folder


def test_ds_type_choices_are_the_builders_of_the_file_table():
    # A new file type is a row of EXTENSION_TO_BUILDER; the recipe's ds_type offers its builder.
    (ds_type,) = [
        a for a in typing.get_args(CompletionEntry.model_fields["ds_type"].annotation) if a is not type(None)
    ]
    assert typing.get_args(ds_type) == BUILDERS
    assert set(BUILDERS) == set(EXTENSION_TO_BUILDER.values())


@pytest.mark.slow  # a fresh interpreter: a process
@pytest.mark.parametrize("module", ["finetune.data.sources.location", "finetune.data.prepare.fingerprint"])
def test_location_and_fingerprint_import_no_heavy_library(module: str):
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in ('torch', 'datasets', 'transformers', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
