"""Constants shared across layers; this module imports nothing."""

IGNORE_INDEX = -100
"""The label of a token that is not trained: the loss skips it (torch's cross_entropy ignore_index)."""
