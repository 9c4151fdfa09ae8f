"""Loading dataset entries from every supported local format, URLs and (faked) Hub ids; fingerprints."""

from __future__ import annotations

import doctest
import gzip
import json
import shutil
from pathlib import Path

import datasets
import pandas as pd
import pytest

from finetune.data.sources import readers
from finetune.data.sources.damage import BAD_ROW_COLUMN
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


def test_doctests() -> None:
    assert doctest.testmod(readers).failed == 0


# ------------------------------------------------------------------------------------ local formats


@pytest.mark.parametrize("fmt", ["jsonl", "json", "json_array", "csv", "tsv", "parquet", "arrow", "jsonl.gz"])
def test_load_each_file_format(tmp_path: Path, fmt: str) -> None:
    df = pd.DataFrame(ROWS)
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    elif fmt == "json":  # JSON lines in a .json file
        path = write_jsonl(tmp_path / "d.json", ROWS)
    elif fmt == "json_array":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        df.to_csv(path, index=False)
    elif fmt == "tsv":
        path = tmp_path / "d.tsv"
        df.to_csv(path, index=False, sep="\t")
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        df.to_parquet(path)
    elif fmt == "arrow":
        saved = tmp_path / "saved"
        datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
        path = tmp_path / "d.arrow"
        shutil.copy(next(saved.glob("*.arrow")), path)
    else:
        path = tmp_path / "d.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in ROWS)
    ds = load_source(entry(path))
    assert isinstance(ds, datasets.Dataset)
    assert ds["text"][:] == [r["text"] for r in ROWS]
    assert ds["n"][:] == list(range(10))


def test_load_text_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("first line\nsecond line\n")
    assert load_source(entry(path))["text"][:] == ["first line", "second line"]


def test_ds_type_overrides_extension(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "rows.data", ROWS)
    assert len(load_source(entry(path, ds_type="json"))) == 10
    with pytest.raises(DataError, match=r"can't tell the format.*ds_type"):
        load_source(entry(path))


def test_save_to_disk_dataset_and_dict(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    assert load_source(entry(tmp_path / "single"))["n"][:] == list(range(10))

    dd = datasets.DatasetDict({"train": ds, "validation": ds.select(range(3))})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_source(entry(tmp_path / "dict"))) == 10
    assert len(load_source(entry(tmp_path / "dict", split="validation"))) == 3
    with pytest.raises(DataError) as err:
        load_source(entry(tmp_path / "dict", split="test"), entry_label="data.datasets[1]")
    msg = str(err.value)
    assert "data.datasets[1]" in msg and "'test'" in msg and "['train', 'validation']" in msg


def test_directory_of_files_splits_from_names(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "d" / "test.jsonl", ROWS[:2])
    assert len(load_source(entry(tmp_path / "d"))) == 10
    assert len(load_source(entry(tmp_path / "d", split="test"))) == 2
    with pytest.raises(DataError) as err:
        load_source(entry(tmp_path / "d", split="valid"))
    assert "'valid'" in str(err.value) and "'train'" in str(err.value) and "'test'" in str(err.value)


def test_directory_with_data_files(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "d" / "b.jsonl", ROWS[4:])
    write_jsonl(tmp_path / "d" / "other.jsonl", ROWS[:1])
    assert load_source(entry(tmp_path / "d", data_files=["a.jsonl", "b.jsonl"]))["n"][:] == list(range(10))
    assert len(load_source(entry(tmp_path / "d", data_files="a.jsonl"))) == 4
    # ds_type picks the builder when the names don't say it
    assert len(load_source(entry(tmp_path / "d", data_files="*.jsonl", ds_type="json"))) == 11
    with pytest.raises(DataError, match="not found"):
        load_source(entry(tmp_path / "d", data_files="missing.jsonl"))


def test_missing_local_paths(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.jsonl", "./nope", "data/sub/nope"):
        with pytest.raises(DataError) as err:
            load_source(entry(path), entry_label="data.datasets[3]")
        assert "data.datasets[3]" in str(err.value) and "does not exist" in str(err.value)


def test_data_files_with_a_file_path_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match="data_files needs path to be a directory"):
        load_source(entry(path, data_files="x.jsonl"))


def test_bad_split_of_a_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match=r"split 'test' does not exist.*\['train'\]"):
        load_source(entry(path, split="test"))
    assert len(load_source(entry(path, split="train[:3]"))) == 3


# ------------------------------------------------------------------------------------ damaged files


def marks(ds: datasets.Dataset) -> list[str | None]:
    """The damage reason of each row (None: an intact row)."""
    if BAD_ROW_COLUMN not in ds.column_names:
        return [None] * len(ds)
    return [m and m.split("\t")[0] for m in ds[BAD_ROW_COLUMN]]


def damaged_jsonl(path: Path) -> Path:
    """Ten rows; row 3 is invalid JSON and row 7 holds a byte that is not UTF-8."""
    lines = [json.dumps(r).encode() for r in ROWS]
    lines[3] = b'{"text": "row 3", "n": 3'
    lines[7] = b'{"text": "row \xe97", "n": 7}'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_damaged_json_line_raise_names_file_line_and_error(tmp_path: Path) -> None:
    path = damaged_jsonl(tmp_path / "d.jsonl")
    with pytest.raises(DataError) as err:
        load_source(entry(path), entry_label="data.datasets[2]")
    msg = str(err.value)
    assert msg.startswith(f"data.datasets[2]: {path} line 4 (byte ")
    assert "invalid JSON" in msg and "Expecting ',' delimiter" in msg
    assert "2 damaged rows in all, by reason: invalid_json=1, invalid_utf8=1" in msg
    assert "data.on_bad_row: skip" in msg


def test_damaged_json_lines_skip_keeps_rows_in_place(tmp_path: Path) -> None:
    path = damaged_jsonl(tmp_path / "d.jsonl")
    ds = load_source(entry(path), on_bad_row="skip")
    assert len(ds) == 10 and ds["n"][:] == [0, 1, 2, None, 4, 5, 6, None, 8, 9]
    assert marks(ds) == [None] * 3 + ["invalid_json"] + [None] * 3 + ["invalid_utf8"] + [None] * 2
    assert f"{path} line 8 (byte " in ds[7][BAD_ROW_COLUMN] and "e9" in ds[7][BAD_ROW_COLUMN]
    # Slices and shards see the same rows as they would in the undamaged file.
    assert marks(load_source(entry(path, split="train[3:8]"), on_bad_row="skip")) == [
        "invalid_json", None, None, None, "invalid_utf8"
    ]  # fmt: skip
    shard = load_source(entry(path, shards=2, shards_idx=1), on_bad_row="skip")
    assert shard["n"][:] == [5, 6, None, 8, 9]


def test_damaged_file_in_a_directory_offsets_its_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS[:4])
    damaged_jsonl(tmp_path / "d" / "b.jsonl")
    with pytest.raises(DataError, match=r"b\.jsonl line 4"):
        load_source(entry(tmp_path / "d"))
    ds = load_source(entry(tmp_path / "d"), on_bad_row="skip")
    assert len(ds) == 14 and [i for i, m in enumerate(marks(ds)) if m] == [4 + 3, 4 + 7]


def test_invalid_utf8_that_pyarrow_loads_is_caught(tmp_path: Path) -> None:
    # pyarrow's JSON reader loads these bytes without complaint; without the check they would fail
    # later as a UnicodeDecodeError traceback inside tokenization.
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine", "n": 0}\n{"text": "caf\xe9", "n": 1}\n')
    with pytest.raises(DataError, match=r"d\.jsonl line 2 \(byte 38\): invalid UTF-8: byte\(s\) e9"):
        load_source(entry(path))
    assert marks(load_source(entry(path), on_bad_row="skip")) == [None, "invalid_utf8"]


