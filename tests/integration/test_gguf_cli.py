"""GGUF bases through the real CLI: a damaged file is exit 2 without a traceback; an adapter trained
on a GGUF shipped in a package loads for chat and merge-lora on a "machine" whose conversion cache
is empty (tiny GGUF file from tests/tiny.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._run import DEMO, REPO, assert_quiet, demo_overrides, env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None, reason="needs the gguf package to write GGUF"
    ),
]

REF = "package://tiny_gguf_pkg/tiny.gguf"


def _finetune(*args: str, cache: Path, site: Path | None = None) -> subprocess.CompletedProcess:
    variables = {**env(), "FINETUNE_GGUF_CACHE": str(cache)}
    if site is not None:
        variables["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), variables.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "finetune.cli", *args],
        cwd=REPO,
        env=variables,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_quiet(result.stdout + result.stderr)
    return result


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny import tiny_gguf

    tmp = tmp_path_factory.mktemp("gguf_cli")
    return tiny_gguf(
        tmp / "tiny.gguf", metadata={"general.source.url": "https://huggingface.co/org/tiny-source"}
    )


def test_a_cut_short_gguf_file_is_exit_2_without_a_traceback(gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(gguf.read_bytes()[:-1000])
    result = _finetune("chat", str(bad), "--prompt", "hi", cache=tmp_path / "cache")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"{bad}: the GGUF tensor data is cut short or damaged" in result.stderr


def test_an_adapter_trained_on_a_gguf_runs_where_its_conversion_is_not_cached(
    gguf: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site" / "tiny_gguf_pkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    shutil.copyfile(gguf, site / "tiny.gguf")
    model = [
        "--model.model_path", REF, "--model.config_path", "null", "--model.tokenizer_path", "null",
        "--lora.modules_to_save", "[]",
    ]  # fmt: skip
    overrides = [*demo_overrides(tmp_path), *model, "--train.max_steps", "2", "--train.eval_steps", "null"]
    trained = _finetune("train", str(DEMO), *overrides, cache=tmp_path / "cache-a", site=tmp_path / "site")
    assert trained.returncode == 0, trained.stderr[-3000:]
    out = tmp_path / "out"
    config = (out / "adapter_config.json").read_text()
    assert json.loads(config)["base_model_name_or_path"] == REF
    assert str(tmp_path / "cache-a") not in config
    assert "base_model: org/tiny-source" in (out / "README.md").read_text()

    shutil.rmtree(tmp_path / "cache-a")  # another machine: an empty cache
    cache = tmp_path / "cache-b"
    chat = _finetune(
        "chat",
        str(out),
        "--prompt",
        "What is 2 plus 3?",
        "--max-new-tokens",
        "4",
        cache=cache,
        site=tmp_path / "site",
    )
    assert chat.returncode == 0, chat.stderr[-3000:]
    merged = _finetune(
        "merge-lora", str(out), "--output", str(tmp_path / "merged"), cache=cache, site=tmp_path / "site"
    )
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert "Traceback" not in chat.stderr + merged.stderr
    # finetune eval resolves an adapter's base the same way (tests/unit/gguf/test_gguf_base.py).
