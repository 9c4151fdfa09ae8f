"""Policy-gradient losses of online RL (GRPO and its DAPO / Dr. GRPO / BNPO variants), pure functions.

Inputs are per completion token, flattened over a micro-batch (packed or padded, the caller picks
the completion tokens): the policy's log-prob of each sampled token `logps` (with gradient), the
log-prob when it was sampled `old_logps`, the advantage of the token's completion, and optionally the
reference model's log-prob `ref_logps` for the KL term.

Per token (token-level importance sampling, as TRL's GRPOTrainer by default):

    ratio = exp(logps - old_logps)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL
    KL    = exp(ref - logps) - (ref - logps) - 1          (the k3 estimator, Schulman 2020)
            (x ratio with kl_bias_correction, TRL's default: the estimate is taken under the sampling
            policy, so the ratio reweights it to the current one)

How the token losses of a window become one loss is the loss type (TRL's names and formulas), and
what the engine normalises by, its `unit`:

* ``grpo``: each completion's mean token loss, averaged over completions (unit: completions);
* ``dr_grpo``: token losses summed and divided by max_completion_length, averaged over completions
  (Liu et al. 2025, "Understanding R1-Zero-Like Training"; unit: completions);
* ``dapo``: token losses averaged over every completion token of the window (Yu et al. 2025; unit:
  tokens);
* ``bnpo``: token losses averaged over each micro-batch's tokens, then over micro-batches (unit:
  micro-batches), TRL's per-batch normalisation;
* ``rloo``: one ratio per completion, exp of the sum of its token log-ratios, clipped, times its
  advantage, averaged over completions (TRL's RLOOTrainer; unit: completions; `sequence_loss`).

`policy_loss_sums` returns the micro-batch's sum over its units; the engine divides by the units of
the whole accumulation window on all processes, so the window's loss is TRL's for equal micro-batches.

Advantage estimators turn each completion's reward into its advantage, from the rewards of its
group (the num_generations completions of one prompt). `ESTIMATORS` names them; an online objective
picks one by its row in the objective table (finetune.recipe.objectives: `estimator`):

* ``group``: the reward against its group's mean, scaled by a std (GRPO; `group_advantages`);
* ``leave_one_out``: the reward against the mean of the other completions of its group (RLOO,
  Ahmadian et al. 2024; `leave_one_out_advantages`);
* ``whitened``: the reward against its group's mean, then whitened over the whole step's completion
  tokens (REINFORCE++-baseline, Hu et al. 2025; `whitened_advantages`).

>>> import torch
>>> out = per_token_loss(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -1.0]), epsilon_low=0.2, epsilon_high=0.2)
>>> out.losses.tolist()
[-1.0, 1.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "rloo"]
UNITS: dict[str, str] = {
    "grpo": "completions",
    "dr_grpo": "completions",
    "dapo": "tokens",
    "bnpo": "micro_batches",
    "rloo": "completions",
}
"""What each loss type averages over (the engine's normalisation unit)."""


@dataclass(frozen=True)
class TokenLosses:
    """Per completion token: the loss (with gradient), the KL term (detached; None without a
    reference) and whether the ratio was clipped below / above (for the clip-ratio metrics)."""

    losses: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    kl_bias_correction: bool = True,
    sampling_weights: torch.Tensor | None = None,
) -> TokenLosses:
    """The clipped surrogate (plus beta x KL) of every completion token (see the module docstring).
    `sampling_weights` (an engine that samples with its own copy of the weights, vLLM) multiply the
    surrogate, not the KL term, as TRL applies its importance-sampling correction (`importance_weights`)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    if sampling_weights is not None:
        losses = losses * sampling_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference model's log-probs (ref_logps)")
        delta = ref_logps - logps
        kl_per_token = torch.exp(delta) - delta - 1
        if kl_bias_correction:
            kl_per_token = kl_per_token * ratio
        losses = losses + beta * kl_per_token
        kl = kl_per_token.detach()
    ratio = ratio.detach()
    return TokenLosses(
        losses=losses,
        kl=kl,
        low_clipped=(ratio < 1 - epsilon_low) & (advantages < 0),
        high_clipped=(ratio > 1 + epsilon_high) & (advantages > 0),
    )


def sequence_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    sequence_index: torch.Tensor,
    num_sequences: int,
    *,
    epsilon_low: float,
    epsilon_high: float,
    sampling_weights: torch.Tensor | None = None,
) -> TokenLosses:
    """The clipped surrogate of every completion (TRL's RLOOTrainer): its ratio is the exp of the sum of
    its tokens' log-ratios, its advantage the one its tokens carry. Inputs are per completion token
    (`sequence_index` says whose); the result is per completion (`losses`, with gradient; no KL term:
    RLOO puts it in the reward). `sampling_weights` (per token, constant over a completion:
    a sequence_* importance mode) multiply each completion's surrogate.

    >>> out = sequence_loss(torch.zeros(3), torch.zeros(3), torch.tensor([1.0, 1.0, -2.0]), torch.tensor([0, 0, 1]), 2,
    ...                     epsilon_low=0.2, epsilon_high=0.2)
    >>> out.losses.tolist()
    [-1.0, 2.0]
    """
    zeros = torch.zeros(num_sequences, dtype=logps.dtype, device=logps.device)
    ratio = torch.exp(zeros.index_add(0, sequence_index, logps - old_logps))
    per_sequence = zeros.detach().scatter(0, sequence_index, advantages.to(zeros.dtype))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * per_sequence, clipped * per_sequence)
    if sampling_weights is not None:
        losses = losses * zeros.detach().scatter(0, sequence_index, sampling_weights.to(zeros.dtype))
    ratio = ratio.detach()
    return TokenLosses(
        losses=losses,
        kl=None,
        low_clipped=(ratio < 1 - epsilon_low) & (per_sequence < 0),
        high_clipped=(ratio > 1 + epsilon_high) & (per_sequence > 0),
    )


def policy_loss_sums(
    losses: torch.Tensor,
    sequence_index: torch.Tensor,
    num_sequences: int,
    *,
    loss_type: LossType,
    max_completion_length: int,
) -> torch.Tensor:
    """The micro-batch's loss summed over its units (see UNITS): token losses `losses` belong to the
    completions `sequence_index` (0..num_sequences-1); rloo's `losses` are already one per completion.

    >>> import torch
    >>> losses, index = torch.tensor([1.0, 3.0, 2.0]), torch.tensor([0, 0, 1])
    >>> [float(policy_loss_sums(losses, index, 2, loss_type=t, max_completion_length=4))
    ...  for t in ("grpo", "dr_grpo", "dapo", "bnpo")]
    [4.0, 1.5, 6.0, 2.0]
    """
    if loss_type in ("dapo", "rloo"):
        return losses.sum()
    if loss_type == "bnpo":
        return losses.sum() / max(losses.numel(), 1)
    sums = torch.zeros(num_sequences, dtype=losses.dtype, device=losses.device).index_add(
        0, sequence_index, losses
    )
    if loss_type == "dr_grpo":
        return sums.sum() / max_completion_length
    if loss_type == "grpo":
        counts = torch.bincount(sequence_index, minlength=num_sequences).clamp(min=1)
        return (sums / counts).sum()
    raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(UNITS)}")


ImportanceMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def importance_weights(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    sequence_index: torch.Tensor,
    num_sequences: int,
    *,
    mode: ImportanceMode,
    cap: float | None,
    floor: float | None = None,
) -> torch.Tensor:
    """Per completion token, the correction of sampling with another engine's numerics (vLLM's kernels,
    its bf16 copy of the weights): the importance ratio pi_trainer / pi_sampler of the sampled tokens,
    `old_logps` the trainer's log-probs at sampling time and `sampling_logps` the engine's (NaN where it
    gave none: no correction). Per token (token_*) or per completion (sequence_*: the ratio of its log-prob
    sums), then truncated to [floor, cap] (*_truncate) or set to 0 outside it (*_mask): TRL's
    vllm_importance_sampling_mode and its clip bounds.

    >>> old, sampled, index = torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -2.0, -1.0]), torch.tensor([0, 0, 1])
    >>> importance_weights(old, sampled, index, 2, mode="token_truncate", cap=2.0).tolist()
    [1.0, 2.0, 0.3678794503211975]
    >>> importance_weights(old, sampled, index, 2, mode="sequence_mask", cap=2.0).tolist()
    [0.0, 0.0, 0.3678794503211975]
    """
    diff = torch.nan_to_num(old_logps - sampling_logps, nan=0.0)
    if mode.startswith("sequence"):
        sums = torch.zeros(num_sequences, dtype=diff.dtype, device=diff.device).index_add(
            0, sequence_index, diff
        )
        diff = sums[sequence_index]
    weights = torch.exp(diff)
    if cap is None and floor is None:
        return weights
    if mode.endswith("truncate"):
        return torch.clamp(weights, min=floor, max=cap)
    low = -math.inf if floor is None else floor
    high = math.inf if cap is None else cap
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def group_advantages(
    rewards: torch.Tensor,
    *,
    num_generations: int,
    scale_rewards: Literal["group", "batch", "none"],
    batch_std: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each completion's group has zero reward spread), for rewards laid out
    group after group (num_generations completions of one prompt in a row), as TRL computes them:
    reward minus its group's mean, divided (scale_rewards group: by the group's std; batch: by the
    std of every reward of the step, `batch_std` where the caller gathered it across processes, else
    of `rewards`; none: not at all) with 1e-4 added to the std.

    >>> adv, flat = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), num_generations=2, scale_rewards="none")
    >>> adv.tolist(), flat.tolist()
    ([0.5, -0.5, 0.0, 0.0], [False, False, True, True])
    """
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    # Unbiased std, as torch.std (TRL's nanstd is the same with Bessel's correction).
    group_std = (
        grouped.std(dim=1).repeat_interleave(num_generations)
        if num_generations > 1
        else torch.zeros_like(rewards)
    )
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (group_std + 1e-4)
    elif scale_rewards == "batch":
        if batch_std is None:
            batch_std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
        advantages = advantages / (batch_std + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; choose group, batch or none")
    return advantages, torch.isclose(group_std, torch.zeros_like(group_std))


def leave_one_out_advantages(
    rewards: torch.Tensor,
    *,
    num_generations: int,
    scale_rewards: Literal["group", "batch", "none"],
    batch_std: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each completion's group has zero reward spread), RLOO's: each reward minus
    the mean of the other rewards of its group, as TRL's RLOOTrainer computes them. scale_rewards
    batch is TRL's normalize_advantages: (advantages - their mean) / (their std + 1e-4) over `rewards`
    (the caller passes every process's, laid out group after group); group divides by the std of the
    group's rewards + 1e-4 (GRPO's scale on RLOO's baseline); none leaves them.

    >>> adv, flat = leave_one_out_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0]), num_generations=3,
    ...                                      scale_rewards="none")
    >>> adv.tolist(), flat.tolist()
    ([1.0, -0.5, -0.5, 0.0, 0.0, 0.0], [False, False, False, True, True, True])
    """
    if num_generations < 2:
        raise ValueError("the leave-one-out baseline needs at least 2 completions per prompt")
    grouped = rewards.view(-1, num_generations)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    advantages = (grouped - others).view(-1)
    group_std = grouped.std(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-4)
    elif scale_rewards == "group":
        advantages = advantages / (group_std + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; choose group, batch or none")
    return advantages, torch.isclose(group_std, torch.zeros_like(group_std))


def whitened_advantages(
    rewards: torch.Tensor,
    *,
    num_generations: int,
    scale_rewards: Literal["group", "batch", "none"],
    batch_std: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each completion's group has zero reward spread), REINFORCE++-baseline's
    (Hu et al. 2025; OpenRLHF's `reinforce_baseline` estimator): each reward minus its group's mean,
    then, with scale_rewards batch, whitened over the step as OpenRLHF whitens: minus the mean of the
    advantages of every trained token (a completion's tokens share its advantage; `tokens`: each
    completion's trained-token count, None weighs completions alike), times 1 / sqrt of their variance
    (over the tokens, not Bessel-corrected, at least 1e-8). Unlike GRPO's batch scale (the std of the raw
    rewards) the spread is the centred advantages', and long completions weigh more in it. group and none
    are GRPO's (`group_advantages`). Written here: OpenRLHF (Ray, vLLM) is not a library to import.

    >>> adv, flat = whitened_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), num_generations=2,
    ...                                 scale_rewards="batch", tokens=torch.tensor([1.0, 3.0, 2.0, 2.0]))
    >>> [round(a, 4) for a in adv.tolist()], flat.tolist()
    ([1.8898, -1.1339, 0.378, 0.378], [False, False, True, True])
    """
    if scale_rewards != "batch":
        return group_advantages(rewards, num_generations=num_generations, scale_rewards=scale_rewards)
    centred, flat = group_advantages(rewards, num_generations=num_generations, scale_rewards="none")
    weights = torch.ones_like(centred) if tokens is None else tokens.to(centred)
    count = weights.sum().clamp(min=1)  # no trained token at all: nothing is trained on these advantages
    mean = (centred * weights).sum() / count
    var = ((centred - mean) ** 2 * weights).sum() / count
    return (centred - mean) * var.clamp(min=1e-8).rsqrt(), flat


Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: dict[str, Estimator] = {
    "group": group_advantages,
    "leave_one_out": leave_one_out_advantages,
    "whitened": whitened_advantages,
}
"""Advantage estimators by name: each is called as fn(rewards, num_generations=..., scale_rewards=...,
batch_std=...) on rewards laid out group after group, and returns (advantages, whether each
completion's group has zero reward spread)."""
TOKEN_WEIGHTED = frozenset({whitened_advantages})
"""Estimators that weigh each completion by its trained tokens (called with `tokens=` as well)."""
