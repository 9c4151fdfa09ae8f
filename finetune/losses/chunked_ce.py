"""Chunked linear cross-entropy: the loss of a causal LM without its [tokens x vocab] logits.

A Llama-3 head (128k vocabulary) turns a packed row of 8192 tokens into 4 GiB of fp32 logits, and
their gradient is as large again. Here the hidden states are projected `chunk_size` tokens at a
time and each chunk's logits are dropped before the next is made, in forward and in backward.

Three ways through, picked by `fused_linear_backend` (measurements: benchmarks/RESULTS.md, chunked-ce):
- a plain `nn.Linear` on CUDA with liger-kernel installed: Liger's own fused linear cross-entropy
  (Triton; on an H100 1.02x the unchunked time against 1.46x for the chunks below). No recipe flag:
  installing liger-kernel is the switch. Liger picks its own chunking.
- a plain `nn.Linear` (its weight possibly tied to the embeddings): a fused autograd.Function, as in
  Liger's fused linear cross-entropy. The forward computes each chunk's loss *and* its gradients
  with respect to hidden states, weight and bias; backward only scales them by the incoming scalar.
  Three head matmuls per chunk, the same count as the unchunked loss, and nothing recomputed.
- any other head (PEFT LoRA on lm_head, modules_to_save, a quantized layer): called as a black box
  per chunk under `torch.utils.checkpoint`, so backward recomputes one chunk's logits at a time.
  One head matmul more than the fused path; works for whatever the module computes.

`causal_lm_loss` gets the last hidden states from a model however it is wrapped by replacing the
forward of its output head, for the length of one call, with one that computes the loss: the
model's own forward runs unchanged, calls its head once (inside that module's call, so ZeRO-3 and
FSDP2 have gathered its weight), and hands back the loss sum where the logits would be. The loss is
thus an output of the wrapped forward, which is what DDP (find_unused_parameters) and FSDP2's
backward hooks expect, and torch.compile traces it with the rest (one graph, no recompile). Tested:
PEFT, DDP, DeepSpeed ZeRO-3, torch.compile (aot_eager). FSDP2 rests on the same argument but needs
GPUs to test. The alternatives were weaker: calling the inner model skips DDP's and FSDP2's
forward hooks; output_hidden_states plus a loss computed outside the forward reads the head's
weight where ZeRO-3 has it partitioned. Models that transform the logits after the head (Gemma 2
soft-capping, Cohere and Granite scaling) would transform the loss instead: they are refused.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from finetune.constants import IGNORE_INDEX
from finetune.errors import FinetuneError

# One chunk's fp32 logits are kept under this many elements (256 MiB): see default_chunk_size.
CHUNK_LOGITS_BUDGET = 1 << 26
# auto (train.loss_chunk_size: null) chunks when a micro batch's fp32 logits reach this many elements (1 GB;
# the unchunked loss then peaks at 3 GB: the fp32 log-softmax and two gradients of its size).
AUTO_CHUNK_MIN_LOGITS = 250_000_000

# Config fields of models whose forward changes the logits after the head, with the value that means
# "unchanged". The head-swap would apply the change to the loss, so those models are refused.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2/3/3n/4: cap * tanh(logits / cap)
    "logit_scale": 1.0,  # Cohere: logits * logit_scale
    "logits_scaling": 1.0,  # Granite: logits / logits_scaling
}
# Heads whose model was seen handing back exactly what the swapped head returned (checked once each).
_VERIFIED_HEADS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


# ------------------------------------------------------------------------------ tensor-level API


def next_token_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Labels aligned with the positions that predict them (the shift transformers' causal-LM loss makes).

    Position t is scored against labels[t + 1]; the last position of a row against nothing. In packed
    rows each sequence's first label is already ignore_index, so no position predicts across sequences.

    >>> next_token_labels(torch.tensor([[-100, 5, 6]])).tolist()
    [[5, 6, -100]]
    """
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_size: int,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over positions of cross_entropy(head(hidden), labels), `chunk_size` positions at a time.

    hidden: [..., hidden_size] final hidden states (after the final norm). labels: [...] the target of
    each position, already shifted (`next_token_labels`), ignore_index where there is none. head: an
    `nn.Linear` (fused path) or any module or callable mapping [n, hidden_size] to [n, vocab]
    (checkpointed path). Logits are upcast to fp32 as transformers does. Returns a 0-d fp32 sum, so
    the caller picks the normaliser (the window's trainable-token count across processes).

    Memory: a few [chunk_size x vocab] fp32 buffers at a time, in forward and in backward. The fused
    path holds the gradients of hidden and weight from forward to backward (the weight's the size of
    its .grad; none when the weight is frozen).
    """
    flat_hidden, flat_labels = _flatten(hidden, labels, chunk_size)
    backend = fused_linear_backend(head, flat_hidden.device)
    if backend == "liger":
        return _liger_cross_entropy(flat_hidden, head, flat_labels, ignore_index)
    if backend == "fused":
        compute_grads = torch.is_grad_enabled()  # Function.forward runs with grad mode off
        return _FusedLinearCrossEntropy.apply(
            flat_hidden, head.weight, head.bias, flat_labels, chunk_size, ignore_index, compute_grads
        )
    sums = _map_chunks(_chunk_cross_entropy, head, flat_hidden, flat_labels, chunk_size, ignore_index)
    return torch.stack(sums).sum()


def fused_linear_backend(head, device: torch.device) -> str:
    """How `chunked_cross_entropy` computes the loss of `head` on `device`: "liger" (Liger's fused
    linear cross-entropy: a plain Linear on CUDA with liger-kernel installed), "fused" (this module's
    fused Function: a plain Linear elsewhere, CPUs included) or "checkpointed" (any other head: LoRA on
    lm_head, modules_to_save, a quantized layer, which neither fused path can take).

    >>> fused_linear_backend(nn.Linear(4, 8), torch.device("cpu")), fused_linear_backend(nn.Identity(), torch.device("cpu"))
    ('fused', 'checkpointed')
    """
    if type(head) is not nn.Linear:  # exactly Linear: subclasses (bitsandbytes 4-bit) do more in forward
        return "checkpointed"
    if device.type == "cuda" and liger_available():
        return "liger"
    return "fused"


@functools.cache
def liger_available() -> bool:
    """Whether liger-kernel is installed (looked up once; it needs Triton and CUDA to run)."""
    return importlib.util.find_spec("liger_kernel") is not None


def _liger_cross_entropy(hidden, head: nn.Linear, labels, ignore_index) -> torch.Tensor:
    """Liger's fused linear cross-entropy, summed (fp32 0-d), as the fused path returns it."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # Liger's kernels take one dtype: cast as autocast would (a copy of the weight when it is cast, as
    # in the fused path; autograd casts its gradient back).
    dtype = _matmul_dtype(hidden)
    weight, bias = head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)
    loss = liger_fused_linear_cross_entropy(
        hidden.to(dtype), weight, labels, bias=bias, ignore_index=ignore_index, reduction="sum"
    )
    return loss.float()


def chunked_token_logps(
    hidden: torch.Tensor,
    head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_size: int,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """log softmax(head(hidden))[label] for every position, `chunk_size` positions at a time (fp32).

    Shapes as in `chunked_cross_entropy`; returns labels' shape, 0 where the label is ignore_index,
    differentiable with respect to hidden and the head's parameters (what preference objectives
    sum per sequence). Every head goes through the checkpointed path: a per-token gradient cannot be
    precomputed in forward as the fused loss does. Memory: a few [chunk_size x vocab] fp32 buffers.
    """
    flat_hidden, flat_labels = _flatten(hidden, labels, chunk_size)
    logps = _map_chunks(_chunk_token_logps, head, flat_hidden, flat_labels, chunk_size, ignore_index)
    return torch.cat(logps).view(labels.shape)


def _flatten(
    hidden: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on positions"
        )
    # reshape is a view for the contiguous output of a final norm: no copy of the hidden states.
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)


def _map_chunks(fn, head, hidden, labels, chunk_size, ignore_index) -> list[torch.Tensor]:
    """fn(head, hidden_chunk, label_chunk, ignore_index) for each chunk, checkpointed when grads are on.

    The non-reentrant checkpoint keeps only the chunk's inputs (views of `hidden`, which the model keeps
    anyway) and recomputes the chunk's logits in backward, one chunk at a time. It restores the RNG
    state for the recompute, so a head with dropout (LoRA dropout) sees the same mask twice.
    `split` gives one backward node that concatenates the chunk gradients once, rather than a
    full-size zero-filled gradient per slice.
    """
    pairs = zip(hidden.split(chunk_size), labels.split(chunk_size), strict=True)
    if not torch.is_grad_enabled():
        return [fn(head, h, y, ignore_index) for h, y in pairs]
    return [checkpoint(fn, head, h, y, ignore_index, use_reentrant=False) for h, y in pairs]


def _chunk_cross_entropy(head, hidden, labels, ignore_index) -> torch.Tensor:
    logits = head(hidden).float()  # memory: [chunk x vocab] fp32, freed when the chunk is done
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def _chunk_token_logps(head, hidden, labels, ignore_index) -> torch.Tensor:
    logits = head(hidden).float()  # memory: [chunk x vocab] fp32, freed when the chunk is done
    # -CE is the label's log-probability, and exactly 0 at ignored positions.
    return -F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss sum of a linear head and, in the same pass over the chunks, its gradients.

    d(sum CE)/d(logits) is softmax - onehot on each position with a label (0 elsewhere): it is known
    as soon as a chunk's logits are, so d_hidden, d_weight and d_bias are accumulated right away and
    the chunk's logits dropped. backward only multiplies them by the incoming scalar gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, ignore_index, compute_grads):
        needs = [compute_grads and need for need in ctx.needs_input_grad[:3]]
        dtype = _matmul_dtype(hidden)
        ctx.grad_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        # Autocast off: the casts are explicit so the fused matmuls run in the dtype autocast would pick.
        with torch.autocast(hidden.device.type, enabled=False):
            # memory: a [vocab x hidden] copy of the weight when it is cast (autocast would make it too)
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            grads = _empty_grads(hidden, weight, bias, needs)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_size):
                h = hidden[start : start + chunk_size].to(dtype)
                y = labels[start : start + chunk_size]
                chunk_loss, d_logits = _loss_and_logit_grad(h, w, b, y, ignore_index, any(needs))
                loss += chunk_loss
                if d_logits is not None:
                    _accumulate(grads, d_logits, h, w, start)
                # memory: freed now, not when the next chunk's result replaces it (one chunk buffer less)
                del d_logits
        ctx.grads = grads
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None  # drop ctx's reference so autograd can adopt the tensors
        scaled = [
            None if g is None else g.mul_(grad_loss).to(t)
            for g, t in zip(grads, ctx.grad_dtypes, strict=True)
        ]
        return (*scaled, None, None, None, None)


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype F.linear computes in here: autocast's when it is on for this device, else hidden's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _empty_grads(hidden, weight, bias, needs) -> list[torch.Tensor | None]:
    """Gradient buffers: d_hidden in hidden's dtype (filled chunk by chunk); d_weight and d_bias in fp32,
    accumulated over chunks (memory: [vocab x hidden] fp32 when the head is trained)."""
    need_h, need_w, need_b = needs
    return [
        torch.empty_like(hidden) if need_h else None,
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None,
        torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None,
    ]


