"""finetune.gguf.arch: Gemma 2, Gemma 3 (text), Phi-3 and Qwen3-MoE written as GGUF files, checked
by loading them back with transformers' own GGUF loader (`gguf_file=`, which reads all four: its
Gemma2TensorProcessor subtracts the norms' +1, its Qwen2MoeTensorProcessor stacks the experts back),
and by reading the files with gguf.GGUFReader where the loader reads less than llama.cpp does
(soft-capping, LongRoPE, the expert counts).

Tiny random models built from each transformers config class (2 layers), with the demo's byte-level
BPE tokenizer. Settings the loader does not read back are left at the config's defaults, as for Qwen3
in test_gguf_export.py: Gemma's head size 256 and query_pre_attn_scalar 256, its soft-capping, Qwen3-MoE's
moe_intermediate_size 768.
"""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from finetune.errors import FinetuneError
from finetune.gguf.export import OUTTYPES, gguf_architecture, write_gguf
from tests.unit.gguf.test_gguf_export import DEMO_TOKENIZER, TEXTS, load_back, rounded, tiny

# model_type -> (GGUF architecture, tiny config settings). Qwen3-MoE: 4 experts, 2 a token, weights
# renormalised (norm_topk_prob, which llama.cpp's qwen3moe always does).
ARCHS = {
    "gemma2": ("gemma2", {}),
    "gemma3_text": ("gemma3", {}),
    "phi3": ("phi3", {}),
    "qwen3_moe": ("qwen3moe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}),
}


# Largest logit difference allowed, as a fraction of the largest logit (test_gguf_export.py's, loosened
# where these models measured more: benchmarks/RESULTS.md, "GGUF export: Gemma 2/3, Phi-3, Qwen3-MoE").
# Measured at most: f16 0.11%, bf16 0.83%, q8_0 3.3% (Gemma 3), q5_1 30% (Qwen3-MoE), q5_0 20%,
# q4_1 46% and q4_0 37% (Gemma 3, whose q/k norms rescale the rounded projections; its logits are
# small, largest 0.66, on random weights). The weights themselves are checked exactly, so a wrong
# transform (a norm without its +1, experts swapped) fails there whatever the tolerance.
TOLERANCE = {"f16": 2e-3, "bf16": 1e-2, "q8_0": 5e-2, "q5_1": 0.4, "q5_0": 0.3, "q4_1": 0.6, "q4_0": 0.5}


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def model(model_type: str, tokenizer, **config):
    """A tiny model whose norms are random too (Gemma's initialise to 0, the others' to 1: the +1 and
    its inverse would go unseen). Qwen3-MoE's router is scaled up so that each token's top experts win
    by a margin: with near-ties the outtype's rounding of the attention output picks other experts,
    and the logits then differ by more than the rounding (Q8_0: 15% of the largest logit unscaled, 2%
    scaled); the router's own weights are written F32 either way."""
    net = tiny(model_type, len(tokenizer), **{**ARCHS[model_type][1], **config})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
            if name.endswith("mlp.gate.weight"):
                param.mul_(30)
    return net


def as_stored(name: str, tensor: torch.Tensor, model_type: str, qtype) -> torch.Tensor:
    """What the loader gives back for one of the model's tensors: matrices rounded to the outtype
    (through gguf's own quantize and dequantize), the router and 1-D tensors in F32, Gemma's norms
    stored plus one and read back minus one (in float32, as both sides compute it)."""
    if name.endswith("mlp.gate.weight") or tensor.ndim == 1:
        data = tensor.detach().float()
        return (data + 1) - 1 if model_type.startswith("gemma") and name.endswith("norm.weight") else data
    return rounded(tensor, qtype)


@pytest.mark.parametrize("model_type", ARCHS)
def test_architecture_loads_back_with_the_same_logits_weights_and_tokenizer(
    tmp_path, demo_tokenizer, model_type
) -> None:
    assert gguf_architecture(model_type) == ARCHS[model_type][0]
    net = model(model_type, demo_tokenizer)
    ids = torch.tensor([demo_tokenizer(TEXTS[0]).input_ids])
    with torch.no_grad():
        want = net(ids).logits
    for outtype in OUTTYPES:
        path = tmp_path / f"{model_type}-{outtype}.gguf"
        write_gguf(net, demo_tokenizer, path, outtype=outtype, name=f"tiny-{model_type}")
        back, tokenizer = load_back(path)
        assert type(back) is type(net)
        with torch.no_grad():
            got = back(ids).logits
        diff = (got - want).abs().max().item()
        assert diff <= TOLERANCE[outtype] * want.abs().max().item(), (outtype, diff)
        assert diff > 0 or outtype == "f16"
        qtype = gguf.GGMLQuantizationType[outtype.upper()]
        loaded = back.state_dict()
        for name, tensor in net.state_dict().items():
            assert torch.equal(loaded[name], as_stored(name, tensor, model_type, qtype)), (outtype, name)
        for text in TEXTS:
            assert tokenizer(text).input_ids == demo_tokenizer(text).input_ids, text
        assert tokenizer.chat_template == demo_tokenizer.chat_template


def fields_and_tensors(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    return fields, {t.name: t for t in reader.tensors}


def stored(tensor) -> np.ndarray:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


def test_gemma_files_hold_what_llama_cpp_reads(tmp_path, demo_tokenizer) -> None:
    """Gemma 2: soft-capping, sliding window and head size as keys, norms plus one, no output tensor
    (tied). Gemma 3: the global layers' rope base, q/k norms plus one too."""
    net = model("gemma2", demo_tokenizer, sliding_window=64)
    write_gguf(net, demo_tokenizer, tmp_path / "g2.gguf", outtype="f16", name="g2")
    fields, tensors = fields_and_tensors(tmp_path / "g2.gguf")
    assert fields["general.architecture"] == "gemma2"
    assert (
        fields["gemma2.attn_logit_softcapping"] == 50.0 and fields["gemma2.final_logit_softcapping"] == 30.0
    )
    assert fields["gemma2.attention.sliding_window"] == 64
    assert fields["gemma2.attention.key_length"] == fields["gemma2.attention.value_length"] == 256
    assert "output.weight" not in tensors
    norm = net.state_dict()["model.layers.1.post_feedforward_layernorm.weight"]
    assert np.array_equal(stored(tensors["blk.1.post_ffw_norm.weight"]), (norm + 1).numpy())
    assert tensors["blk.1.post_ffw_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    net = model("gemma3_text", demo_tokenizer)
    write_gguf(net, demo_tokenizer, tmp_path / "g3.gguf", outtype="q8_0", name="g3")
    fields, tensors = fields_and_tensors(tmp_path / "g3.gguf")
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.rope.freq_base"] == 1e6
    assert fields["gemma3.rope.freq_base_swa"] == 1e4  # the local layers' (transformers' sliding_attention)
    assert fields["gemma3.attention.sliding_window"] == 4096 and "gemma3.attn_logit_softcapping" not in fields
    assert "gemma3.rope.scaling.type" not in fields
    q_norm = net.state_dict()["model.layers.0.self_attn.q_norm.weight"]
    assert np.array_equal(stored(tensors["blk.0.attn_q_norm.weight"]), (q_norm + 1).numpy())
    assert "output.weight" not in tensors
    # Gemma 3 4B and larger scale the global layers' rope linearly (factor 8): written as llama.cpp reads it.
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    write_gguf(
        model("gemma3_text", demo_tokenizer, rope_parameters=rope),
        demo_tokenizer,
        tmp_path / "g3l.gguf",
        outtype="f16",
        name="g3l",
    )
    fields = fields_and_tensors(tmp_path / "g3l.gguf")[0]
    assert (fields["gemma3.rope.scaling.type"], fields["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
    assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 1e4


def test_phi3_keeps_qkv_and_gate_up_fused_and_writes_longrope(tmp_path, demo_tokenizer) -> None:
    """Phi-3's fused projections stay fused, unpermuted; LongRoPE (Phi-3-mini-128k, Phi-3.5) as
    llama.cpp takes it: the factor tensors and the attention factor, checked against transformers' own
    rotary embedding (transformers' GGUF loader reads neither back: checked in the file)."""
    half = 8  # head_dim 16: 8 rotary frequencies
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    rope |= {
        "long_factor": [1.0 + i for i in range(half)],
        "short_factor": [1.0 + i / 10 for i in range(half)],
    }
    net = model("phi3", demo_tokenizer, rope_parameters=rope, original_max_position_embeddings=32)
    write_gguf(net, demo_tokenizer, tmp_path / "p.gguf", outtype="q8_0", name="p")
    fields, tensors = fields_and_tensors(tmp_path / "p.gguf")
    assert fields["phi3.rope.scaling.original_context_length"] == 32
    assert fields["phi3.rope.dimension_count"] == 16
    assert fields["phi3.attention.sliding_window"] == 0  # none: 0, as llama.cpp's converter writes it
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(net.model.rotary_emb.attention_scaling)
    assert net.model.rotary_emb.attention_scaling > 1  # 128 positions over 32: the factor is in use
    assert stored(tensors["rope_factors_long.weight"]).tolist() == rope["long_factor"]
    assert np.allclose(stored(tensors["rope_factors_short.weight"]), rope["short_factor"])
    state = net.state_dict()
    qkv, gate_up = tensors["blk.0.attn_qkv.weight"], tensors["blk.0.ffn_up.weight"]
    assert stored(qkv).shape == (128, 64) and stored(gate_up).shape == (256, 64)  # 64+32+32; 2x128
    assert np.array_equal(
        stored(qkv), rounded(state["model.layers.0.self_attn.qkv_proj.weight"], qkv.tensor_type)
    )
    assert np.array_equal(
        stored(gate_up), rounded(state["model.layers.0.mlp.gate_up_proj.weight"], gate_up.tensor_type)
    )


def test_qwen3_moe_experts_are_split_and_stacked_as_llama_cpp_reads_them(tmp_path, demo_tokenizer) -> None:
    net = model("qwen3_moe", demo_tokenizer)
    counts = write_gguf(net, demo_tokenizer, tmp_path / "m.gguf", outtype="q8_0", name="m")
    fields, tensors = fields_and_tensors(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "qwen3moe"
    assert (fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"]) == (4, 2)
    assert fields["qwen3moe.expert_feed_forward_length"] == 768
    assert fields["qwen3moe.attention.key_length"] == 16
    state = net.state_dict()
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]  # [experts, 2 x 768, hidden]
    for name, want in (
        ("ffn_gate_exps", gate_up[:, :768]),
        ("ffn_up_exps", gate_up[:, 768:]),
        ("ffn_down_exps", state["model.layers.1.mlp.experts.down_proj"]),
    ):
        tensor = tensors[f"blk.1.{name}.weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert np.array_equal(stored(tensor), rounded(want, tensor.tensor_type).numpy()), name
    router = tensors["blk.1.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(stored(router), state["model.layers.1.mlp.gate.weight"].numpy())
    # Per layer: q, k, v, o and 3 expert stacks in Q8_0; router, 2 norms and q/k norms in F32.
    assert counts == {"Q8_0": 2 * 7 + 2, "F32": 2 * 5 + 1}


def test_what_llama_cpp_runs_differently_is_said_or_refused(tmp_path, demo_tokenizer, capsys) -> None:
    net = model("gemma2", demo_tokenizer, query_pre_attn_scalar=144)
    write_gguf(net, demo_tokenizer, tmp_path / "a.gguf", outtype="f16", name="a")
    assert "query_pre_attn_scalar is 144, neither the head size 256 nor hidden size / heads" in (
        capsys.readouterr().err
    )
    layers = ["full_attention", "sliding_attention"]
    write_gguf(
        model("gemma3_text", demo_tokenizer, layer_types=layers),
        demo_tokenizer,
        tmp_path / "b.gguf",
        outtype="f16",
        name="b",
    )
    assert "sliding-window layers (full_attention, sliding_attention) are not llama.cpp's fixed gemma3" in (
        capsys.readouterr().err
    )
    write_gguf(
        model("qwen3_moe", demo_tokenizer, norm_topk_prob=False),
        demo_tokenizer,
        tmp_path / "c.gguf",
        outtype="f16",
        name="c",
    )
    assert "norm_topk_prob is False, but llama.cpp's qwen3moe always renormalises" in capsys.readouterr().err
    with pytest.raises(
        FinetuneError, match=r"Gemma 3 model soft-caps attention logits \(attn_logit_softcapping 50"
    ):
        write_gguf(
            model("gemma3_text", demo_tokenizer, attn_logit_softcapping=50.0),
            demo_tokenizer,
            tmp_path / "e.gguf",
            outtype="f16",
            name="e",
        )
    assert not (tmp_path / "e.gguf").exists()
    write_gguf(
        model("gemma2", demo_tokenizer, final_logit_softcapping=None),
        demo_tokenizer,
        tmp_path / "f.gguf",
        outtype="f16",
        name="f",
    )
    assert "final_logit_softcapping is off, but llama.cpp's gemma2 then applies its default cap" in (
        capsys.readouterr().err
    )
    assert "gemma2.final_logit_softcapping" not in fields_and_tensors(tmp_path / "f.gguf")[0]
    with pytest.raises(FinetuneError, match=r"layers \[1\] of this Qwen3-MoE model are dense"):
        write_gguf(
            model("qwen3_moe", demo_tokenizer, mlp_only_layers=[1]),
            demo_tokenizer,
            tmp_path / "d.gguf",
            outtype="f16",
            name="d",
        )
    assert not (tmp_path / "d.gguf").exists()
    # Gemma 2 in GGUF has no output matrix of its own: untied embeddings cannot be written.
    with pytest.raises(
        FinetuneError, match=r"tensor 'lm_head.weight' has no name in GGUF's gemma2 architecture"
    ):
        write_gguf(
            model("gemma2", demo_tokenizer, tie_word_embeddings=False),
            demo_tokenizer,
            tmp_path / "g.gguf",
            outtype="f16",
            name="g",
        )
    assert not (tmp_path / "g.gguf").exists()
    # The model types still refused name the new ones among the supported.
    with pytest.raises(
        FinetuneError,
        match=r"'gemma' is not supported; supported: .*gemma2 \(as gemma2\), "
        r"gemma3_text \(as gemma3\), phi3 \(as phi3\), qwen3_moe \(as qwen3moe\)",
    ):
        gguf_architecture("gemma")


@pytest.mark.parametrize("model_type", ARCHS)
def test_an_exported_file_is_a_base_through_the_gguf_in_path(tmp_path, demo_tokenizer, model_type) -> None:
    """finetune's own GGUF-in path (finetune.gguf.convert: dense weights, no quantizer left, the
    cached Hugging Face folder a recipe trains on) reads each exported architecture back."""
    from transformers import AutoModelForCausalLM

    from finetune.gguf.convert import converted_folder

    net = model(model_type, demo_tokenizer)
    path = tmp_path / f"{model_type}.gguf"
    write_gguf(net, demo_tokenizer, path, outtype="f16", name=model_type)
    folder = converted_folder(path, root=tmp_path / "cache")
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(back) is type(net) and getattr(back.config, "quantization_config", None) is None
    ids = torch.tensor([demo_tokenizer(TEXTS[2]).input_ids])
    with torch.no_grad():
        want, got = net(ids).logits, back(ids).logits
    assert (got - want).abs().max().item() <= TOLERANCE["f16"] * want.abs().max().item()


def test_export_gguf_writes_a_saved_gemma3_run(tmp_path, demo_tokenizer) -> None:
    """The command's path (finetune.model.inference.export_gguf): a saved Gemma 3 text model folder is
    accepted from its config, loaded, written and read back."""
    from finetune.model.inference import export_gguf

    net = model("gemma3_text", demo_tokenizer)
    net.save_pretrained(tmp_path / "run")
    demo_tokenizer.save_pretrained(tmp_path / "run")
    path = export_gguf(str(tmp_path / "run"), outtype="q8_0", output=str(tmp_path / "out" / "g.gguf"))
    ids = torch.tensor([demo_tokenizer(TEXTS[1]).input_ids])
    with torch.no_grad():
        want, got = net(ids).logits, load_back(path)[0](ids).logits
    assert (got - want).abs().max().item() <= TOLERANCE["q8_0"] * want.abs().max().item()


@pytest.mark.parametrize("model_type", ARCHS)
def test_llama_cpp_runs_the_exported_architecture(tmp_path, demo_tokenizer, model_type) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(
            "llama-cpp-python is not installed: PyPI has only its sdist (`pip download llama-cpp-python "
            "--only-binary :all:` finds no wheel for this platform), and building llama.cpp from it takes "
            "about half an hour on 2 cores"
        )
    import llama_cpp

    net = model(model_type, demo_tokenizer)
    path = tmp_path / f"{model_type}.gguf"
    write_gguf(net, demo_tokenizer, path, outtype="f16", name=model_type)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    prompt = demo_tokenizer(TEXTS[0]).input_ids
    assert llm.tokenize(TEXTS[0].encode()) == prompt
    llm.eval(prompt)
    with torch.no_grad():
        want = net(torch.tensor([prompt])).logits[0].numpy()
    got = np.asarray(llm.scores[: len(prompt)])
    assert np.abs(got - want).max() <= 10 * TOLERANCE["f16"] * np.abs(want).max()
