"""finetune.losses.chunked_ce: chunked loss and log-probs equal the unchunked computation (fp32, tight
tolerance) for plain, tied and PEFT heads, packed and padded batches, odd chunk sizes and chunks with no
label; no [tokens x vocab] tensor is ever made; wrappers (DDP, torch.compile) and refusals."""

from __future__ import annotations

import copy
import gc
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from finetune.data.batching.collate import collate_rows
from finetune.errors import FinetuneError
from finetune.losses.chunked_ce import (
    causal_lm_loss,
    causal_lm_token_logps,
    chunked_cross_entropy,
    chunked_token_logps,
    resolve_loss_chunk_size,
)
from finetune.losses.preference import token_logps
from tests.memory import peak_allocated_bytes
from tests.tiny import sequences, tiny_model

VOCAB = 97
# fp32: only the order of the float sums differs from the unchunked loss.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def tiny_llama(*, tie: bool = False, **extra) -> nn.Module:
    return tiny_model(vocab_size=VOCAB, tie_word_embeddings=tie, **extra)


def padded_batch() -> dict:
    return collate_rows(sequences(), pad_token_id=0, packed=False)


def packed_batch() -> dict:
    """Two packed rows (position_ids restart at 0 per sequence), the second one shorter."""
    seqs = sequences()
    rows = []
    for group in (seqs[:2], seqs[2:]):
        rows.append(
            {
                "input_ids": [t for s in group for t in s["input_ids"]],
                "labels": [t for s in group for t in s["labels"]],
                "position_ids": [p for s in group for p in range(len(s["input_ids"]))],
            }
        )
    return collate_rows(rows, pad_token_id=0, packed=True)


BATCHES = {"packed": packed_batch, "padded": padded_batch}


def trainable_count(batch: dict) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def model_reference(model, batch, num_items) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False, num_items_in_batch=num_items).loss
    loss.backward()
    return loss.detach(), grads_of(model)


def model_chunked(model, batch, num_items, chunk_size) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, batch, num_items=num_items, chunk_size=chunk_size)
    loss.backward()
    return loss.detach(), grads_of(model)


def assert_same(loss, grads, ref_loss, ref_grads) -> None:
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------ tensor level


def _tensor_case(bias: bool, num_tokens: int = 37, hidden_size: int = 16):
    torch.manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, VOCAB, bias=bias)
    labels = torch.randint(0, VOCAB, (num_tokens,))
    labels[:12] = -100  # with chunk sizes up to 12, the first chunk(s) have no label at all
    labels[20] = -100
    return hidden, head, labels


def _head_grads(hidden, head) -> list[torch.Tensor]:
    grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return [g.clone() for g in grads]


def _reset(hidden, head) -> None:
    hidden.grad = None
    head.zero_grad(set_to_none=True)


@pytest.mark.parametrize("path", ["fused", "checkpoint"])
@pytest.mark.parametrize("chunk_size", [1, 5, 12, 16, 37, 64])  # 5, 16 leave a short last chunk
@pytest.mark.parametrize("bias", [False, True])
def test_cross_entropy_and_grads_match_unchunked(path, chunk_size, bias):
    hidden, head, labels = _tensor_case(bias)
    ref = F.cross_entropy(head(hidden).float(), labels, reduction="sum")
    ref.backward()
    ref_grads = _head_grads(hidden, head)
    _reset(hidden, head)
    # A module that is not exactly nn.Linear (here its bound forward) takes the checkpointed path.
    loss = chunked_cross_entropy(hidden, head if path == "fused" else head.forward, labels, chunk_size)
    (loss * 3.0).backward()  # a non-unit incoming gradient: the fused backward must scale by it
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    for got, want in zip(_head_grads(hidden, head), ref_grads, strict=True):
        torch.testing.assert_close(got, 3.0 * want, **TOL)


