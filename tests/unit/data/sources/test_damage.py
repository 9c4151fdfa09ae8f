"""damage.scan finds every damaged row (file, line, byte, row) or names the damaged file; clean copies
keep the rows in place, so the datasets builders load them with one placeholder row per damaged line."""

from __future__ import annotations

import doctest
import gzip
import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from finetune.data.sources import damage
from finetune.data.sources.damage import INVALID_JSON, INVALID_UTF8, RAGGED_ROW, scan, write_clean_copy
from finetune.errors import DataError

ROWS = "".join(json.dumps({"text": f"row {i} {i * i}"}) + "\n" for i in range(2000)).encode()


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def summary(found: damage.FileScan) -> list[tuple[int, int, int, str]]:
    return [(b.line, b.byte, b.row, b.reason) for b in found.bad]


def load(path: Path, builder: str, **kw) -> datasets.Dataset:
    return datasets.load_dataset(builder, data_files=str(path), split="train", **kw)


def test_doctests() -> None:
    assert doctest.testmod(damage).failed == 0


# ---------------------------------------------------------------------------------------- JSON lines


def test_json_lines_invalid_json_and_utf8_anywhere(tmp_path: Path) -> None:
    lines = [b'{"text": "a"}', b"{not json", b'{"text": "ok"}', b'{"text": "caf\xe9"}', b'{"text": "z"}']
    path = write(tmp_path / "d.jsonl", b"\n".join(lines) + b"\n")
    found = scan(path, "json")
    assert found.num_rows == 5
    starts = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
    assert summary(found) == [
        (2, starts[1] + 1, 1, INVALID_JSON),  # the parser stops at "n", the second byte
        (4, starts[3] + lines[3].index(b"\xe9"), 3, INVALID_UTF8),
    ]
    assert "Expecting property name" in found.bad[0].detail and "column 2" in found.bad[0].detail
    assert "e9" in found.bad[1].detail and "UTF-8" in found.bad[1].detail


def test_json_lines_blank_lines_bom_and_crlf_rows(tmp_path: Path) -> None:
    # pyarrow skips blank lines (not rows) and the BOM; CRLF ends lines like LF.
    data = b'\xef\xbb\xbf{"text": "a"}\r\n\r\n   \n{"text": "b"\r\n{"text": "c"}\r\n'
    path = write(tmp_path / "d.jsonl", data)
    found = scan(path, "json")
    assert found.num_rows == 3
    assert [(b.line, b.row, b.reason) for b in found.bad] == [(4, 1, INVALID_JSON)]
    clean = write_clean_copy(found, tmp_path / "clean.jsonl")
    assert load(clean, "json")["text"][:] == ["a", None, "c"]


def test_json_lines_truncated_last_line_and_non_objects(tmp_path: Path) -> None:
    # (A file starting with "[" is a JSON array, for datasets too.)
    path = write(tmp_path / "d.jsonl", b'{"text": "a"}\n[1, 2]\n"text"\n{"text": "cut sh')
    found = scan(path, "json")
    assert [(b.line, b.row) for b in found.bad] == [(2, 1), (3, 2), (4, 3)]
    assert "not an array" in found.bad[0].detail and "not a string" in found.bad[1].detail
    assert "Unterminated string" in found.bad[2].detail
    clean = write_clean_copy(found, tmp_path / "clean.jsonl")
    assert load(clean, "json")["text"][:] == ["a", None, None, None]


def test_gzipped_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"text": "a"}\n{"text": \n')
    found = scan(str(path), "json")
    assert [(b.line, b.byte, b.reason) for b in found.bad] == [(2, 22, INVALID_JSON)]  # after the ":"


# --------------------------------------------------------------------------------------- JSON arrays


def test_json_array_bad_elements_are_rows(tmp_path: Path) -> None:
    data = b'[\n  {"text": "a"},\n  3,\n  {"text": "b\xff"},\n  {"text": "c"}\n]'
    path = write(tmp_path / "d.json", data)
    found = scan(path, "json")
    assert found.array and found.num_rows == 4
    assert [(b.line, b.row, b.reason) for b in found.bad] == [(3, 1, INVALID_JSON), (4, 2, INVALID_UTF8)]
    assert found.bad[0].byte == data.index(b"3")
    clean = write_clean_copy(found, tmp_path / "clean.jsonl")
    assert load(clean, "json")["text"][:] == ["a", None, None, "c"]


def test_json_array_syntax_error_is_fatal_with_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "d.json", b'[\n  {"text": "a"},\n  {"text" "b"}\n]')
    with pytest.raises(DataError) as err:
        scan(path, "json")
    msg = str(err.value)
    assert path in msg and "line 3 column 11" in msg and "JSON lines" in msg


