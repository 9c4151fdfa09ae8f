"""Losses as pure functions of tensors: no model, no optimizer, no config.

`finetune.losses.preference` holds the numerical core of preference tuning (DPO and its robust and
conservative label smoothing, IPO, SimPO, ORPO, KTO): per-token log-probabilities from logits, their
reduction to per-sequence sums in padded or packed batches, and the losses on those sums, defined as
TRL 1.16 defines them and tested against TRL's trainers and against the papers' formulas. An
objective combines them with a model forward; the engine only sees the per-pair losses.
"""
