"""`finetune prepare-dataset recipe.yaml` through the CLI's main in this process (tests/inprocess.py):
the demo data, damaged files, weighted mixtures; in a fresh interpreter (slow tier): what a cache hit
imports, and GSM8K with Llama 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import yaml

from finetune.data.prepare.mixture import draw_count
from tests.inprocess import finetune


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    """`finetune prepare-dataset ARGS` in this process, from the repository root."""
    return finetune("prepare-dataset", *args)


# A config-only Llama: prepare reads the tokenizer, never the weights.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1}


def _write_recipe(
    tmp_path: Path, tokenizer: Path, datasets: list[dict], *, config=TINY_LLAMA, name="recipe.yaml", **data
) -> Path:
    """A recipe for `datasets` (one process, prepared into tmp_path/prepared) written to tmp_path/name;
    `data` adds fields to its data section."""
    recipe = {
        "model": {"config_path": config, "tokenizer_path": str(tokenizer)},
        "data": {
            "datasets": datasets,
            **data,
            "dataset_num_proc": 1,
            "dataset_prepared_path": str(tmp_path / "prepared"),
        },
        "train": {"output_dir": str(tmp_path / "out")},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def _manifest(stdout: str) -> dict:
    """The manifest of the folder named in the summary line `prepared dataset <fp> (...) at <path>`."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith("prepared dataset "))
    return json.loads((Path(line.rsplit(" at ", 1)[1]) / "manifest.json").read_text())


def test_prepare_dataset_cli_on_demo_data(tmp_path: Path, repo_root: Path):
    demo = repo_root / "recipes" / "demo"
    if not (demo / "tokenizer" / "tokenizer.json").is_file():
        pytest.skip("demo data not generated yet (python recipes/demo/make_demo_data.py)")
    datasets = [
        {"path": str(demo / "data" / "arithmetic.jsonl"), "type": "alpaca"},
        {"path": str(demo / "data" / "chat.jsonl"), "type": "chat_template"},
    ]
    path = _write_recipe(tmp_path, demo / "tokenizer", datasets, val_set_size=0.05, sequence_len=1024)

    override = ("--data.sequence_len", "512")
    first = _run_cli(str(path), *override)
    assert first.returncode == 0, first.stderr
    assert "(built)" in first.stdout and "packing efficiency" in first.stdout
    m = _manifest(first.stdout)
    assert m["rows_in"] == 3300 == m["rows_kept"] + m["rows_dropped"]
    assert all(s["rows_in"] == s["rows_kept"] + sum(s["dropped"].values()) for s in m["sources"])
    assert set(m["rows_out"]) == {"train", "eval"}
    assert m["fingerprint_inputs"]["data"]["sequence_len"] == 512  # the override reached prepare

    # Same recipe again: the cache is reused, nothing is tokenized.
    second = _run_cli(str(path), *override)
    assert second.returncode == 0, second.stderr
    assert "(cache)" in second.stdout and "reusing prepared dataset" in second.stdout
    assert "Tokenizing" not in second.stderr
    assert _manifest(second.stdout) == m