# ----------------------------------------------------------------------------------------------- CSV


def test_csv_ragged_and_invalid_utf8_rows(tmp_path: Path) -> None:
    data = b'q,a\n1,"two\nlines"\n\n3,4,5\n6,\xff\n7,8\n'
    path = write(tmp_path / "d.csv", data)
    found = scan(path, "csv")
    # Rows: (1, two\nlines) spans lines 2-3, line 4 is blank (skipped), then rows 1, 2, 3.
    assert found.num_rows == 4 and found.num_columns == 2
    assert summary(found) == [
        (5, data.index(b"3,4,5"), 1, RAGGED_ROW),
        (6, data.index(b"\xff"), 2, INVALID_UTF8),
    ]
    assert "3 fields, but the header has 2" in found.bad[0].detail
    clean = write_clean_copy(found, tmp_path / "clean.csv")
    ds = load(clean, "csv")
    assert ds["q"][:] == [1, None, None, 7] and ds["a"][:] == ["two\nlines", None, None, "8"]


def test_tsv_uses_its_separator(tmp_path: Path) -> None:
    path = write(tmp_path / "d.tsv", b"q\ta\n1,5\t2\n3\t4\t5\n")
    assert [(b.line, b.reason) for b in scan(path, "csv", sep="\t").bad] == [(3, RAGGED_ROW)]


# ---------------------------------------------------------------------------------------------- text


def test_text_rows_are_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "d.txt", b"one\n\ntw\xc3o\r\nthree\n")
    found = scan(path, "text")
    assert found.num_rows == 4 and summary(found) == [(3, 7, 2, INVALID_UTF8)]
    clean = write_clean_copy(found, tmp_path / "clean.txt")
    assert load(clean, "text")["text"][:] == ["one", "", "tw\ufffdo", "three"]


# ---------------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize(
    ("name", "data", "builder", "message"),
    [
        ("empty.jsonl", b"", "json", "is empty (0 bytes)"),
        ("blank.jsonl", b"\n  \n", "json", "has no rows: it holds only blank lines"),
        ("header.csv", b"q,a\n", "csv", "has no rows: it holds a header line and no rows"),
        # mtime=0: the bytes are in the test's id, which must be the same in every pytest-xdist worker
        ("empty.jsonl.gz", gzip.compress(b"", mtime=0), "json", "decompresses to 0 bytes"),
        (
            "cut.jsonl.gz",
            gzip.compress(ROWS, mtime=0)[: len(gzip.compress(ROWS, mtime=0)) // 2],
            "json",
            "compressed data is damaged",
        ),
        ("utf16.jsonl", '{"text": "a"}\n'.encode("utf-16"), "json", "utf-16-le"),
        ("notparquet.parquet", b"PAR1 this is not parquet", "parquet", "is not a parquet file"),
        ("notarrow.arrow", b"not arrow", "arrow", "is not an Arrow file"),
    ],
)
def test_damaged_files_are_named(tmp_path: Path, name: str, data: bytes, builder: str, message: str) -> None:
    path = write(tmp_path / name, data)
    with pytest.raises(DataError) as err:
        scan(path, builder)
    assert path in str(err.value) and message in str(err.value)


def test_truncated_parquet_is_named(tmp_path: Path) -> None:
    pd.DataFrame({"text": [f"row {i}" for i in range(1000)]}).to_parquet(tmp_path / "ok.parquet")
    data = (tmp_path / "ok.parquet").read_bytes()
    path = write(tmp_path / "cut.parquet", data[: len(data) // 2])
    with pytest.raises(DataError, match="truncated or corrupt"):
        scan(path, "parquet")
    assert scan(str(tmp_path / "ok.parquet"), "parquet").bad == []


def test_clean_copy_is_written_once(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", b'{"text": "a"}\n{oops\n')
    found = scan(path, "json")
    dest = write_clean_copy(found, tmp_path / "copies" / "d.jsonl")
    mtime = dest.stat().st_mtime_ns
    assert write_clean_copy(found, dest) == dest and dest.stat().st_mtime_ns == mtime
    assert [json.loads(line) for line in dest.read_text().splitlines()] == [{"text": "a"}, {}]
    assert list(dest.parent.iterdir()) == [dest]  # no temporary file left behind