@pytest.mark.parametrize("name", ["d.csv", "d.txt", "d.json"])
def test_invalid_utf8_in_csv_text_and_json_array(tmp_path: Path, name: str) -> None:
    data = {
        "d.csv": b"text,n\nfine,0\ncaf\xe9,1\nok,2\n",
        "d.txt": b"fine\ncaf\xe9\nok\n",
        "d.json": b'[{"text": "fine"},\n {"text": "caf\xe9"},\n {"text": "ok"}]',
    }[name]
    path = tmp_path / name
    path.write_bytes(data)
    line = 3 if name == "d.csv" else 2  # the header is line 1
    byte = data.index(b'{"text": "caf') if name == "d.json" else data.index(b"\xe9")  # array: the element
    with pytest.raises(DataError, match=rf"{name} line {line} \(byte {byte}\)"):
        load_source(entry(path))
    ds = load_source(entry(path), on_bad_row="skip")
    assert marks(ds) == [None, "invalid_utf8", None] and ds["text"][0] == "fine" and ds["text"][2] == "ok"


def test_empty_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").touch()
    for on_bad_row in ("raise", "skip"):
        with pytest.raises(DataError, match=r"empty\.jsonl is empty \(0 bytes\)"):
            load_source(entry(tmp_path / "empty.jsonl"), on_bad_row=on_bad_row)
    (tmp_path / "header.csv").write_text("text,n\n")
    with pytest.raises(DataError, match=r"header\.csv has no rows: it holds a header line"):
        load_source(entry(tmp_path / "header.csv"))
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "notes.md").write_text("no data here")
    with pytest.raises(DataError) as err:
        load_source(entry(tmp_path / "empty_dir"))
    assert "empty_dir holds no data files" in str(err.value) and ".jsonl" in str(err.value)


def test_files_with_different_columns_in_one_directory_name_each_file_s_columns(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS[:3])
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"body": "x"}])
    for on_bad_row in ("raise", "skip"):  # no row is damaged: skipping can't help
        with pytest.raises(DataError) as err:
            load_source(entry(tmp_path / "d"), on_bad_row=on_bad_row)
        message = str(err.value)
        assert "do not all have the same columns" in message, message
        assert "a.jsonl: ['text', 'n']" in message and "b.jsonl: ['body']" in message
        assert "its own entry in data.datasets" in message


def test_ragged_csv_row_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("text,n\nrow 0,0\nrow 1, with a comma,1\nrow 2,2\n")
    with pytest.raises(DataError, match=r"d\.csv line 3 \(byte 15\): 3 fields, but the header has 2"):
        load_source(entry(path))
    ds = load_source(entry(path), on_bad_row="skip")
    assert marks(ds) == [None, "ragged_row", None] and ds["text"][:] == ["row 0", None, "row 2"]


def test_not_parquet_is_named_in_both_modes(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_text('{"text": "I am JSON"}\n')
    for on_bad_row in ("raise", "skip"):
        with pytest.raises(DataError, match=r"d\.parquet is not a parquet file"):
            load_source(entry(path), on_bad_row=on_bad_row)


def test_clean_copy_is_reused(tmp_path: Path) -> None:
    path = damaged_jsonl(tmp_path / "d.jsonl")
    first = load_source(entry(path), on_bad_row="skip")
    copies = sorted((Path(datasets.config.HF_DATASETS_CACHE) / "finetune-clean-copies").glob("*-d.jsonl"))
    mtimes = [c.stat().st_mtime_ns for c in copies]
    second = load_source(entry(path), on_bad_row="skip")
    assert second._fingerprint == first._fingerprint
    assert [c.stat().st_mtime_ns for c in copies] == mtimes


# Strings that are valid JSON, in a column whose other rows hold lists: datasets reads such a column
# as its Json feature, and used to read these three back as 42, None and [1, 2].
JSON_LIKE = ["42", "null", "[1, 2]"]
MESSAGES = [{"role": "assistant", "content": "hello"}]


def test_a_mixed_type_column_keeps_its_strings(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "completion": v} for i, v in enumerate(JSON_LIKE)]
    path = write_jsonl(tmp_path / "mixed.jsonl", [*rows, {"prompt": "q3", "completion": MESSAGES}])
    ds = load_source(entry(path, type="kto"))
    assert ds["completion"][:] == [*JSON_LIKE, MESSAGES]
    assert load_source(entry(path, type="kto", split="train[1:3]"))["completion"][:] == JSON_LIKE[1:]
    # Nested: the content of messages, a string in some turns and a list of parts in others.
    parts = [{"type": "text", "text": "hi"}]
    chats = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": v}] for v in JSON_LIKE]
    path = write_jsonl(
        tmp_path / "chats.jsonl", [{"messages": c} for c in [*chats, [{"role": "user", "content": parts}]]]
    )
    loaded = load_source(entry(path, type="chat_template"))["messages"][:]
    assert [c[1]["content"] for c in loaded[:3]] == JSON_LIKE and loaded[3][0]["content"] == parts


