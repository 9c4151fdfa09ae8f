"""Preference-tuning losses (DPO, IPO, SimPO, ORPO, KTO) on per-sequence log-probabilities.

Three steps, each a pure function of tensors:

1. `token_logps(logits, labels)`: log p(labels[t] | tokens before t) for every position, aligned
   with `labels` (the Hugging Face convention: labels are not pre-shifted), 0 where the label is
   -100 and at t = 0. Computed as logit[label] - logsumexp(logits) in chunks of rows, so no
   [tokens x vocab] float32 log-softmax is kept for backward (bf16 logits stay bf16).
2. `sequence_sums(values, mask, position_ids)`: per-sequence sums of those values and counts of the
   tokens in `mask`, for padded batches (one sequence per row, `position_ids=None`) and for packed
   rows (sequences start where `position_ids` is 0, the convention of `finetune.data.batching.packing` and
   `finetune.data.batching.collate`). The first token of every sequence is never counted: nothing in the
   sequence predicts it (in a packed row the model's prediction there comes from the previous
   sequence). Sequences come back row-major, left to right.
3. A loss on those sums. "logps" arguments are per-sequence SUMS of token log-probabilities over
   the completion (`labels != -100`); the losses that length-normalise (IPO, SimPO, ORPO) also take
   the token counts from `sequence_sums` and divide themselves. Pairs are positionally aligned:
   `chosen[i]` and `rejected[i]` belong to pair i. With packed rows laid out chosen_0, rejected_0,
   chosen_1, ... take `sums[0::2]` and `sums[1::2]`; with TRL's padded layout (all chosen rows,
   then all rejected rows) take `sums.chunk(2)`.

Normalisation: every loss returns one value per pair (KTO: per example) in
`PreferenceLoss.losses`, not a mean. The training loop sums them over an accumulation window on all
processes and divides by the number of pairs (examples) in that window, as SFT divides by trainable
tokens. For a window of one micro-batch on one process that is `losses.mean()`, which is exactly
TRL's loss. Two terms are batch-level in TRL and stay so here: ORPO's NLL term with
`nll_reduction="batch"` (a token mean over the batch's chosen sequences, repeated on every pair so
that the mean over pairs gives TRL's value) and KTO's KL reference point (one detached scalar per
batch, see `kto_reference_point`).

TRL's names map as: DPOTrainer loss_type "sigmoid" -> `dpo_loss`; "robust" ->
`dpo_loss(..., label_smoothing=e, smoothing="robust")`; "ipo" -> `ipo_loss`; CPOTrainer
loss_type "simpo" with cpo_alpha=0 -> `simpo_loss`; ORPOTrainer -> `orpo_loss`; KTOTrainer
loss_type "kto" -> `kto_loss`. TRL's `beta` keeps its name everywhere (IPO's tau, ORPO's lambda).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from finetune.constants import IGNORE_INDEX
from finetune.errors import FinetuneError

# Rows of logits upcast to float32 at a time: 2**25 elements is 128 MiB of float32, whatever the vocab.
_CHUNK_ELEMENTS = 2**25

Smoothing = Literal["conservative", "robust"]


@dataclass(frozen=True)
class PreferenceLoss:
    """What a preference loss returns: per-pair (KTO: per-example) losses and what TRL logs.

    `losses` carries the gradient. The rest is detached: `chosen_rewards` / `rejected_rewards` are
    the implicit rewards (beta times the log-ratio, or times the length-averaged log-prob for the
    reference-free losses), `chosen_logps` / `rejected_logps` the policy log-probs the loss used
    (sums for DPO/IPO/KTO, per-token means for SimPO/ORPO, as TRL logs them). For KTO (`paired` is
    False) "chosen" means the desirable examples and "rejected" the undesirable ones, so the two
    can differ in length.
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    paired: bool = True


# ------------------------------------------------------------------------------ token log-probs


