"""The causal-LM forward on a collated batch and its per-row token losses (training, eval and
`finetune eval` share them)."""

from __future__ import annotations

import torch

from finetune.constants import IGNORE_INDEX


def forward(model, batch: dict, *, num_items: torch.Tensor | None = None):
    """The model's forward on a collated batch (labels included when num_items is given).

    use_cache=False matters for correctness, not only memory: with a KV cache, transformers skips
    the packed-sequence detection that turns restarting position_ids into a block-diagonal mask,
    and packed sequences would attend to each other.
    """
    if num_items is None:
        batch = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
        return model(**batch, use_cache=False)
    if "shift_labels" in batch and "labels" not in batch:
        # A shard of a row (sequence, context parallel) carries its labels shifted before the split;
        # transformers' loss reads them as `shift_labels` and computes a loss only when labels are given.
        batch = {**batch, "labels": batch["shift_labels"]}
    return model(**batch, use_cache=False, num_items_in_batch=num_items)


def trainable_tokens(batch: dict) -> torch.Tensor:
    """Tokens of a batch that contribute to the loss: labels shifted by one (the model predicts t+1 from
    t), or a shard's labels shifted before the split (`shift_labels`: sequence and context parallel).

    >>> trainable_tokens({"labels": torch.tensor([[-100, 5, 6]])}).item()
    2
    >>> trainable_tokens({"shift_labels": torch.tensor([[5, 6, -100]])}).item()
    2
    """
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def token_loss_sums(model, batch: dict, *, chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, trained-token count) per row of a batch, under no_grad; with
    `chunk_size`, from chunked log-probabilities (the full logits are never built)."""
    target = batch["labels"][:, 1:]
    counts = (target != IGNORE_INDEX).sum(dim=1)
    if chunk_size:
        from finetune.losses.chunked_ce import causal_lm_token_logps

        return -causal_lm_token_logps(model, batch, chunk_size=chunk_size)[:, 1:].sum(dim=1), counts
    logits = forward(model, batch).logits[:, :-1].float()
    per_token = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), target, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return per_token.sum(dim=1), counts
