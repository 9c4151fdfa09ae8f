"""Find the damage in local data files that the datasets library could not load, and make the damaged
lines skippable.

The ``datasets`` builders stop at the first bad line of a JSON lines file without saying which
one, fail with an error that names no file, or (pyarrow's JSON reader) load bytes that are not
UTF-8 without complaint, so that they surface later as a traceback in the middle of tokenization.
When a load fails, this module reads the files itself, line by line, to say where the damage is:
file, line, byte offset and what is wrong. It runs only on that error path: clean data pays nothing
but one UTF-8 check of loaded JSON (see readers.py).

Two kinds of damage:

* A damaged line (invalid JSON, bytes that are not UTF-8, a CSV row with more fields than the
  header): `scan` finds every one. With ``on_bad_row: skip``, `write_clean_copy` replaces each by
  a placeholder row (all fields null) in a copy of the file, and readers.py marks the row with
  `mark` in the `BAD_ROW_COLUMN` column, so that tokenization counts it as ``bad_row:<reason>``.
  Rows keep their positions, so row numbers in errors and manifest samples match the source.
* A damaged file (empty, compressed data cut short, not parquet, a JSON array that does not
  parse): nothing can be counted row by row, so `scan` raises a DataError in both modes.

>>> line_problem(b'{"text": "hi"}')
>>> line_problem(b'{"text": "hi"')[0]
'invalid_json'
>>> line_problem(b'{"text": "\\xff"}')[:2]
('invalid_utf8', 10)
"""

from __future__ import annotations

import codecs
import csv
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import DataError

# Bad-row reasons found while reading files (the manifest counts them as "bad_row:<reason>").
INVALID_JSON = "invalid_json"
INVALID_UTF8 = "invalid_utf8"
RAGGED_ROW = "ragged_row"

# Bump when the placeholders change: clean copies are named with it (see sources._clean_copy).
CLEAN_COPY_VERSION = 1

BAD_ROW_COLUMN = "__finetune_bad_row__"
"""Column added to a dataset loaded from cleaned copies: null, or `mark(bad_line)` for a placeholder
row. Tokenization turns a marked row into a BadRow and drops the column."""

_UTF16_32_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
_SAMPLE_CHARS = 80
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of a byte that isn't UTF-8


@dataclass(frozen=True)
class BadLine:
    """One damaged row of a file: where it is, the row it would have been, and what is wrong."""

    path: str
    line: int  # 1-based, first physical line of the row
    byte: int  # offset of the problem in the file (after decompression)
    row: int  # 0-based row of this file
    reason: str
    detail: str
    end_line: int = 0  # last physical line (CSV rows may span several); 0 = line

    def where(self) -> str:
        """`path line N (byte B)`, the place a user opens an editor at."""
        return f"{self.path} line {self.line} (byte {self.byte})"


@dataclass
class FileScan:
    """What `scan` found in one file: its row count and its damaged rows."""

    path: str
    builder: str
    num_rows: int
    bad: list[BadLine] = field(default_factory=list)
    sep: str = ","
    num_columns: int = 0  # CSV: fields in the header line
    array: bool = False  # a JSON file holding one array (the clean copy is written as JSON lines)


def mark(bad: BadLine) -> str:
    """The `BAD_ROW_COLUMN` value of a placeholder row: reason and description.

    >>> parse_mark(mark(BadLine("d.jsonl", 3, 40, 2, "invalid_json", "invalid JSON: x")))
    ('invalid_json', 'd.jsonl line 3 (byte 40): invalid JSON: x')
    """
    return f"{bad.reason}\t{bad.where()}: {bad.detail}"


def parse_mark(value: str) -> tuple[str, str]:
    """(reason, detail) of a `mark` value."""
    reason, _, detail = value.partition("\t")
    return reason, detail


def describe(bad: list[BadLine], *, skip_hint: bool = True) -> str:
    """A sentence about the first damaged row and how many there are, for an error message."""
    first = bad[0]
    more = f" ({len(bad)} damaged rows in all, by reason: {_counts(bad)})" if len(bad) > 1 else ""
    hint = (
        f" Fix the file, or set data.on_bad_row: skip to drop damaged rows (counted in the manifest as "
        f"bad_row:{first.reason})."
        if skip_hint
        else ""
    )
    return f"{first.where()}: {first.detail}{more}.{hint}"


def _counts(bad: list[BadLine]) -> str:
    counts: dict[str, int] = {}
    for b in bad:
        counts[b.reason] = counts.get(b.reason, 0) + 1
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


# --------------------------------------------------------------------------------------------- scan


