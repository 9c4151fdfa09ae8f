"""Packed rows must not leak attention across sequences: loss and gradients of a packed row equal
those of the same sequences run one by one (DESIGN.md invariant). Also right-padded batches with an
attention mask equal the unpadded sequences."""

from __future__ import annotations

import pytest
import torch

from finetune.data.batching.collate import collate_rows
from finetune.losses.causal_lm import forward
from tests.tiny import sequences, tiny_model

ATTN = ["eager", "sdpa"]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def loss_and_grads(model, batch: dict, num_items: int) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = forward(model, batch, num_items=torch.tensor(num_items))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference(model, seqs: list[dict]) -> tuple[torch.Tensor, dict]:
    """Each sequence alone, token losses summed and divided by the total trainable count."""
    total = _trainable(seqs)
    loss_sum, grads = torch.zeros(()), None
    for s in seqs:
        n = len(s["input_ids"])
        batch = collate_rows([s], pad_token_id=0, packed=False)
        batch["position_ids"] = torch.arange(n)[None]
        loss, g = loss_and_grads(model, batch, total)
        loss_sum += loss
        grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
    return loss_sum, grads


def _trainable(seqs) -> int:
    return sum(sum(1 for t in s["labels"][1:] if t != -100) for s in seqs)


def assert_same_as_one_by_one(model, seqs: list[dict], batch: dict) -> None:
    """The batch of `seqs` gives the loss and gradients of the sequences run one by one (fp32)."""
    ref_loss, ref_grads = reference(model, seqs)
    loss, grads = loss_and_grads(model, batch, _trainable(seqs))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def pack(seqs: list[dict], pad_to: int) -> dict:
    ids, labels, pos = [], [], []
    for s in seqs:
        ids += s["input_ids"]
        labels += s["labels"]
        pos += list(range(len(s["input_ids"])))
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


@pytest.mark.parametrize("attn", ATTN)
def test_packed_row_equals_sequences_one_by_one(attn):
    seqs = sequences()
    batch = collate_rows([pack(seqs, 8)], pad_token_id=0, pad_to_multiple_of=16, packed=True)
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape[1] % 16 == 0  # padding present: it forms its own segment
    assert_same_as_one_by_one(tiny_model(attn), seqs, batch)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packing_without_position_ids_would_leak(attn):
    """Control: the same row with plain 0..n-1 positions gives a different loss, so the test above
    can detect leakage."""
    model = tiny_model(attn)
    seqs = sequences()
    ref_loss, _ = reference(model, seqs)
    row = pack(seqs, 8)
    row["position_ids"] = list(range(len(row["input_ids"])))
    batch = collate_rows([row], pad_token_id=0, packed=True)
    loss, _ = loss_and_grads(model, batch, _trainable(seqs))
    assert not torch.allclose(loss, ref_loss, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_two_packed_rows_in_one_batch(attn):
    seqs = sequences()
    rows = [pack(seqs[:2], 8), pack(seqs[2:], 8)]
    batch = collate_rows(rows, pad_token_id=0, pad_to_multiple_of=8, packed=True)
    assert_same_as_one_by_one(tiny_model(attn), seqs, batch)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padded_unpacked_batch_equals_sequences(attn):
    seqs = sequences()
    batch = collate_rows(seqs, pad_token_id=0, pad_to_multiple_of=8, packed=False)
    assert batch["attention_mask"].sum() == sum(len(s["input_ids"]) for s in seqs)
    assert_same_as_one_by_one(tiny_model(attn), seqs, batch)


@pytest.mark.slow  # inductor compiles flex attention: it runs g++ and its compile workers
def test_flex_attention_packed_forward_matches_on_cpu():
    """FlexAttention has no backward on CPU (torch raises), so on CPU we check the packed loss only;
    the gradient check runs on GPU below. The sequences one by one run on the same weights with sdpa
    (a lone sequence has nothing to leak into): flex compiles a kernel per shape on CPU (~10 s each on
    2 cores), so only the packed row goes through it."""
    model, alone = tiny_model("flex_attention"), tiny_model("sdpa")
    seqs = sequences()
    with torch.no_grad():
        total = _trainable(seqs)
        ref = sum(
            forward(alone, collate_rows([s], pad_token_id=0, packed=True), num_items=torch.tensor(total)).loss
            for s in seqs
        )
        batch = collate_rows([pack(seqs, 8)], pad_token_id=0, pad_to_multiple_of=16, packed=True)
        loss = forward(model, batch, num_items=torch.tensor(total)).loss
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def _to(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention", "flash_attention_2"])
def test_packed_row_equals_sequences_on_gpu(attn):
    """On CUDA: loss AND gradients of a packed row equal the sequences run one by one (flex_attention's
    backward exists only here). fp32 for sdpa/flex so the comparison can be tight; flash-attn
    computes in 16 bits only, so bf16 with a looser tolerance."""
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    model = tiny_model(attn).cuda().to(dtype)
    seqs = sequences()
    total = _trainable(seqs)
    model.zero_grad(set_to_none=True)
    ref = torch.zeros((), device="cuda")
    for s in seqs:
        batch = collate_rows([s], pad_token_id=0, packed=True)
        loss = forward(model, _to(batch, "cuda"), num_items=torch.tensor(total, device="cuda")).loss
        loss.backward()  # gradients accumulate over the sequences
        ref += loss.detach().float()
    ref_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    batch = collate_rows([pack(seqs, 8)], pad_token_id=0, pad_to_multiple_of=16, packed=True)
    loss = forward(model, _to(batch, "cuda"), num_items=torch.tensor(total, device="cuda")).loss
    loss.backward()
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(loss.float(), ref, **tol)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.float(), ref_grads[name], **tol, msg=name)