class _LabelLogProb(torch.autograd.Function):
    """log_softmax(logits)[label] for [N, V] logits, 0 where the label is -100.

    A Function rather than `logits.float().log_softmax(-1).gather(...)` so that autograd keeps only
    the logits (already alive as the model's output) and one float per row (the logsumexp), not a
    float32 [N, V] copy; the softmax is recomputed in chunks in backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        valid = target != IGNORE_INDEX
        index = torch.where(valid, target, 0)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for rows in _row_chunks(logits):
            lse[rows] = torch.logsumexp(logits[rows].to(dtype), dim=-1)
        picked = logits.gather(1, index[:, None]).squeeze(1).to(dtype)
        ctx.save_for_backward(logits, index, valid, lse)
        return torch.where(valid, picked - lse, 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, index, valid, lse = ctx.saved_tensors
        grad = torch.where(valid, grad_out, 0.0).to(lse.dtype)
        grad_logits = torch.empty_like(logits)
        for rows in _row_chunks(logits):
            # d(logit[label] - lse)/d(logits) = onehot(label) - softmax(logits)
            chunk = torch.exp(logits[rows].to(lse.dtype) - lse[rows, None]).mul_(-grad[rows, None])
            chunk.scatter_add_(1, index[rows, None], grad[rows, None])
            grad_logits[rows] = chunk
        return grad_logits, None


def _row_chunks(logits: torch.Tensor) -> list[slice]:
    rows = max(1, _CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


def label_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] of each row of `logits` (N x V) and its label (N), in float32 (float64 for
    float64 logits), without keeping a log-softmax copy of the logits for backward (`_LabelLogProb`).

    >>> label_logps(torch.zeros(2, 4), torch.tensor([0, 3])).exp()
    tensor([0.2500, 0.2500])
    """
    return _LabelLogProb.apply(logits, labels)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the causal LM's logits, aligned with `labels`.

    `logits` is [..., T, V] (position t predicts token t+1), `labels` is [..., T] with -100 where
    nothing is scored. Returns [..., T] in float32 (float64 for float64 logits): entry t is
    log p(labels[t] | tokens < t), 0 at t = 0 and wherever the label is -100.

    >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
    >>> token_logps(logits, torch.tensor([[-100, 2, 1]])).exp()
    tensor([[1.0000, 0.2500, 0.2500]])
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    # Shift the labels rather than slicing logits[..., :-1, :]: that view is not contiguous across
    # rows and flattening it would copy all the logits.
    target = torch.full_like(labels, IGNORE_INDEX)
    target[..., :-1] = labels[..., 1:]
    vocab = logits.shape[-1]
    next_logps = _LabelLogProb.apply(logits.reshape(-1, vocab), target.reshape(-1)).view(labels.shape)
    return F.pad(next_logps[..., :-1], (1, 0))


# ------------------------------------------------------------------------------ sequence sums