@pytest.mark.parametrize("chunk_size", [4, 37])
def test_token_logps_and_grads_match_unchunked(chunk_size):
    hidden, head, labels = _tensor_case(bias=False)
    weights = torch.randn(labels.shape)  # per-token upstream gradient, as a preference loss gives
    ref = torch.log_softmax(head(hidden).float(), -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    ref = ref * (labels != -100)
    (ref * weights).sum().backward()
    ref_grads = _head_grads(hidden, head)
    _reset(hidden, head)
    logps = chunked_token_logps(hidden, head, labels, chunk_size)
    (logps * weights).sum().backward()
    torch.testing.assert_close(logps, ref.detach(), **TOL)
    assert torch.all(logps[labels == -100] == 0)
    for got, want in zip(_head_grads(hidden, head), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_no_grad_computes_the_value_only():
    hidden, head, labels = _tensor_case(bias=False)
    ref = F.cross_entropy(head(hidden), labels, reduction="sum")
    with torch.no_grad():
        fused = chunked_cross_entropy(hidden, head, labels, 8)
        checkpointed = chunked_cross_entropy(hidden, head.forward, labels, 8)
    assert not fused.requires_grad and not checkpointed.requires_grad
    torch.testing.assert_close(fused, ref.detach(), **TOL)
    torch.testing.assert_close(checkpointed, ref.detach(), **TOL)


def test_frozen_head_gets_no_weight_gradient():
    hidden, head, labels = _tensor_case(bias=False)
    head.requires_grad_(False)
    chunked_cross_entropy(hidden, head, labels, 8).backward()
    assert head.weight.grad is None and hidden.grad is not None


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients():
    hidden, head, labels = _tensor_case(bias=True)
    labels = torch.full_like(labels, -100)
    for path_head in (head, head.forward):
        _reset(hidden, head)
        loss = chunked_cross_entropy(hidden, path_head, labels, 8)
        loss.backward()
        assert loss.item() == 0.0
        assert all(torch.all(g == 0) for g in _head_grads(hidden, head))


def test_bf16_autocast_is_as_accurate_as_unchunked():
    """Under CPU bf16 autocast the fused path computes in bf16 as F.linear would: its loss and gradients
    are no further from the fp32 values than the unchunked bf16 ones are (it sums d_weight in fp32)."""
    hidden, head, labels = _tensor_case(bias=False, num_tokens=64, hidden_size=32)

    def run(fn, autocast):
        _reset(hidden, head)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn()
        loss.backward()
        return [loss.detach(), *_head_grads(hidden, head)]

    def unchunked():
        return F.cross_entropy(head(hidden).float(), labels, reduction="sum")

    exact = run(unchunked, autocast=False)
    ref = run(unchunked, autocast=True)
    got = run(lambda: chunked_cross_entropy(hidden, head, labels, 16), autocast=True)
    for g, r, e in zip(got, ref, exact, strict=True):
        assert g.dtype == r.dtype == torch.float32
        assert (g - e).abs().max() <= 1.5 * (r - e).abs().max() + 1e-6


def test_bad_arguments_are_refused():
    hidden, head, labels = _tensor_case(bias=False)
    with pytest.raises(ValueError, match="positive"):
        chunked_cross_entropy(hidden, head, labels, 0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_cross_entropy(hidden, head, labels[:-1], 8)


# ------------------------------------------------------------------------------------- model level


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 8, 64])  # 64 >= every batch's token count: one chunk
def test_full_finetune_matches_model_loss(kind, tie, chunk_size):
    model = tiny_llama(tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    batch = BATCHES[kind]()
    # The window's count across processes: larger than this micro batch's own.
    num_items = trainable_count(batch) * 3
    ref_loss, ref_grads = model_reference(model, batch, num_items)
    loss, grads = model_chunked(model, batch, num_items, chunk_size)
    assert_same(loss, grads, ref_loss, ref_grads)


LORA_CASES = {
    # lm_head frozen and plain nn.Linear: the fused path, d_weight skipped
    "lora_attention": {"target_modules": ["q_proj", "v_proj"]},
    # lm_head is a PEFT LoRA layer: the checkpointed path
    "lora_on_lm_head": {"target_modules": ["q_proj", "lm_head"]},
    # lm_head trained whole through PEFT's ModulesToSaveWrapper: the checkpointed path
    "lm_head_to_save": {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
}


@pytest.mark.parametrize("case", list(LORA_CASES))
@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_peft_lora_matches_model_loss(case, kind):
    # init_lora_weights=False: lora_B is random too, so every LoRA weight has a nonzero gradient.
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **LORA_CASES[case])
    model = get_peft_model(tiny_llama(), config)
    batch = BATCHES[kind]()
    num_items = trainable_count(batch)
    ref_loss, ref_grads = model_reference(model, batch, num_items)
    loss, grads = model_chunked(model, batch, num_items, chunk_size=7)
    assert any("lm_head" in n for n in grads) == (case != "lora_attention")
    assert_same(loss, grads, ref_loss, ref_grads)


def test_peft_lora_on_tied_lm_head_matches_model_loss():
    """Tied embeddings with LoRA on lm_head, PEFT tying the adapter to the embeddings' too, and the
    tied weight itself trained (modules_to_save would untie it; requires_grad keeps it shared)."""
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["lm_head", "embed_tokens"],
        ensure_weight_tying=True,
    )  # fmt: skip
    model = get_peft_model(tiny_llama(tie=True), config)
    base = model.get_base_model()
    base.model.embed_tokens.base_layer.weight.requires_grad_(True)
    assert base.lm_head.base_layer.weight is base.model.embed_tokens.base_layer.weight
    batch = packed_batch()
    ref_loss, ref_grads = model_reference(model, batch, trainable_count(batch))
    loss, grads = model_chunked(model, batch, trainable_count(batch), chunk_size=5)
    assert any("embed_tokens.base_layer.weight" in n for n in grads)
    assert_same(loss, grads, ref_loss, ref_grads)


def test_with_activation_checkpointing_matches_model_loss():
    model = tiny_llama(tie=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = packed_batch()
    ref_loss, ref_grads = model_reference(model, batch, trainable_count(batch))
    loss, grads = model_chunked(model, batch, trainable_count(batch), chunk_size=5)
    assert_same(loss, grads, ref_loss, ref_grads)


def test_hidden_state_gradient_matches():
    """The gradient reaching the final hidden states (what the backbone receives) is the unchunked one."""
    model = tiny_llama()
    batch = packed_batch()
    captured = []

    def keep(module, args, out) -> None:
        out.retain_grad()
        captured.append(out)

    hook = model.model.norm.register_forward_hook(keep)
    model_reference(model, batch, 10)
    model_chunked(model, batch, 10, chunk_size=4)
    hook.remove()
    torch.testing.assert_close(captured[1].grad, captured[0].grad, **TOL)


def test_batch_with_no_label_gives_zero_loss_and_gradients():
    model = tiny_llama()
    batch = padded_batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    loss, grads = model_chunked(model, batch, num_items=1, chunk_size=4)
    assert loss.item() == 0.0 and all(torch.all(g == 0) for g in grads.values())


def test_token_logps_of_a_model_match_preference_token_logps():
    """causal_lm_token_logps == preference.token_logps(model logits, labels), values and gradients, so
    the preference objective can swap one for the other (LoRA on lm_head: the checkpointed path)."""
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["lm_head"]
    )  # fmt: skip
    model = get_peft_model(tiny_llama(), config)
    batch = packed_batch()
    weights = torch.randn(batch["labels"].shape)  # a per-token upstream gradient
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ref = token_logps(model(**inputs, use_cache=False).logits, batch["labels"])
    (ref * weights).sum().backward()
    ref_grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    logps = causal_lm_token_logps(model, batch, chunk_size=6)
    (logps * weights).sum().backward()
    torch.testing.assert_close(logps, ref.detach(), **TOL)
    assert torch.all(logps[:, 0] == 0) and torch.all(logps[batch["labels"] == -100] == 0)
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(grad, ref_grads[name], **TOL)


def test_moe_router_aux_loss_is_added_as_the_model_does():
    from transformers import MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    batch = padded_batch()
    ref_loss, ref_grads = model_reference(model, batch, trainable_count(batch))
    loss, grads = model_chunked(model, batch, trainable_count(batch), chunk_size=5)
    assert_same(loss, grads, ref_loss, ref_grads)


# -------------------------------------------------------------------------------------- wrappers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_matches_model_loss(find_unused):
    """Through DDP (a one-process gloo group). With find_unused_parameters DDP hands the output back
    through its own autograd node, not as the same tensor: the value check takes that path."""
    import torch.distributed as dist

    model = tiny_llama(tie=True)
    batch = packed_batch()
    ref_loss, ref_grads = model_reference(model, batch, trainable_count(batch))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    ddp = None
    try:
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
        for _ in range(2):  # the second call skips the (once per head) value check
            model.zero_grad(set_to_none=True)
            loss = causal_lm_loss(ddp, batch, num_items=trainable_count(batch), chunk_size=5)
            loss.backward()
            assert_same(loss.detach(), grads_of(model), ref_loss, ref_grads)
    finally:
        # The DDP wrapper (its reducer holds the gloo group) goes before the group: freed after it, the
        # group's destructor waits for worker threads of a store that is gone, and the test hangs.
        del ddp
        gc.collect()
        dist.destroy_process_group()


def test_torch_compile_traces_it_in_one_graph():
    """torch.compile (aot_eager: AOTAutograd without a C++ toolchain) traces the swapped head and the
    fused loss: one graph, no graph break, no recompile on later calls, the same loss and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    batch = packed_batch()
    ref_loss, ref_grads = model_reference(model, batch, trainable_count(batch))
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = causal_lm_loss(compiled, batch, num_items=trainable_count(batch), chunk_size=5)
        loss.backward()
        assert_same(loss.detach(), grads_of(model), ref_loss, ref_grads)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    torch._dynamo.reset()


def test_head_forward_is_restored():
    model = tiny_llama()
    batch = padded_batch()
    causal_lm_loss(model, batch, num_items=1, chunk_size=4)
    assert "forward" not in model.lm_head.__dict__
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert logits.shape[-1] == VOCAB


# -------------------------------------------------------------------------------------- refusals


def test_models_that_softcap_logits_are_refused():
    model = tiny_llama(final_logit_softcapping=30.0)  # what Gemma 2 configs carry
    with pytest.raises(FinetuneError, match=r"final_logit_softcapping.*loss_chunk_size: 0"):
        causal_lm_loss(model, padded_batch(), num_items=1, chunk_size=4)
    assert "forward" not in model.lm_head.__dict__


class ScaledLlama(nn.Module):
    """A model that scales its logits after the head without saying so in its config."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_llama()
        self.config = self.inner.config

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        return SimpleNamespace(logits=out.logits * 0.5)


def test_models_that_change_the_head_output_are_refused():
    with pytest.raises(FinetuneError, match="changes its logits after the output head"):
        causal_lm_loss(ScaledLlama(), padded_batch(), num_items=1, chunk_size=4)


# ------------------------------------------------------------------------------------------ memory


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _largest_tensors(fn) -> tuple[int, int]:
    """(largest tensor saved for backward, largest tensor any op makes) while running fn().backward()."""
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), LargestOutput() as mode:
        fn().backward()
    return max(saved, default=0), mode.numel