def test_a_mixed_type_column_keeps_its_strings_in_a_damaged_file_and_a_json_array(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": "q", "completion": v}) for v in [*JSON_LIKE, MESSAGES]]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([lines[0], '{"prompt": "q", "completion": ', *lines[1:]]) + "\n")
    ds = load_source(entry(path, type="kto"), on_bad_row="skip")
    assert ds["completion"][:] == [JSON_LIKE[0], None, *JSON_LIKE[1:], MESSAGES]
    assert marks(ds)[1] is not None and marks(ds).count(None) == 4
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"prompt": "q", "completion": v} for v in [*JSON_LIKE, MESSAGES]]))
    assert load_source(entry(array, type="kto"))["completion"][:] == [*JSON_LIKE, MESSAGES]


def test_shards(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    parts = [load_source(entry(path, shards=3, shards_idx=i))["n"][:] for i in range(3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]  # contiguous, in order, nothing lost


def test_file_url(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert len(load_source(entry(path.as_uri()))) == 10
    write_jsonl(tmp_path / "dir" / "a.jsonl", ROWS[:3])
    assert len(load_source(entry((tmp_path / "dir").as_uri(), data_files=["a.jsonl"]))) == 3
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert len(load_source(entry((tmp_path / "saved").as_uri()))) == 10


# ------------------------------------------------------------------------------------------------- hub


def test_hub_id_arguments(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    e = entry("openai/gsm8k", name="main", split="test", revision="abc123", trust_remote_code=True)
    ds = load_source(e, num_proc=2)
    assert len(ds) == 10
    path, kwargs = calls[0]
    assert path == "openai/gsm8k"
    assert kwargs == {
        "split": "test",
        "num_proc": 2,
        "name": "main",
        "data_files": None,
        "revision": "abc123",
    }
    assert "warning: data.datasets[0]: trust_remote_code is ignored" in capsys.readouterr().err


def test_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(path, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as err:
        load_source(entry("org/name"), entry_label="data.test_datasets[0]")
    assert "data.test_datasets[0]" in str(err.value) and "'org/name'" in str(err.value)
    assert "Hub could not be reached" in str(err.value)


def test_every_row_damaged_is_an_error_in_skip_mode(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="every row is damaged, nothing to load"):
        load_source(entry(path), on_bad_row="skip")


def test_a_url_whose_filesystem_is_not_installed_names_the_package(monkeypatch):
    """fsspec imports a scheme's filesystem (aiohttp for https, s3fs, gcsfs) only when a URL is read:
    a missing one is a DataError naming the package, before datasets starts loading."""
    import fsspec

    from finetune.data.sources.readers import check_filesystem

    def missing(scheme):
        raise ImportError(f"{scheme} filesystem requires another package")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    for url, package in (("https://example.org/a.jsonl", "aiohttp"), ("s3://bucket/a.jsonl", "s3fs")):
        with pytest.raises(DataError, match=rf"data.datasets\[0\]: reading .* pip install {package}"):
            check_filesystem(url, "data.datasets[0]")
    monkeypatch.undo()
    with pytest.raises(DataError, match="URL scheme fsspec does not know"):
        check_filesystem("nope://x/a.jsonl", "data.datasets[0]")


def test_a_prepared_entry_reads_an_http_url(tmp_path):
    """data.datasets[].path at an http:// URL loads the rows the served file holds."""
    import functools
    import http.server
    import threading

    rows = [{"text": f"row {i}"} for i in range(7)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/rows.jsonl"
        assert load_source(dataset_entry(path=url, type="completion")).to_list() == rows
    finally:
        server.shutdown()