def _loss_and_logit_grad(h, w, b, labels, ignore_index, with_grad):
    """(sum of the chunk's token losses, d loss / d logits in the matmul dtype or None)."""
    logits = F.linear(h, w, b).float()  # memory: [chunk x vocab] fp32, reused in place for its gradient
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if not with_grad:
        return loss, None
    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits buffer
    probs.scatter_add_(1, target[:, None], -valid[:, None].to(probs.dtype))  # - onehot on labelled rows
    return loss, probs.mul_(valid[:, None]).to(h.dtype)  # rows without a label get no gradient


def _accumulate(grads, d_logits, h, w, start) -> None:
    d_hidden, d_weight, d_bias = grads
    if d_hidden is not None:
        d_hidden[start : start + h.shape[0]] = d_logits @ w
    if d_weight is not None:
        if d_logits.dtype == torch.float32:
            d_weight.addmm_(d_logits.t(), h)
        else:  # memory: a [vocab x hidden] 16-bit product, summed into the fp32 buffer
            d_weight += d_logits.t() @ h
    if d_bias is not None:
        d_bias += d_logits.sum(0)


# ------------------------------------------------------------------------------- model-level API


def causal_lm_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], *, num_items: torch.Tensor | int, chunk_size: int
) -> torch.Tensor:
    """`model(**batch, use_cache=False, num_items_in_batch=num_items).loss`, with chunked logits.

    Same value and gradients (up to float summation order): the sum of the token cross-entropies of
    the shifted labels (-100 ignored) divided by num_items, plus the router auxiliary loss of MoE
    models that return one. `model` may be wrapped by PEFT, Accelerate (DDP, DeepSpeed, FSDP2) or
    torch.compile; the batch is packed (position_ids) or padded (attention_mask), as the collator
    makes it. Raises FinetuneError for models that transform their logits after the head.
    """
    total, out = _forward_through_head(model, batch, chunked_cross_entropy, chunk_size)
    if torch.is_tensor(num_items):
        num_items = num_items.to(total.device)
    return total / num_items + _router_aux_loss(model, out)