def sequence_sums(
    values: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of `values` over the tokens in `mask`, and the count of those tokens.

    `values`, `mask` (bool, usually `labels != -100`) and `position_ids` are [B, T].

    * `position_ids=None`: one sequence per row (a right-padded batch); returns [B] sums and counts.
    * `position_ids` given: a sequence starts at every 0 in `position_ids` (and at the start of
      every row), the packing convention. Segments with no token in `mask` are padding and are
      dropped; sequences come back row-major, left to right. Every real sequence must have at least
      one counted token (prepare drops examples that have none), else the ones after it would pair
      with the wrong partner: pass `num_sequences` to have that checked.

    The first token of each sequence is never counted (nothing in the sequence predicts it).
    Counts are int64.

    >>> values = torch.tensor([[0.0, -1.0, -2.0, 0.0, -3.0, 0.0]])
    >>> position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])  # two sequences, then padding
    >>> sequence_sums(values, values != 0, position_ids)
    (tensor([-3., -3.]), tensor([2, 1]))
    """
    if not (values.shape == mask.shape and values.dim() == 2):
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must be the same [B, T]")
    if position_ids is None:
        counted = mask.bool().clone()
        counted[:, 0] = False
        sums = torch.where(counted, values, 0.0).sum(dim=1)
        return sums, counted.sum(dim=1)
    starts = position_ids == 0
    starts[:, 0] = True
    counted = mask.bool() & ~starts
    # Segment id of every token, row-major; as many slots as tokens, so no sync to size the buffers.
    segment = torch.cumsum(starts.reshape(-1), dim=0) - 1
    sums = values.new_zeros(values.numel()).index_add(
        0, segment, torch.where(counted, values, 0.0).reshape(-1)
    )
    counts = torch.zeros(values.numel(), dtype=torch.long, device=values.device)
    counts = counts.index_add(0, segment, counted.reshape(-1).long())
    keep = counts > 0  # sync point: boolean indexing needs the number of sequences on the host
    sums, counts = sums[keep], counts[keep]
    if num_sequences is not None and len(sums) != num_sequences:
        raise FinetuneError(
            f"the packed batch holds {len(sums)} sequences with trainable tokens, expected {num_sequences}: "
            "every chosen, rejected or KTO completion needs at least one token with a label; re-prepare the "
            "dataset so that no completion is empty or truncated away"
        )
    return sums, counts


# ------------------------------------------------------------------------------ losses


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    smoothing: Smoothing = "conservative",
) -> PreferenceLoss:
    """DPO (Rafailov et al. 2023, Eq. 7): -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)).

    Log-ratios are policy minus reference sequence log-prob sums. With `label_smoothing` e > 0 the
    preference label is taken to be flipped with probability e:

    * "conservative" (cDPO, Mitchell 2023; TRL's CPOTrainer "sigmoid", TRL < 1.0's DPO "sigmoid"):
      (1 - e) * -log sigmoid(z) + e * -log sigmoid(-z).
    * "robust" (rDPO, Chowdhury et al. 2024; TRL 1.16 DPOTrainer loss_type "robust"):
      ((1 - e) * -log sigmoid(z) - e * -log sigmoid(-z)) / (1 - 2e), an unbiased estimate of the
      clean loss.

    TRL 1.16's DPOTrainer "sigmoid" ignores `label_smoothing`; both kinds here equal it at e = 0.

    >>> out = dpo_loss(torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]),
    ...                torch.tensor([-11.5]), beta=0.1)
    >>> round(out.losses.item(), 4), round(out.chosen_rewards.item(), 4)
    (0.621, 0.1)
    """
    _check_beta(beta)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    losses = _smoothed_logistic(beta * (chosen_logratios - rejected_logratios), label_smoothing, smoothing)
    return _paired(
        losses, beta, chosen_logratios, rejected_logratios, policy_chosen_logps, policy_rejected_logps
    )


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_num_tokens: torch.Tensor,
    rejected_num_tokens: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLoss:
    """IPO (Azar et al. 2023, Eq. 17): (h - 1 / (2 * beta))^2, beta being the paper's tau.

    As TRL 1.16 does (and as the IPO authors told TRL their results were obtained), h uses
    per-token log-ratios: h = chosen log-ratio / chosen tokens - rejected log-ratio / rejected
    tokens, so the loss does not grow with completion length. Pass token counts of 1 for the
    paper's unnormalised h. The logged rewards are beta times the summed log-ratios, as TRL logs.

    >>> out = ipo_loss(torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]),
    ...                torch.tensor([-11.5]), torch.tensor([4]), torch.tensor([5]), beta=0.5)
    >>> round(out.losses.item(), 4)  # h = 1/4 + 0.5/5 = 0.35
    0.4225
    """
    _check_beta(beta)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = _per_token(chosen_logratios, chosen_num_tokens) - _per_token(rejected_logratios, rejected_num_tokens)
    losses = (h - 1 / (2 * beta)) ** 2
    return _paired(
        losses, beta, chosen_logratios, rejected_logratios, policy_chosen_logps, policy_rejected_logps
    )


def simpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_num_tokens: torch.Tensor,
    rejected_num_tokens: torch.Tensor,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """SimPO (Meng et al. 2024, Eq. 6): -log sigmoid(beta * (mean chosen logp - mean rejected logp) - gamma).

    Reference-free; "mean" is the per-token mean of the completion's log-probs. `gamma` is TRL's
    `simpo_gamma` (a margin in reward units), `label_smoothing` is applied the conservative way, as
    TRL's CPOTrainer does. Defaults are TRL's; the paper uses beta 2.0 to 2.5 and gamma/beta 0.3 to
    0.8. This is TRL's CPOTrainer with loss_type "simpo" and cpo_alpha=0 (its default cpo_alpha=1
    adds an NLL term on the chosen completions: CPO-SimPO).

    >>> out = simpo_loss(torch.tensor([-4.0]), torch.tensor([-10.0]), torch.tensor([4]), torch.tensor([5]),
    ...                  beta=2.0, gamma=1.0)
    >>> round(out.losses.item(), 4)  # -log sigmoid(2 * (-1 + 2) - 1)
    0.3133
    """
    _check_beta(beta)
    chosen_mean = _per_token(policy_chosen_logps, chosen_num_tokens)
    rejected_mean = _per_token(policy_rejected_logps, rejected_num_tokens)
    losses = _smoothed_logistic(beta * (chosen_mean - rejected_mean) - gamma, label_smoothing, "conservative")
    return _paired(losses, beta, chosen_mean, rejected_mean, chosen_mean, rejected_mean)


def orpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_num_tokens: torch.Tensor,
    rejected_num_tokens: torch.Tensor,
    chosen_nll_logps: torch.Tensor,
    chosen_nll_num_tokens: torch.Tensor,
    *,
    beta: float = 0.1,
    nll_reduction: Literal["batch", "sequence"] = "batch",
) -> PreferenceLoss:
    """ORPO (Hong et al. 2024, Eq. 6-7): NLL of chosen + beta * -log sigmoid(log odds ratio).

    The odds use length-averaged probabilities: with m = mean completion logp, odds = e^m / (1 - e^m)
    and the log odds ratio is (m_c - m_r) - (log(1 - e^m_c) - log(1 - e^m_r)). `beta` is the
    paper's lambda (TRL's name).

    The NLL term takes its own sums and counts because TRL 1.16 computes it over a different token
    set: every token of prompt + chosen completion (score the chosen sequences with labels =
    input_ids to get them). `nll_reduction` says how it is normalised:

    * "batch" (TRL): one token mean over all the batch's chosen sequences, repeated on every pair,
      so the mean over pairs is TRL's loss.
    * "sequence" (the paper's Eq. 2): each pair's own per-token mean.

    >>> m_c, m_r = torch.tensor([-0.5]), torch.tensor([-0.9])
    >>> out = orpo_loss(m_c, m_r, torch.tensor([1]), torch.tensor([1]), torch.tensor([-2.0]),
    ...                 torch.tensor([4]), beta=1.0)
    >>> round(out.losses.item(), 4)  # 0.5 + -log sigmoid(0.4 - log((1 - e^-0.5) / (1 - e^-0.9)))
    0.8677
    """
    _check_beta(beta)
    chosen_mean = _per_token(policy_chosen_logps, chosen_num_tokens)
    rejected_mean = _per_token(policy_rejected_logps, rejected_num_tokens)
    log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
    if nll_reduction == "batch":
        nll = -chosen_nll_logps.sum() / chosen_nll_num_tokens.sum().clamp(min=1)
        nll = nll.expand_as(log_odds)
    elif nll_reduction == "sequence":
        nll = -_per_token(chosen_nll_logps, chosen_nll_num_tokens)
    else:
        raise FinetuneError(
            f"orpo nll_reduction must be 'batch' (as TRL) or 'sequence' (as the paper), not {nll_reduction!r}"
        )
    return _paired(
        nll - beta * F.logsigmoid(log_odds), beta, chosen_mean, rejected_mean, chosen_mean, rejected_mean
    )


def kto_mismatched_completions(completions: list) -> list:
    """The completions KTO pairs with the batch's prompts to estimate its KL reference point.

    Prompt i gets completion i - 1 (the first gets the last), as TRL rotates them within each batch,
    so the mismatched completions are the batch's own, each paired with another prompt.

    >>> kto_mismatched_completions(["y1", "y2", "y3"])
    ['y3', 'y1', 'y2']
    """
    return completions[-1:] + completions[:-1]


def kto_reference_point(
    policy_kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    *,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al. 2024, Eq. 7): max(0, mean KL estimate), detached.

    The KL estimate is the mean of policy minus reference log-prob sums of mismatched
    (prompt, completion) pairs (`kto_mismatched_completions`); no gradient flows through it. TRL
    averages the per-process means across processes before the clamp: pass
    `reduce=lambda t: accelerator.reduce(t, "mean")` for that (a collective: every process must call it).

    >>> kto_reference_point(torch.tensor([-5.0, -7.0]), torch.tensor([-6.0, -6.5]))
    tensor(0.2500)
    >>> kto_reference_point(torch.tensor([-7.0]), torch.tensor([-6.0]))  # clamped at 0
    tensor(0.)
    """
    kl = (policy_kl_logps - ref_kl_logps).detach().mean()
    if reduce is not None:
        kl = reduce(kl)
    return kl.clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLoss:
    """KTO (Ethayarajh et al. 2024, Eq. 8), per example, in input order.

    With r = policy - reference log-prob sum and z0 = `reference_point` (`kto_reference_point`):
    desirable examples lose desirable_weight * (1 - sigmoid(beta * (r - z0))), undesirable ones
    undesirable_weight * (1 - sigmoid(beta * (z0 - r))). TRL's loss is the plain mean over the batch's
    examples (not weighted by the weights' sum). The paper suggests weights such that
    desirable_weight * n_desirable / (undesirable_weight * n_undesirable) is in [1, 4/3].

    >>> out = kto_loss(torch.tensor([-5.0, -9.0]), torch.tensor([-6.0, -8.0]), torch.tensor([True, False]),
    ...                torch.tensor(0.0), beta=1.0)
    >>> out.losses  # both examples: 1 - sigmoid(1)
    tensor([0.2689, 0.2689])
    """
    _check_beta(beta)
    desirable = desirable.bool()
    logratios = policy_logps - ref_logps
    z = beta * (logratios - reference_point)
    losses = torch.where(
        desirable, desirable_weight * (1 - torch.sigmoid(z)), undesirable_weight * (1 - torch.sigmoid(-z))
    )
    rewards = beta * logratios.detach()
    return PreferenceLoss(
        losses=losses,
        chosen_rewards=rewards[desirable],
        rejected_rewards=rewards[~desirable],
        chosen_logps=policy_logps.detach()[desirable],
        rejected_logps=policy_logps.detach()[~desirable],
        paired=False,
    )


def preference_metrics(out: PreferenceLoss) -> dict[str, torch.Tensor]:
    """Batch means of what TRL logs, under TRL's keys; detached tensors (no host sync here).

    `rewards/accuracies` (chosen reward above rejected) exists for paired losses only; for KTO the
    margin is the difference of the two means, as TRL computes it, and a side with no example in
    the batch is left out.

    >>> out = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]), torch.zeros(2), torch.zeros(2))
    >>> {k: round(v.item(), 3) for k, v in preference_metrics(out).items()}["rewards/accuracies"]
    0.5
    """
    metrics = {"loss": out.losses.detach().mean()}
    for side, rewards, logps in (
        ("chosen", out.chosen_rewards, out.chosen_logps),
        ("rejected", out.rejected_rewards, out.rejected_logps),
    ):
        if rewards.numel():
            metrics[f"rewards/{side}"] = rewards.mean()
            metrics[f"logps/{side}"] = logps.mean()
    if out.paired:
        metrics["rewards/accuracies"] = (out.chosen_rewards > out.rejected_rewards).float().mean()
        metrics["rewards/margins"] = (out.chosen_rewards - out.rejected_rewards).mean()
    elif "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


# ------------------------------------------------------------------------------ helpers


def _paired(
    losses: torch.Tensor,
    beta: float,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> PreferenceLoss:
    """A paired loss's result: rewards are beta times `chosen` / `rejected` (the log-ratios, or the
    reference-free losses' per-token means), the logged log-probs `chosen_logps` / `rejected_logps`;
    all but `losses` detached."""
    return PreferenceLoss(
        losses=losses,
        chosen_rewards=beta * chosen.detach(),
        rejected_rewards=beta * rejected.detach(),
        chosen_logps=chosen_logps.detach(),
        rejected_logps=rejected_logps.detach(),
    )


def _smoothed_logistic(z: torch.Tensor, label_smoothing: float, smoothing: Smoothing) -> torch.Tensor:
    """-log sigmoid(z), with the preference label flipped with probability `label_smoothing`."""
    if smoothing not in ("conservative", "robust"):
        raise FinetuneError(f"label smoothing must be 'conservative' or 'robust', not {smoothing!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise FinetuneError(
            f"label_smoothing is the probability that a preference label is flipped and must be in [0, 0.5), "
            f"got {label_smoothing}; 0.1 is a typical value"
        )
    clean = -F.logsigmoid(z)
    if label_smoothing == 0.0:
        return clean
    flipped = -F.logsigmoid(-z)
    if smoothing == "conservative":
        return (1 - label_smoothing) * clean + label_smoothing * flipped
    return ((1 - label_smoothing) * clean - label_smoothing * flipped) / (1 - 2 * label_smoothing)


def _per_token(logps: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Sequence sums divided by their token counts (a sequence with no token counts as one)."""
    return logps / num_tokens.clamp(min=1).to(logps.dtype)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0 without cancellation (Maechler 2012: switch formulas at -log 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise FinetuneError(f"beta must be > 0, got {beta}; TRL's default is 0.1")
