"""finetune.model: building the model, attention backends, special tokens, LoRA variants, QLoRA
(bitsandbytes 4-bit on CPU), and merge_lora."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.checkpoint import file_stamps, record_written
from finetune.errors import FinetuneError
from finetune.model.adapters import apply_lora
from finetune.model.build import (
    build_model,
    check_attention_backend,
    count_parameters,
    full_shape,
    load_tokenizer,
    weight_dtype,
)
from finetune.model.inference import load_for_inference, merge_lora
from finetune.recipe import LoraSection, ModelSection
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[3]
DEMO_TOKENIZER = str(REPO / "recipes" / "demo" / "tokenizer")
# Multiples of 64 everywhere: bitsandbytes' CPU 4-bit kernels quantize in blocks of 64.
TINY = {
    "model_type": "llama", "vocab_size": 704, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}  # fmt: skip
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")


def _model_section(**kwargs) -> ModelSection:
    return ModelSection(config_path=dict(TINY), tokenizer_path=DEMO_TOKENIZER, **kwargs)


def _build(model: ModelSection | None = None, lora: LoraSection | None = None, *, vocab_size=704, gc=False):
    torch.manual_seed(0)
    return build_model(
        model or _model_section(),
        lora or LoraSection(),
        mixed_precision="no",
        vocab_size=vocab_size,
        gradient_checkpointing=gc,
    )


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved with save_pretrained: a 'pretrained' model on disk."""
    folder = tmp_path_factory.mktemp("base")
    tiny_model(**{k: v for k, v in TINY.items() if k != "model_type"}).save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO_TOKENIZER).save_pretrained(folder)
    return folder