def causal_lm_token_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], *, chunk_size: int
) -> torch.Tensor:
    """Log-probability of each label under `model`, aligned with `batch["labels"]`: [batch, seq] fp32.

    Entry t is log p(labels[t] | tokens < t), 0 at t = 0 and wherever the label is -100: the layout of
    `finetune.losses.preference.token_logps(model(...).logits, labels)`, which this replaces without
    the logits. With gradient unless called under no_grad. Wrappers and refusals as in
    `causal_lm_loss`; MoE router losses are not added.
    """
    # Entry t scores labels[t + 1].
    next_logps = _forward_through_head(model, batch, chunked_token_logps, chunk_size)[0]
    return F.pad(next_logps[..., :-1], (1, 0))


def _forward_through_head(model, batch, chunked, chunk_size) -> tuple[torch.Tensor, Any]:
    """Run `model` on `batch` less its labels, with its output head computing
    `chunked(hidden, head, next_token_labels(labels), chunk_size)` instead of logits.

    Returns (the head's result as the model handed it back, the model output). The head argument is
    the module itself for a plain Linear (the fused path reads its weight inside the head's call) and
    the head's original forward otherwise (the swapped one would recurse).
    """
    # A shard of a row (sequence, context parallel) brings its labels already shifted.
    labels = batch["shift_labels"] if "shift_labels" in batch else next_token_labels(batch["labels"])
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    base = _unwrap(model)
    _refuse_logit_transforms(base.config)
    head = base.get_output_embeddings()
    if head is None:
        raise FinetuneError(f"{type(base).__name__} has no output embeddings: set train.loss_chunk_size: 0")
    head_arg = head if type(head) is nn.Linear else head.forward
    produced: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        produced.append(chunked(hidden, head_arg, labels, chunk_size))
        return produced[-1]

    with _forward_replaced(head, forward):
        out = model(**inputs, use_cache=False)
    return _check_handed_back(out.logits, produced, head, base), out


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers (or PEFT) model inside DDP, DeepSpeed and torch.compile wrappers.

    PEFT needs no unwrapping: PeftModel passes attribute lookups (config, get_output_embeddings)
    through to the transformers model. FSDP2 shards modules in place.
    """
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward: Callable) -> Iterator[None]:
    """`module.forward` is `forward` inside the block; whatever it was (often a class method) after.

    Only the instance attribute changes: hooks (ZeRO-3 and FSDP2 gathering, Accelerate device
    placement) still run around the call, and they see a module call like any other.
    """
    own = module.__dict__.get("forward")  # Accelerate's big-model hooks set an instance forward
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _check_handed_back(
    returned: torch.Tensor, produced: list, head: nn.Module, base: nn.Module
) -> torch.Tensor:
    """`returned` (out.logits), after checking that it is what the swapped head produced.

    DDP (find_unused_parameters) and torch.compile hand back an equal tensor, not the same object: the
    values are compared once per head. That comparison is a host-device sync point (first call only).
    """
    name = type(base).__name__
    if len(produced) != 1:
        raise FinetuneError(
            f"{name} called its output head {len(produced)} times in one forward (expected once): "
            "chunked loss cannot be used with it; set train.loss_chunk_size: 0"
        )
    if returned is produced[0] or head in _VERIFIED_HEADS:
        return returned
    if returned.shape != produced[0].shape or not torch.equal(returned, produced[0]):
        raise FinetuneError(
            f"{name} changes its logits after the output head (scaling, soft-capping or slicing): chunked "
            "loss cannot reproduce that; set train.loss_chunk_size: 0"
        )
    _VERIFIED_HEADS.add(head)
    return returned


def _refuse_logit_transforms(config) -> None:
    """Refuse, before any compute, models whose config says they transform logits after the head."""
    configs = {id(c): c for c in (config, config.get_text_config())}.values()
    for cfg in configs:
        for field, identity in _LOGIT_TRANSFORMS.items():
            value = getattr(cfg, field, identity)
            if value is not None and value != identity:
                raise FinetuneError(
                    f"{type(cfg).__name__}.{field} = {value}: the model transforms its logits after the "
                    "output head, which chunked loss does not reproduce; set train.loss_chunk_size: 0"
                )


def _router_aux_loss(model: nn.Module, out) -> torch.Tensor | float:
    """What transformers' MoE models add to their loss when given labels: coef * out.aux_loss."""
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return 0.0
    coef = getattr(_unwrap(model), "router_aux_loss_coef", None)
    if coef is None:
        raise FinetuneError(
            f"{type(_unwrap(model)).__name__} returns a router aux_loss but no router_aux_loss_coef to weigh "
            "it with: set train.loss_chunk_size: 0"
        )
    return coef * aux