@pytest.mark.parametrize("path", ["fused", "checkpoint"])
def test_no_tensor_of_tokens_x_vocab_is_made(path):
    """A 32k vocabulary and 2048 tokens: every tensor made or saved in forward and backward stays at
    or under one chunk's logits (the head's weight and its gradient are vocab x hidden, smaller)."""
    num_tokens, hidden_size, vocab, chunk_size = 2048, 64, 32768, 256
    torch.manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (num_tokens,))
    project = head if path == "fused" else head.forward
    saved, made = _largest_tensors(lambda: chunked_cross_entropy(hidden, project, labels, chunk_size))
    assert made <= chunk_size * vocab < num_tokens * vocab
    assert saved <= chunk_size * vocab
    assert head.weight.grad is not None and hidden.grad is not None


def test_the_fused_path_holds_one_chunk_at_a_time():
    """fp32: one chunk's logits (their buffer becomes their gradient) plus logsumexp's temporary, and
    the gradients of hidden and weight. The previous chunk's gradient was kept alive while the next
    chunk's logits were made: a third chunk-sized buffer."""
    num_tokens, hidden_size, vocab, chunk_size = 1024, 16, 32768, 256
    torch.manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (num_tokens,))
    peak = peak_allocated_bytes(lambda: chunked_cross_entropy(hidden, head, labels, chunk_size).backward())
    held = 4 * (num_tokens * hidden_size + vocab * hidden_size)  # d_hidden, d_weight
    assert peak == pytest.approx(2 * 4 * chunk_size * vocab + held, rel=0.01)


