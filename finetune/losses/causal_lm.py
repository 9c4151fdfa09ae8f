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
        batch = {k: v for k, v in batch.items() if k != "labels"}
        return model(**batch, use_cache=False)
    return model(**batch, use_cache=False, num_items_in_batch=num_items)


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