def scan(path: str, builder: str, *, sep: str = ",") -> FileScan:
    """Every damaged row of a local data file read by the `builder` datasets builder.

    Raises a DataError naming the file when the damage is not confined to rows (see the module
    docstring). Reads the whole file in Python: call it only once a load has failed.
    """
    _check_not_empty(path)
    if builder in ("parquet", "arrow"):
        _check_binary(path, builder)
        return FileScan(path, builder, num_rows=0)
    _check_encoding(path)
    if builder == "json":
        found = _scan_json_array(path) if _first_byte(path) == b"[" else _scan_json_lines(path)
    elif builder == "csv":
        found = _scan_csv(path, sep)
    elif builder == "text":
        found = _scan_text(path)
    else:
        return FileScan(path, builder, num_rows=0)
    if found.num_rows == 0 and not found.bad:
        what = "a header line and no rows" if found.num_columns else "only blank lines"
        raise DataError(f"{path} has no rows: it holds {what}")
    return found


def line_problem(raw: bytes) -> tuple[str, int, str] | None:
    """(reason, byte offset in the line, detail) when a JSON lines row can't be read, else None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return INVALID_UTF8, e.start, _utf8_detail(raw, e)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        offset = len(text[: e.pos].encode("utf-8"))
        return INVALID_JSON, offset, f"invalid JSON: {e.msg} (column {e.colno}) in {_snippet(text)}"
    except RecursionError:
        return INVALID_JSON, 0, "invalid JSON: nested too deeply to parse"
    if not isinstance(value, dict):
        return INVALID_JSON, 0, f"a JSON lines row must be an object {{...}}, not {_json_kind(value)}"
    return None


def _scan_json_lines(path: str) -> FileScan:
    # pyarrow skips blank lines (they are not rows) and strips a leading UTF-8 BOM.
    found, row = FileScan(path, "json", num_rows=0), 0
    for number, offset, raw in _lines(path):
        body = raw.strip()
        if not body:
            continue
        problem = line_problem(body)
        if problem:
            reason, at, detail = problem
            start = offset + (len(raw) - len(raw.lstrip()))
            found.bad.append(BadLine(path, number, start + at, row, reason, detail))
        row += 1
    found.num_rows = row
    return found


def _scan_json_array(path: str) -> FileScan:
    """A file holding one JSON array: each element is a row; a syntax error is fatal.

    datasets itself reads such a file whole and converts it to JSON lines, so the clean copy is
    written as JSON lines too.
    """
    data = _read_all(path).removeprefix(codecs.BOM_UTF8)
    # surrogateescape keeps invalid bytes as lone surrogates: the JSON still parses, and an element
    # holding one is the damaged row.
    text = data.decode("utf-8", errors="surrogateescape")
    found = FileScan(path, "json", num_rows=0, array=True)
    seen, line, byte = 0, 1, 0  # line and byte offset of text[seen], advanced element by element
    for row, (pos, value) in enumerate(_array_elements(path, text)):
        line += text.count("\n", seen, pos)
        byte += len(text[seen:pos].encode("utf-8", errors="surrogateescape"))
        seen = pos
        if _has_surrogates(value):
            detail = "an element holds bytes that are not UTF-8"
            found.bad.append(BadLine(path, line, byte, row, INVALID_UTF8, detail))
        elif not isinstance(value, dict | str):
            detail = f"an element of a JSON array of rows must be an object {{...}}, not {_json_kind(value)}"
            found.bad.append(BadLine(path, line, byte, row, INVALID_JSON, detail))
        found.num_rows = row + 1
    return found


def json_rows(path: str) -> Iterator[Any]:
    """Each row of a JSON lines file, or of a file holding one JSON array, as datasets reads them
    (blank lines skipped, a leading BOM dropped, an array's string elements as ``{"text": ...}``).

    For a file that loaded: readers.py reads mixed-type JSON columns again with it.
    """
    if _first_byte(path) == b"[":
        text = _read_all(path).removeprefix(codecs.BOM_UTF8).decode("utf-8")
        for _, value in _array_elements(path, text):
            yield {"text": value} if isinstance(value, str) else value
        return
    for _, _, raw in _lines(path):
        if raw.strip():
            yield json.loads(raw)


def _array_elements(path: str, text: str) -> Iterator[tuple[int, Any]]:
    """(character offset, value) of each element of the JSON array in `text`."""
    decoder = json.JSONDecoder()
    pos = _skip_space(text, text.index("[") + 1)
    if text.startswith("]", pos):
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(_array_syntax_error(path, e)) from e
        yield pos, value
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif text.startswith("]", pos):
            return
        else:
            bad = json.JSONDecodeError("expected ',' or ']' after an element", text, pos)
            raise DataError(_array_syntax_error(path, bad))


def _array_syntax_error(path: str, e: json.JSONDecodeError) -> str:
    return (
        f"{path} line {e.lineno} column {e.colno}: invalid JSON: {e.msg}. The file is one JSON array, which "
        "can't be read past a syntax error, so data.on_bad_row: skip can't drop just the bad element: fix "
        "it, or write the rows as JSON lines (one object per line), where a bad line can be skipped"
    )


def _scan_csv(path: str, sep: str) -> FileScan:
    """Rows with bytes that are not UTF-8 or more fields than the header (pandas rejects those).

    Rows with fewer fields are left alone: pandas reads the missing ones as null, and formatting
    then reports a missing field by name.
    """
    found = FileScan(path, "csv", num_rows=0, sep=sep)
    current: dict[int, tuple[int, str]] = {}  # the lines of the row being read: number -> (offset, text)

    def decoded_lines() -> Iterator[str]:
        for number, offset, raw in _lines(path):
            current[number] = (offset, raw.decode("utf-8", errors="surrogateescape"))
            yield current[number][1]

    reader = csv.reader(decoded_lines(), delimiter=sep)
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # pandas has no field size limit; the csv module's is 128 KiB
    try:
        return _read_csv_rows(found, reader, current)
    except csv.Error as e:  # e.g. a lone carriage return inside an unquoted field
        raise DataError(f"{path} line {reader.line_num}: not readable as CSV ({e})") from e
    finally:
        csv.field_size_limit(limit)


def _read_csv_rows(found: FileScan, reader: Any, current: dict[int, tuple[int, str]]) -> FileScan:
    """Check each row `reader` yields; `current` holds the lines of the row just read."""
    header = next(reader, None)
    if header is None:
        return found
    found.num_columns = len(header)
    last, row = reader.line_num, 0
    current.clear()
    for record in reader:
        first, last = last + 1, reader.line_num
        lines = [current[n] for n in range(first, last + 1)]
        current.clear()
        if not record:
            continue  # a blank line: pandas skips it
        problem = _csv_problem(record, [text for _, text in lines], found.num_columns, found.sep)
        if problem:
            reason, at, detail = problem
            found.bad.append(BadLine(found.path, first, lines[0][0] + at, row, reason, detail, last))
        row += 1
    found.num_rows = row
    return found


def _csv_problem(
    record: list[str], lines: list[str], num_columns: int, sep: str
) -> tuple[str, int, str] | None:
    raw = "".join(lines).encode("utf-8", errors="surrogateescape")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return INVALID_UTF8, e.start, _utf8_detail(raw, e)
    if len(record) > num_columns:
        return (
            RAGGED_ROW,
            0,
            f"{len(record)} fields, but the header has {num_columns} (a field holding {sep!r} must be quoted)",
        )
    return None


def _scan_text(path: str) -> FileScan:
    # The text builder opens files with universal newlines: "\r\n", "\r" and "\n" all end a row, and
    # blank lines are rows.
    found, row = FileScan(path, "text", num_rows=0), 0
    for number, offset, raw in _lines(path):
        body = raw.removesuffix(b"\n").removesuffix(b"\r")
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            found.bad.append(
                BadLine(path, number, offset + e.start, row, INVALID_UTF8, _utf8_detail(body, e))
            )
        row += 1 + body.count(b"\r")
    found.num_rows = row
    return found


# ------------------------------------------------------------------------------------- clean copies


def write_clean_copy(found: FileScan, dest: Path) -> Path:
    """Write `found.path` to `dest` (uncompressed) with each damaged row replaced by a placeholder.

    Placeholders keep every row in place: an empty object (JSON), empty fields (CSV), or the line
    with its invalid bytes replaced by U+FFFD (text). Written to a temporary name, then renamed,
    so a reader never sees half a file; an existing `dest` is reused (same name = same source).
    """
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        if found.array:
            _write_array_as_lines(found, out)
        else:
            _write_lines(found, out)
    os.replace(tmp, dest)
    return dest


def _write_lines(found: FileScan, out: Any) -> None:
    bad_lines = {b.line: b for b in found.bad}
    skip_until = 0
    for number, _, raw in _lines(found.path):
        if number <= skip_until:
            continue  # the other lines of a multi-line CSV row already replaced
        bad = bad_lines.get(number)
        if bad is None:
            out.write(raw)
        elif found.builder == "json":
            out.write(b"{}\n")
        elif found.builder == "csv":
            skip_until = bad.end_line or number
            out.write(found.sep.encode() * (found.num_columns - 1) + b"\n")
        else:
            out.write(raw.decode("utf-8", errors="replace").encode("utf-8"))


def _write_array_as_lines(found: FileScan, out: Any) -> None:
    text = _read_all(found.path).removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")
    bad_rows = {b.row for b in found.bad}
    for row, (_, value) in enumerate(_array_elements(found.path, text)):
        if row in bad_rows:
            value = {}
        elif isinstance(value, str):  # datasets reads an array of strings as a "text" column
            value = {"text": value}
        out.write(json.dumps(value, ensure_ascii=False).encode("utf-8") + b"\n")


# ---------------------------------------------------------------------------------- whole-file damage


def _check_not_empty(path: str) -> None:
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty (0 bytes)")


def _check_encoding(path: str) -> None:
    head = _head(path, 4)
    if not head:
        raise DataError(f"{path} is empty: it decompresses to 0 bytes")
    for bom in _UTF16_32_BOMS:
        if head.startswith(bom):
            name = codecs.lookup(bom_name(bom)).name
            raise DataError(
                f"{path} is encoded as {name} (it starts with that byte-order mark), but data files must be UTF-8; "
                f"re-encode it, e.g. `iconv -f {name} -t UTF-8 in > out`"
            )


def bom_name(bom: bytes) -> str:
    """The codec a byte-order mark announces.

    >>> bom_name(codecs.BOM_UTF16_LE)
    'utf-16-le'
    """
    return {
        codecs.BOM_UTF32_LE: "utf-32-le",
        codecs.BOM_UTF32_BE: "utf-32-be",
        codecs.BOM_UTF16_LE: "utf-16-le",
        codecs.BOM_UTF16_BE: "utf-16-be",
    }[bom]


def _check_binary(path: str, builder: str) -> None:
    """Raise a DataError naming the file when it is not a readable parquet / Arrow file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if builder == "parquet":
            parquet = pq.ParquetFile(path)
            for group in range(parquet.num_row_groups):
                try:
                    parquet.read_row_group(group)
                except Exception as e:
                    first = sum(parquet.metadata.row_group(g).num_rows for g in range(group))
                    raise DataError(
                        f"{path}: row group {group} (rows from {first}) is damaged ({type(e).__name__}: {e}); "
                        "the file is truncated or corrupt: write it again"
                    ) from e
        else:
            with pa.memory_map(path) as source:
                try:
                    pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    source.seek(0)
                    pa.ipc.open_file(source).read_all()
    except DataError:
        raise
    except Exception as e:
        kind = "a parquet" if builder == "parquet" else "an Arrow"
        raise DataError(
            f"{path} is not {kind} file, or it is truncated or corrupt ({type(e).__name__}: {e}); write it "
            "again, or set ds_type if its extension does not say its format"
        ) from e


# ---------------------------------------------------------------------------------------- reading


def _open(path: str) -> Any:
    """The file's bytes, decompressed as its extension says (.gz, .bz2, .xz, .zst, ...)."""
    import fsspec

    return fsspec.open(path, "rb", compression="infer").open()


@contextmanager
def _reading(path: str) -> Iterator[None]:
    """Turn a failure to read or decompress the file into a DataError naming it."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:  # EOFError (gzip cut short), BadGzipFile, zlib.error, LZMAError, OSError
        raise DataError(_read_error(path, e)) from e


def _read_error(path: str, e: Exception) -> str:
    from fsspec.utils import infer_compression

    if infer_compression(path):
        return (
            f"{path}: the compressed data is damaged or cut short ({type(e).__name__}: {e}). Rows after the "
            "damage can't be read or counted, so data.on_bad_row: skip can't help: download or compress "
            "the file again"
        )
    return f"could not read {path} ({type(e).__name__}: {e})"


def _lines(path: str) -> Iterator[tuple[int, int, bytes]]:
    """(1-based line number, byte offset, the line with its newline) for each line of the file."""
    with _reading(path), _open(path) as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                # The BOM is not data (pyarrow and pandas drop it): offsets count it, the line is without it.
                yield number, offset + 3, raw[3:]
            else:
                yield number, offset, raw
            offset += len(raw)


def _read_all(path: str) -> bytes:
    with _reading(path), _open(path) as f:
        return f.read()


def _head(path: str, num_bytes: int) -> bytes:
    with _reading(path), _open(path) as f:
        return f.read(num_bytes)


def _first_byte(path: str) -> bytes:
    return _head(path, 1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()[:1]


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _has_surrogates(value: Any) -> bool:
    """Whether a parsed JSON value holds a byte that was not UTF-8 (decoded with surrogateescape)."""
    if isinstance(value, str):
        return _ESCAPED_BYTE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _utf8_detail(raw: bytes, e: UnicodeDecodeError) -> str:
    bad = raw[e.start : e.end].hex(" ")
    before = raw[max(0, e.start - 30) : e.start].decode("utf-8", errors="replace").lstrip()
    after = f", after {before!r}" if before else ""
    return (
        f"invalid UTF-8: byte(s) {bad} at column {e.start + 1} ({e.reason}){after}; "
        "data files must be UTF-8 (was this file saved as Latin-1 or cp1252?)"
    )


def _snippet(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SAMPLE_CHARS else text[:_SAMPLE_CHARS] + "...")


def _json_kind(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