def test_causal_lm_loss_never_makes_the_logits():
    """Through a whole model: no tensor made in forward or backward comes near [tokens x vocab]."""
    model = tiny_model(
        vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip
    ids = torch.randint(0, 4096, (1, 512))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(512)[None]}
    saved, made = _largest_tensors(lambda: causal_lm_loss(model, batch, num_items=511, chunk_size=64))
    assert max(saved, made) <= 64 * 4096  # the logits would be 8x that


def test_the_memory_probe_sees_unchunked_logits():
    """The probe above would catch the full logits (a smaller size keeps this cheap)."""
    hidden = torch.randn(256, 16, requires_grad=True)
    head = nn.Linear(16, 1024, bias=False)
    labels = torch.randint(0, 1024, (256,))
    saved, made = _largest_tensors(lambda: F.cross_entropy(head(hidden), labels, reduction="sum"))
    assert saved >= 256 * 1024 and made >= 256 * 1024


# ---------------------------------------------------------------------------------------- settings


def test_auto_chunk_rule():
    # Llama-3 vocabulary: a packed 8k row chunks; 2k tokens already make 1 GiB of fp32 logits.
    assert resolve_loss_chunk_size(None, vocab_size=128256, tokens_per_micro_batch=2048) == 512
    assert resolve_loss_chunk_size(None, vocab_size=128256, tokens_per_micro_batch=1024) == 0
    # Llama-2 vocabulary: from 8k tokens per micro batch.
    assert resolve_loss_chunk_size(None, vocab_size=32000, tokens_per_micro_batch=8192) == 2048
    assert resolve_loss_chunk_size(None, vocab_size=32000, tokens_per_micro_batch=4096) == 0
    assert (
        resolve_loss_chunk_size(300, vocab_size=32000, tokens_per_micro_batch=64) == 300
    )  # a set value is kept
    with pytest.raises(ValueError, match=">= 0"):
        resolve_loss_chunk_size(-1, vocab_size=32000, tokens_per_micro_batch=64)