# Runs the CLI's main in a fresh interpreter and lists the heavy libraries it imported.
_HEAVY_IMPORTS = """
import sys
from finetune.cli import main
code = main(["prepare-dataset", *sys.argv[1:]])
print("imported:", sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.slow  # a fresh interpreter each time: what it imported is the subject
def test_a_cache_hit_imports_neither_torch_transformers_nor_datasets(tmp_path: Path, repo_root: Path):
    """A prepared recipe is found from its fingerprint alone; building one does import them."""
    rows = [{"instruction": f"Add {i} and 1.", "input": "", "output": str(i + 1)} for i in range(20)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = _write_recipe(
        tmp_path, repo_root / "recipes" / "demo" / "tokenizer", [{"path": str(data), "type": "alpaca"}]
    )
    env = {**os.environ, "PYTHONPATH": str(repo_root), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}

    def run() -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", _HEAVY_IMPORTS, str(path)]
        return subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)

    built = run()
    assert built.returncode == 0, built.stderr
    assert "(built)" in built.stdout and "imported: ['datasets'" in built.stdout
    hit = run()
    assert hit.returncode == 0, hit.stderr
    assert "reusing prepared dataset" in hit.stdout and "(cache)" in hit.stdout
    assert "imported: []" in hit.stdout

    # The same summary as the build's, from the manifest alone.
    def summary(out: str, source: str) -> str:
        return out.split(f"({source})", 1)[1].split("imported:")[0]

    assert _manifest(hit.stdout)["rows_in"] == 20 and summary(hit.stdout, "cache") == summary(
        built.stdout, "built"
    )


@pytest.mark.slow
def test_prepare_dataset_cli_on_gsm8k_with_llama2(tmp_path: Path, repo_root: Path, shared_data: Path):
    data, tokenizer = shared_data / "gsm8k" / "train.jsonl", shared_data / "tokenizers" / "llama2-hf"
    if not data.is_file() or not (tokenizer / "tokenizer.json").is_file():
        pytest.skip(f"GSM8K or the Llama 2 tokenizer is missing under {shared_data}")
    gsm8k = {
        "path": str(data),
        "type": "input_output",
        "field_prompt": "question",
        "field_completion": "answer",
    }
    path = _write_recipe(
        tmp_path, tokenizer, [gsm8k], config={"model_type": "llama"}, name="gsm8k.yaml", sequence_len=2048
    )
    result = _run_cli(str(path))
    assert result.returncode == 0, result.stderr
    m = _manifest(result.stdout)
    assert m["rows_in"] == 7473 == m["rows_kept"] + m["rows_dropped"]
    train = m["splits"]["train"]
    # Multipack reaches the lower bound on GSM8K: every row but the last is full.
    assert train["rows"] == math.ceil(train["num_tokens"] / 2048)
    assert m["packing_efficiency"] >= 0.999
    assert 0 < m["num_trainable_tokens"] < m["num_tokens"]  # questions are masked


# ---------------------------------------------------------------------------------------- damaged files

ROWS = [json.dumps({"text": f"row {i}: some words to train on"}).encode() for i in range(8)]
DAMAGED = {
    # name: (file name, bytes, on_bad_row, exit code, what stderr says, manifest drops)
    "invalid_json_raise": ("d.jsonl", [*ROWS[:2], b'{"text": "cut', *ROWS[3:]], "raise", 2,
                           ["d.jsonl line 3 (byte ", "invalid JSON", "on_bad_row: skip"], None),
    "invalid_json_skip": ("d.jsonl", [*ROWS[:2], b'{"text": "cut', *ROWS[3:]], "skip", 0, [],
                          {"bad_row:invalid_json": 1}),
    "invalid_utf8_raise": ("d.jsonl", [*ROWS[:5], b'{"text": "caf\xe9"}', *ROWS[6:]], "raise", 2,
                           ["d.jsonl line 6 (byte ", "invalid UTF-8: byte(s) e9"], None),
    "invalid_utf8_skip": ("d.jsonl", [*ROWS[:5], b'{"text": "caf\xe9"}', *ROWS[6:]], "skip", 0, [],
                          {"bad_row:invalid_utf8": 1}),
    "empty_file": ("d.jsonl", [], "skip", 2, ["d.jsonl is empty (0 bytes)"], None),
    "ragged_csv": ("d.csv", [b"text,n", b"a,1", b"b, with a comma,2", b"c,3"], "raise", 2,
                   ["d.csv line 3 (byte 11): 3 fields, but the header has 2"], None),
    "not_parquet": ("d.parquet", ROWS, "skip", 2, ["d.parquet is not a parquet file"], None),
    "no_data_files": ("dir/notes.md", [b"notes"], "raise", 2, ["dir holds no data files"], None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGED))
def test_prepare_dataset_cli_on_damaged_files(tmp_path: Path, repo_root: Path, case: str):
    name, lines, on_bad_row, code, messages, dropped = DAMAGED[case]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    data_path = path.parent if case == "no_data_files" else path
    datasets = [{"path": str(data_path), "type": "completion"}]
    recipe = _write_recipe(
        tmp_path, repo_root / "recipes" / "demo" / "tokenizer", datasets, on_bad_row=on_bad_row
    )
    result = _run_cli(str(recipe))
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    for message in messages:
        assert message in result.stderr, result.stderr
    if code == 2:  # one line naming the entry and the file
        assert result.stderr.count("error: data.datasets[0]: ") == 1 and str(data_path) in result.stderr
    if dropped is not None:
        m = _manifest(result.stdout)
        assert m["dropped"] == dropped and m["rows_in"] == len(lines) == m["rows_kept"] + m["rows_dropped"]
        [sample] = m["bad_row_samples"]
        assert f"{path} line " in sample["detail"] and sample["reason"] == next(iter(dropped)).split(":")[1]


# ------------------------------------------------------------------------------------ weighted mixtures


def test_prepare_dataset_cli_weighted_mixture(tmp_path: Path, repo_root: Path):
    """The demo mixture recipe (arithmetic at 0.5, chat at 3.0), chat's weight overridden to 2.0 on the
    command line: packed, with a validation split held out before weighting."""
    recipe = repo_root / "recipes" / "demo" / "tiny_mix_cpu.yaml"
    prepared_path = str(tmp_path / "prepared")
    args = ("--data.dataset_prepared_path", prepared_path, "--data.datasets.1.weight", "2.0")
    result = _run_cli(str(recipe), *args)
    assert result.returncode == 0, result.stderr
    m = _manifest(result.stdout)
    arithmetic, chat = m["mixture"]
    assert (arithmetic["weight"], chat["weight"]) == (0.5, 2.0)
    assert [d["settings"]["weight"] for d in m["fingerprint_inputs"]["datasets"]] == [0.5, 2.0]
    assert (arithmetic["rows_in"], chat["rows_in"]) == (3000, 300)
    for d in (arithmetic, chat):
        assert d["rows_kept"] == d["rows_eval"] + d["rows_train"]
    assert arithmetic["rows_drawn"] == draw_count(0.5, arithmetic["rows_train"]) == 1425  # 2850 / 2
    assert chat["rows_drawn"] == 2 * chat["rows_train"]
    assert m["splits"]["train"]["examples"] == arithmetic["rows_drawn"] + chat["rows_drawn"]
    assert (
        m["splits"]["eval"]["examples"] == arithmetic["rows_eval"] + chat["rows_eval"] == round(0.05 * 3300)
    )
    assert m["splits"]["train"]["packed"]
    # The shares of trained tokens are those of the packed rows written to disk.
    train = datasets.load_from_disk(str(Path(prepared_path) / m["fingerprint"] / "train"))
    trained = sum(sum(x != -100 for x in labels) for labels in train["labels"])
    assert (
        arithmetic["num_trained_tokens"] + chat["num_trained_tokens"] == trained == m["num_trainable_tokens"]
    )
    assert chat["share_of_trained_tokens"] == pytest.approx(chat["num_trained_tokens"] / trained, abs=1e-6)
    assert arithmetic["share_of_rows"] + chat["share_of_rows"] == pytest.approx(1.0)
    for d in (arithmetic, chat):
        line = f"{d['dataset']} ({Path(d['path']).name}): weight {d['weight']:g}, {d['rows_train']} training rows"
        assert line in result.stdout