def _ids(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, 704, (2, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- build, dtype, backends


def test_weight_dtype_rules():
    lora = LoraSection(enable_lora=True)
    assert weight_dtype(_model_section(), LoraSection(), "bf16") == torch.float32  # full FT: fp32 masters
    assert weight_dtype(_model_section(), lora, "bf16") == torch.bfloat16  # frozen LoRA base: 16-bit
    assert weight_dtype(_model_section(), lora, "no") == torch.float32
    assert weight_dtype(_model_section(torch_dtype="fp16"), LoraSection(), "no") == torch.float16


@pytest.mark.parametrize("name", ["flex_attention", "flash_attention_2"])
def test_gpu_only_attention_is_rejected_on_cpu(name):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(FinetuneError, match=r"model\.attn_implementation: .*use sdpa"):
        check_attention_backend(name)
    with pytest.raises(FinetuneError, match=name):
        _build(_model_section(attn_implementation=name))


def test_cpu_attention_backends_build():
    check_attention_backend("sdpa")
    check_attention_backend("eager")
    assert _build(_model_section(attn_implementation="eager")).config._attn_implementation == "eager"


def test_gradient_checkpointing_recomputes_layers_in_backward():
    counts = {True: 0, False: 0}
    for gc in (False, True):
        net = _build(gc=gc).train()
        assert net.is_activation_checkpointing is gc
        assert not (gc and net.config.use_cache)

        act = net.model.layers[0].mlp.act_fn
        forward = act.forward

        def counting_forward(x, gc=gc, forward=forward):
            counts[gc] += 1
            return forward(x)

        # A patched forward, not a hook: module hooks do not fire again during the recomputation.
        act.forward = counting_forward
        ids = _ids()
        net(input_ids=ids, labels=ids).loss.backward()
    # Without checkpointing the activation runs once; with it, once more during backward.
    assert counts == {False: 1, True: 2}


def test_special_tokens_add_pad_and_resize_embeddings():
    model = _model_section(special_tokens={"pad_token": "<|pad|>", "additional_special_tokens": ["<|tool|>"]})
    plain = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer = load_tokenizer(model)
    assert len(tokenizer) == len(plain) + 2
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id == len(plain)
    assert tokenizer.convert_tokens_to_ids("<|tool|>") == len(plain) + 1
    # The new special tokens are single tokens in text.
    assert tokenizer("a<|tool|>b", add_special_tokens=False).input_ids.count(len(plain) + 1) == 1
    net = _build(model, vocab_size=len(tokenizer))
    assert net.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert net.get_output_embeddings().weight.shape[0] == len(tokenizer)
    ids = torch.tensor([[5, 6, tokenizer.pad_token_id, len(plain) + 1]])
    assert net(input_ids=ids).logits.shape == (1, 4, len(tokenizer))


def test_zero3_partitioned_embeddings_are_not_resized(monkeypatch):
    """Under DeepSpeed ZeRO-3 a parameter is empty on each process and keeps its whole shape in
    `ds_shape`: build_model read the empty shape, "resized" the embeddings to their own size and so
    drew from the RNG (mean resizing), which moved every later dropout mask away from the run
    without ZeRO-3. The partition is made here as DeepSpeed makes it (data emptied, ds_shape kept)."""
    build = AutoModelForCausalLM.from_config

    def partitioned(*args, **kwargs):
        net = build(*args, **kwargs)
        weight = net.get_input_embeddings().weight
        weight.ds_shape = weight.shape
        weight.data = torch.empty(0)
        net.resize_token_embeddings = lambda *a, **k: pytest.fail(f"resized to {a} under ZeRO-3")
        return net

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", partitioned)
    torch.manual_seed(0)
    net = build_model(
        _model_section(), LoraSection(), mixed_precision="no", vocab_size=704, gradient_checkpointing=False
    )
    assert full_shape(net.get_input_embeddings().weight) == (704, 64)


def test_chat_template_by_name():
    tokenizer = load_tokenizer(_model_section(chat_template="chatml"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_missing_tokenizer_is_a_finetune_error(tmp_path):
    with pytest.raises(FinetuneError, match="tokenizer_path"):
        load_tokenizer(ModelSection(config_path=dict(TINY), tokenizer_path=str(tmp_path / "nope")))


# ---------------------------------------------------------------------------------------------- LoRA


def _lora_layers(net) -> dict[str, LoraLayer]:
    return {name: m for name, m in net.named_modules() if isinstance(m, LoraLayer)}


def test_lora_target_modules_as_list_and_modules_to_save():
    lora = LoraSection(
        enable_lora=True,
        lora_rank=4,
        lora_alpha=8,
        lora_target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
    )
    net = apply_lora(_build(), lora, gradient_checkpointing=False)
    config = net.peft_config["default"]
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    layers = _lora_layers(net)
    assert len(layers) == 2 * TINY["num_hidden_layers"]
    assert {name.rsplit(".", 1)[-1] for name in layers} == {"q_proj", "v_proj"}
    for layer in layers.values():
        assert layer.r["default"] == 4 and layer.scaling["default"] == pytest.approx(8 / 4)
    assert isinstance(net.base_model.model.lm_head, ModulesToSaveWrapper)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "lm_head.modules_to_save" in n for n in trainable)
    assert any("lm_head.modules_to_save" in n for n in trainable)
    assert count_parameters(net)[0] == sum(p.numel() for n, p in net.named_parameters() if n in trainable)


def test_all_linear_targets_every_projection_but_not_lm_head():
    net = apply_lora(_build(), LoraSection(enable_lora=True), gradient_checkpointing=False)
    names = {name.rsplit(".", 1)[-1] for name in _lora_layers(net)}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_rslora_scales_by_sqrt_rank():
    lora = LoraSection(enable_lora=True, lora_rank=16, lora_alpha=8, use_rslora=True)
    net = apply_lora(_build(), lora, gradient_checkpointing=False)
    assert net.peft_config["default"].use_rslora is True
    for layer in _lora_layers(net).values():
        assert layer.scaling["default"] == pytest.approx(8 / math.sqrt(16))


def test_dora_adds_magnitude_vectors():
    lora = LoraSection(enable_lora=True, lora_rank=4, use_dora=True, lora_target_modules=["q_proj"])
    net = apply_lora(_build(), lora, gradient_checkpointing=False)
    assert net.peft_config["default"].use_dora is True
    magnitudes = [(n, p) for n, p in net.named_parameters() if "lora_magnitude_vector" in n]
    assert len(magnitudes) == TINY["num_hidden_layers"]
    assert all(p.requires_grad and p.ndim == 1 for _, p in magnitudes)
    ids = _ids()
    net(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in magnitudes)


def test_unknown_target_module_is_a_finetune_error():
    lora = LoraSection(enable_lora=True, lora_target_modules=["no_such_proj"])
    with pytest.raises(FinetuneError, match="lora_target_modules"):
        apply_lora(_build(), lora, gradient_checkpointing=False)


# --------------------------------------------------------------------------------------------- QLoRA


def test_qlora_needs_a_pretrained_model_path():
    pytest.importorskip("bitsandbytes")
    with pytest.raises(FinetuneError, match="model_path"):
        _build(lora=LoraSection(enable_qlora=True, enable_lora=True))


def test_qlora_without_bitsandbytes_says_how_to_install(without_bitsandbytes, base_dir):
    with pytest.raises(FinetuneError, match=r"bitsandbytes.*\[qlora\]"):
        _build(ModelSection(model_path=str(base_dir)), LoraSection(enable_qlora=True, enable_lora=True))


@needs_bnb
@pytest.mark.parametrize(("quant_type", "double_quant"), [("fp4", False), ("nf4", True)])
def test_qlora_quantizes_the_base_and_trains_only_lora(base_dir, quant_type, double_quant):
    import bitsandbytes as bnb

    lora = LoraSection(
        enable_qlora=True, enable_lora=True, quant_type=quant_type, double_quant=double_quant, lora_rank=4
    )
    assert lora.enable_lora  # implied
    net = build_model(
        ModelSection(model_path=str(base_dir)),
        lora,
        mixed_precision="no",
        vocab_size=704,
        gradient_checkpointing=True,
    )
    assert net.is_loaded_in_4bit
    q_proj = net.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, bnb.nn.Linear4bit)
    assert q_proj.weight.quant_state.quant_type == quant_type
    assert q_proj.weight.quant_state.nested is double_quant
    net = apply_lora(net, lora, gradient_checkpointing=True)
    assert isinstance(net.base_model.model.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    net.train()
    ids = _ids()
    loss = net(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    trainable = {n: p for n, p in net.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is not None for n, p in trainable.items() if "lora_B" in n)
    assert any(p.grad.abs().sum() > 0 for n, p in trainable.items() if "lora_B" in n)


# ------------------------------------------------------------------------------------------- merging


def _adapter(base_dir: Path, folder: Path, lora: LoraSection, tokenizer=None) -> PeftModel:
    """A PeftModel on the saved base with non-zero LoRA weights (and trained modules_to_save), saved."""
    net = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if tokenizer is not None:
        net.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    peft_model = apply_lora(net, lora, gradient_checkpointing=False)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in peft_model.parameters():
            if param.requires_grad:  # lora_A/B, magnitudes, modules_to_save copies
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return peft_model.eval()


@pytest.mark.parametrize(
    "variant",
    [
        {"lora_target_modules": ["q_proj", "v_proj", "down_proj"], "modules_to_save": ["lm_head"]},
        {"use_dora": True, "lora_target_modules": ["q_proj", "o_proj"]},
        {"use_rslora": True},
    ],
    ids=["list+modules_to_save", "dora", "rslora"],
)
def test_merge_lora_gives_the_same_logits(tmp_path, base_dir, variant):
    lora = LoraSection(enable_lora=True, lora_rank=4, lora_alpha=8, **variant)
    reference = _adapter(base_dir, tmp_path / "adapter", lora)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(base_dir)
    merge_lora(str(tmp_path / "adapter"), str(tmp_path / "merged"))
    merged_dir = tmp_path / "merged"
    assert (merged_dir / "model.safetensors").is_file()
    assert not (merged_dir / "adapter_config.json").exists()
    keys = load_file(merged_dir / "model.safetensors").keys()
    assert not any("lora_" in k or "modules_to_save" in k or "base_layer" in k for k in keys)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert (
        AutoTokenizer.from_pretrained(merged_dir).vocab_size
        == AutoTokenizer.from_pretrained(base_dir).vocab_size
    )
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = _ids()
    with torch.no_grad():
        want, got, plain = (
            reference(input_ids=ids).logits,
            merged(input_ids=ids).logits,
            base(input_ids=ids).logits,
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the output: the check is not vacuous


def test_merge_lora_with_added_special_tokens(tmp_path, base_dir):
    """Training with special_tokens grows the embeddings; merging must grow the base the same way."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>", "additional_special_tokens": ["<|tool|>"]})
    lora = LoraSection(enable_lora=True, lora_rank=4, modules_to_save=["embed_tokens", "lm_head"])
    reference = _adapter(base_dir, tmp_path / "adapter", lora, tokenizer=tokenizer)
    merge_lora(str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="fp32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.vocab_size == len(tokenizer) == 706
    assert len(AutoTokenizer.from_pretrained(tmp_path / "merged")) == 706
    ids = torch.tensor([[1, 5, 6, 704, 705, 9]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5
        )


def test_merge_lora_errors_name_the_fix(tmp_path, base_dir):
    with pytest.raises(FinetuneError, match=r"adapter_config\.json"):
        merge_lora(str(tmp_path), str(tmp_path / "out"))
    _adapter(base_dir, tmp_path / "adapter", LoraSection(enable_lora=True, lora_rank=2))
    with pytest.raises(FinetuneError, match="--base"):
        merge_lora(str(tmp_path / "adapter"), str(tmp_path / "out"), base=str(tmp_path / "moved"))


def test_load_for_inference_takes_an_adapter_or_a_full_model(tmp_path, base_dir):
    reference = _adapter(base_dir, tmp_path / "adapter", LoraSection(enable_lora=True, lora_rank=4))
    ids = _ids()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        adapter, tokenizer = load_for_inference(str(tmp_path / "adapter"))  # base: the recorded one
        assert isinstance(adapter, PeftModel) and not adapter.training and len(tokenizer) == 704
        torch.testing.assert_close(adapter(input_ids=ids).logits, want)
        merged, _ = load_for_inference(str(tmp_path / "adapter"), base=str(base_dir), merge=True)
        assert not isinstance(merged, PeftModel)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        full, _ = load_for_inference(str(base_dir), dtype="bf16")
        assert full.dtype == torch.bfloat16 and not full.training
    with pytest.raises(FinetuneError, match="not an adapter folder"):
        load_for_inference(str(base_dir), base=str(base_dir))
    with pytest.raises(FinetuneError, match="missing does not exist"):
        load_for_inference(str(tmp_path / "missing"))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_a_recorded_adapter_or_merged_model_is_verified_when_loaded(tmp_path, base_dir):
    """Outputs finetune wrote with a checksums.json (training's final save, merge-lora) are checked
    on load: a changed byte is an error naming the file; without the record (older runs) they load."""
    adapter = tmp_path / "adapter"
    before = file_stamps(adapter)
    _adapter(base_dir, adapter, LoraSection(enable_lora=True, lora_rank=4))
    assert record_written(adapter, before) == ["adapter_config.json", "adapter_model.safetensors"]
    merge_lora(str(adapter), str(tmp_path / "merged"))
    merged = tmp_path / "merged"
    record = json.loads((merged / "checksums.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(record)
    load_for_inference(str(adapter))
    load_for_inference(str(merged))
    for folder, name in ((adapter, "adapter_model.safetensors"), (merged, "model.safetensors")):
        _flip_a_byte(folder / name)
        with pytest.raises(
            FinetuneError, match=rf"{folder} does not load: {folder / name} does not match its checksum"
        ):
            load_for_inference(str(folder))
        (folder / "checksums.json").unlink()  # an output written before finetune recorded checksums
        load_for_inference(str(folder))  # loads as before: nothing to check against


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qlora_stores_4bit_weights_in_the_compute_dtype(dtype):
    """Packed 4-bit weights stored as the compute dtype (bf16 under bf16): FSDP2 and ZeRO-3 then shard
    them together with the rest of the model, which has that dtype."""
    from finetune.model.build import qlora_config

    config = qlora_config(LoraSection(enable_qlora=True, enable_lora=True), compute_dtype=dtype)
    assert config.bnb_4bit_quant_storage == dtype and config.bnb_4bit_compute_dtype == dtype


def test_a_vision_language_model_is_refused_for_text_generation(tmp_path):
    """eval and export-gguf load text models: a VLM folder (or an adapter on a VLM base) is a clear error,
    not transformers' unrecognized configuration class (chat loads it with load_vlm_for_inference)."""
    import json

    from finetune.errors import FinetuneError
    from finetune.model.inference import load_for_inference

    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(vlm)}))
    for folder in (vlm, adapter):
        with pytest.raises(FinetuneError, match="is a vision-language model"):
            load_for_inference(str(folder))


def test_a_full_disk_while_the_base_model_is_written_is_a_clear_error(tmp_path, monkeypatch):
    """The random-init base written at the start (so the adapter can be loaded later): a full disk is a
    FinetuneError naming the folder, and no half-written base is left to be loaded later."""
    import errno

    from finetune.errors import FinetuneError
    from finetune.model.build import save_base_model
    from tests.tiny import tiny_model

    net = tiny_model()

    def full(folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(net, "save_pretrained", full)
    with pytest.raises(FinetuneError, match=r"writing the randomly initialised base model .*no space left"):
        save_base_model(net, tmp_path / "base_model")
    assert not (tmp_path / "base_model").exists()


def test_a_model_folder_without_weights_is_a_clear_error(tmp_path):
    from finetune.errors import FinetuneError
    from finetune.model.build import build_model
    from finetune.recipe import LoraSection, ModelSection
    from tests.tiny import tiny_model

    tiny_model().config.save_pretrained(tmp_path)  # config.json, no weights
    with pytest.raises(FinetuneError, match=r"model\.model_path .*holds no weights transformers can load"):
        build_model(
            ModelSection(model_path=str(tmp_path)), LoraSection(), mixed_precision="no", vocab_size=64,
            gradient_checkpointing=False,
        )  # fmt: skip