def test_chunking_a_copy_leaves_the_original_alone():
    """deepcopy (e.g. a frozen reference model for preference training) keeps working after a call."""
    model = tiny_llama()
    causal_lm_loss(model, padded_batch(), num_items=1, chunk_size=4)
    clone = copy.deepcopy(model)
    assert "forward" not in clone.lm_head.__dict__


# ---------------------------------------------------------------------- Liger on CUDA, chosen here


@pytest.mark.parametrize(
    ("device", "installed", "head", "expected"),
    [
        ("cuda", True, "linear", "liger"),  # CUDA + liger-kernel: Liger, no recipe flag
        ("cuda", False, "linear", "fused"),  # not installed: ours
        ("cpu", True, "linear", "fused"),  # CPU never picks Liger, installed or not
        ("cpu", False, "linear", "fused"),
        ("cuda", True, "lora", "checkpointed"),  # heads Liger cannot fuse keep the checkpointed path
        ("cpu", True, "lora", "checkpointed"),
    ],
)
def test_the_fused_linear_backend_is_liger_only_on_cuda_when_installed(
    monkeypatch, device, installed, head, expected
):
    from finetune.losses import chunked_ce

    monkeypatch.setattr(chunked_ce, "liger_available", lambda: installed)
    module = nn.Linear(8, VOCAB, bias=False)
    if head == "lora":
        wrapped = get_peft_model(nn.Sequential(module), LoraConfig(r=2, target_modules=["0"]))
        module = wrapped.base_model.model[0]  # PEFT's LoRA Linear, not an nn.Linear
    assert chunked_ce.fused_linear_backend(module, torch.device(device)) == expected


def test_a_cpu_run_never_calls_liger_even_when_installed(monkeypatch):
    from finetune.losses import chunked_ce

    monkeypatch.setattr(chunked_ce, "liger_available", lambda: True)
    monkeypatch.setattr(chunked_ce, "_liger_cross_entropy", lambda *a: pytest.fail("Liger on CPU"))
    head, hidden = nn.Linear(8, VOCAB), torch.randn(2, 5, 8)
    labels = torch.randint(0, VOCAB, (2, 5))
    expected = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(chunked_cross_entropy(hidden, head, labels, 4), expected, **TOL)


def test_where_liger_is_chosen_its_function_gets_the_flat_tokens_and_sums(monkeypatch):
    """Liger itself needs CUDA and Triton (the gpu test below); here its functional is a stand-in
    with the same signature, and the backend is pinned to liger as on CUDA."""
    import sys
    import types

    from finetune.losses import chunked_ce

    calls = []

    def liger_fused_linear_cross_entropy(
        input, weight, target, bias=None, ignore_index=-100, reduction="mean"
    ):
        calls.append((tuple(input.shape), tuple(target.shape), ignore_index, reduction))
        logits = F.linear(input, weight, bias).float()
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    monkeypatch.setattr(chunked_ce, "fused_linear_backend", lambda head, device: "liger")
    head, hidden = nn.Linear(8, VOCAB), torch.randn(2, 5, 8, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 5))
    labels[0, :2] = -100
    loss = chunked_cross_entropy(hidden, head, labels, 4)
    expected = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(loss, expected, **TOL)
    assert calls == [((10, 8), (10,), -100, "sum")]
    loss.backward()  # gradients flow back through the casts to the head and the hidden states
    assert head.weight.grad is not None and hidden.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_liger_on_cuda_matches_the_unchunked_loss_and_gradients():
    pytest.importorskip("liger_kernel", reason="liger-kernel is the liger extra")
    from finetune.losses import chunked_ce

    torch.manual_seed(0)
    head = nn.Linear(64, 1000, bias=False).cuda()
    hidden = torch.randn(2, 128, 64, device="cuda", requires_grad=True)
    labels = torch.randint(0, 1000, (2, 128), device="cuda")
    labels[:, :7] = -100
    assert chunked_ce.fused_linear_backend(head, hidden.device) == "liger"
    loss = chunked_cross_entropy(hidden, head, labels, 64)
    loss.backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    expected = F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten(), reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(grads[1], head.weight.grad, rtol=1e-3, atol=1e-4)
