"""The SFT objective's own decisions (its loss math is tested in tests/unit/losses/)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from finetune.objectives.sft import SFTObjective


def _head(vocab_size: int, hidden_size: int = 8, *, zero3: bool) -> torch.nn.Module:
    """A model whose output head has `vocab_size` rows; under ZeRO-3 its weight is partitioned as
    DeepSpeed partitions it (empty on each process, the whole shape kept in ds_shape)."""
    head = torch.nn.Linear(hidden_size, vocab_size, bias=False, device="meta")
    if zero3:
        head.weight.ds_shape = head.weight.shape
        head.weight.data = torch.empty(0, device="meta")
    return SimpleNamespace(get_output_embeddings=lambda: head)


def test_auto_loss_chunk_size_sees_the_whole_vocabulary_under_zero3():
    """train.loss_chunk_size null turns chunking on for Llama-3's vocabulary at 2048 tokens per micro
    batch, with or without ZeRO-3 (which left it off: it read the partitioned head's 0 rows)."""
    settings = SimpleNamespace(
        train=SimpleNamespace(loss_chunk_size=None, micro_batch_size=1),
        model_settings=SimpleNamespace(enable_liger_kernel=False),
        data=SimpleNamespace(packing_len=2048),
    )
    accelerator = SimpleNamespace(print=lambda *a, **k: None, device=torch.device("cpu"))
    sizes = [
        SFTObjective._chunk_size(settings, _head(128256, zero3=zero3), accelerator) for zero3 in (False, True)
    ]
    assert sizes[0] > 0 and sizes == [sizes[0], sizes[0]], sizes
