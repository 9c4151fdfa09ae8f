"""A reward model's scores and loss: one score per sequence of a packed row, and the Bradley-Terry loss of
TRL's RewardTrainer on them.

A reward model is transformers' AutoModelForSequenceClassification with one label: a score head (a
linear layer, `score`) on the base model's last hidden states. Its forward returns one score per *row*,
at the row's last token that is not the pad token. A packed row holds several sequences (position_ids
restart at 0 for each; the base model's attention stays inside each one), so that pooled score is of
no use. `sequence_scores` runs the model's own forward, through every wrapper (DDP, DeepSpeed, PEFT,
torch.compile: their hooks and gradient synchronisation see an ordinary call), and reads the score
head's output at every token with a forward hook on the head, then takes each sequence's score at its
last token that is not the pad token: transformers' pooling rule, applied per sequence. So the saved
model, loaded with AutoModelForSequenceClassification and given one text, scores it as training did
(where the pad token is the eos, a trailing eos is not scored, as in TRL).

>>> ids = torch.tensor([[1, 5, 2, 1, 6, 3, 3]])  # two sequences, then padding (pad id 3)
>>> last_tokens(ids, torch.tensor([[0, 1, 2, 0, 1, 0, 1]]), torch.tensor([2]), pad_token_id=3).tolist()
[2, 4]
>>> loss = bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.0]))
>>> round(loss.item(), 4)
0.1269
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.errors import FinetuneError


def score_head(model) -> torch.nn.Module:
    """The score head of a reward model inside its wrappers (DDP, DeepSpeed, torch.compile, PEFT, whose
    attribute lookups reach the transformers model: under LoRA the head is PEFT's modules_to_save wrapper
    around the trained copy)."""
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    head = getattr(inner, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise FinetuneError(
            f"{type(inner).__name__} has no score head: a reward model is a sequence-classification model "
            "(transformers' AutoModelForSequenceClassification, num_labels 1)"
        )
    return head


def token_scores(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The score head's output at every token of `inputs` ([rows, tokens], float32, with gradient unless
    called under no_grad), from one forward of `model` (packed rows: input_ids and position_ids).

    use_cache=False matters for correctness: with a KV cache transformers skips the packed-sequence
    detection that turns restarting position_ids into a block-diagonal mask (finetune.losses.causal_lm).
    """
    captured: list[torch.Tensor] = []
    handle = score_head(model).register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise FinetuneError(f"the score head ran {len(captured)} times in one forward (expected once)")
    scores = captured[0]
    if scores.shape[-1] != 1:
        raise FinetuneError(
            f"the score head has {scores.shape[-1]} outputs: a reward model has one (num_labels 1)"
        )
    return scores[..., 0].float()


def last_tokens(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    num_sequences: torch.Tensor,
    *,
    pad_token_id: int | None,
) -> torch.Tensor:
    """Flat indices (into input_ids.reshape(-1)) of each real sequence's last token that is not the pad
    token (its first token when all are), row-major, left to right.

    A sequence starts at every 0 of `position_ids` (and at every row's start); `num_sequences[r]` are the
    real sequences of row r, the segments after them its padding. A sync point: the number of sequences
    sizes the result.

    >>> last_tokens(torch.tensor([[7, 8, 0, 9, 0]]), torch.tensor([[0, 1, 2, 0, 1]]), torch.tensor([2]), pad_token_id=0)
    tensor([1, 3])
    """
    rows, width = input_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    local = torch.cumsum(starts, dim=1) - 1  # the segment of every token within its row
    real = local < num_sequences.to(local.device)[:, None]
    offsets = torch.cumsum(num_sequences, 0).to(local.device) - num_sequences.to(local.device)
    segment = (local + offsets[:, None]).masked_fill(~real, -1).reshape(-1)
    flat = torch.arange(rows * width, device=input_ids.device)
    total = int(num_sequences.sum())
    kept = segment >= 0
    scored = input_ids.reshape(-1) != pad_token_id if pad_token_id is not None else torch.ones_like(kept)
    last = torch.full((total,), -1, dtype=torch.long, device=flat.device)
    last = last.scatter_reduce(0, segment[kept & scored], flat[kept & scored], reduce="amax")
    first = torch.full((total,), rows * width, dtype=torch.long, device=flat.device)
    first = first.scatter_reduce(0, segment[kept], flat[kept], reduce="amin")
    return torch.where(last >= 0, last, first)


def sequence_scores(
    model, batch: dict[str, torch.Tensor], num_sequences: torch.Tensor, *, pad_token_id: int | None
) -> torch.Tensor:
    """One score per real sequence of a packed batch (input_ids, position_ids; `num_sequences` per row),
    row-major: the score head at each sequence's last token that is not the pad token (see the module
    docstring)."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    scores = token_scores(model, inputs)
    index = last_tokens(batch["input_ids"], batch["position_ids"], num_sequences, pad_token_id=pad_token_id)
    return scores.reshape(-1)[index]


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> torch.Tensor:
    """Per-pair Bradley-Terry losses of a reward model's scores: -log sigmoid(chosen - rejected - margin),
    plus center_rewards_coefficient * (chosen + rejected)^2. Their mean is TRL's RewardTrainer loss on
    the same pairs (which averages both terms over the batch).

    >>> bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), margin=torch.tensor([1.0, 0.0]),
    ...     center_rewards_coefficient=0.5).tolist()
    [1.1931471824645996, 0.6931471824645996]
    """
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin.to(difference.dtype)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses
