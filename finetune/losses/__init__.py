"""Losses as pure functions of tensors: no optimizer, no config.

`finetune.losses.preference` holds the numerical core of preference tuning (DPO and its robust and
conservative label smoothing, IPO, SimPO, ORPO, KTO): per-token log-probabilities from logits, their
reduction to per-sequence sums in padded or packed batches, and the losses on those sums, defined as
TRL 1.16 defines them and tested against TRL's trainers and against the papers' formulas. An
objective combines them with a model forward; the engine only sees the per-pair losses.

`finetune.losses.chunked_ce` computes the cross-entropy and the per-token log-probabilities from the
final hidden states and the output head a chunk of tokens at a time, so the [tokens x vocab] logits
and their gradient never exist whole. Its `causal_lm_loss` and `causal_lm_token_logps` are the one
place here that takes a model: they run its forward with the head computing the loss.
"""