# ------------------------------------------------------------------------------------- settings


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit CHUNK_LOGITS_BUDGET (256 MiB),
    between 128 and 4096 tokens.

    >>> default_chunk_size(128256), default_chunk_size(32000), default_chunk_size(151936)
    (512, 2048, 256)
    """
    tokens = max(CHUNK_LOGITS_BUDGET // vocab_size, 1)
    return min(max(1 << (tokens.bit_length() - 1), 128), 4096)


def resolve_loss_chunk_size(
    loss_chunk_size: int | None, *, vocab_size: int, tokens_per_micro_batch: int
) -> int:
    """train.loss_chunk_size as the loop uses it: 0 computes the full logits, n > 0 chunks n tokens.

    A set value is kept. null (auto) chunks, with `default_chunk_size`, when one micro batch's fp32
    logits would reach AUTO_CHUNK_MIN_LOGITS elements (1 GB; the unchunked loss holds three such
    tensors at its peak). Below that the saving is small next to weights and optimizer state, and a
    head that is not a plain Linear (LoRA on lm_head) would pay for its recompute.

    >>> resolve_loss_chunk_size(None, vocab_size=128256, tokens_per_micro_batch=8192)
    512
    >>> resolve_loss_chunk_size(None, vocab_size=32000, tokens_per_micro_batch=2048)
    0
    >>> resolve_loss_chunk_size(0, vocab_size=128256, tokens_per_micro_batch=8192)
    0
    """
    if loss_chunk_size is not None:
        if loss_chunk_size < 0:
            raise ValueError(f"loss_chunk_size must be >= 0 (0 = off), got {loss_chunk_size}")
        return loss_chunk_size
    if vocab_size * tokens_per_micro_batch < AUTO_CHUNK_MIN_LOGITS:
        return 0
    return default_chunk_size(vocab_size)
