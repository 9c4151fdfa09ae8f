"""Damaged `.gguf` inputs are errors naming the file and what is wrong with it, and leave nothing in
the conversion cache (through the real CLI: tests/integration/test_gguf_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.errors import FinetuneError
from finetune.gguf.convert import converted_folder, read_gguf

CASES = {
    "empty": (lambda data: b"", r"the file is empty \(0 bytes\), not a GGUF model\. Download or copy"),
    "not-gguf": (
        lambda data: b"<!DOCTYPE html><html>rate limited</html>\n",
        r"not a GGUF file: it starts with b'<!DOCTYP', not the GGUF magic b'GGUF'",
    ),
    "lfs-pointer": (
        lambda data: b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n",
        r"it is a Git LFS pointer, not the file it points to \(run git lfs pull\)",
    ),
    "magic-only": (lambda data: data[:4], r"the GGUF header is cut short or damaged \(the file has 4 bytes"),
    "header-cut": (
        lambda data: data[:3000],
        r"the GGUF header is cut short or damaged \(the file has 3,000 bytes",
    ),
    "tensor-data-cut": (lambda data: data[:-1000], r"the GGUF tensor data is cut short or damaged"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_gguf_file_is_a_clear_error(tiny_gguf_file: Path, tmp_path: Path, case: str) -> None:
    damage, message = CASES[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(damage(tiny_gguf_file.read_bytes()))
    with pytest.raises(FinetuneError, match=message) as raised:
        converted_folder(bad, root=tmp_path / "cache")
    assert str(raised.value).startswith(f"{bad}: ")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_a_whole_file_reads(tiny_gguf_file: Path) -> None:
    metadata = read_gguf(tiny_gguf_file)
    assert metadata["general.name"] == "tiny-llama" and metadata["general.architecture"] == "llama"
