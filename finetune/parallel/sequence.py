"""Sequence parallel: DeepSpeed's Ulysses attention and loader adapter (ALST, deepspeed.runtime.
sequence_parallel.ulysses_sp), registered by finetune so that it composes with any engine.

Each group of `sequence_parallel_size` processes splits a row into equal shards of tokens. Before
attention the processes trade heads for tokens (an all-to-all): each then attends over the whole row
with heads / size of the heads, and trades back. DeepSpeed's adapter gathers one batch from every process
of the group and hands each its shard of every row in turn, the labels shifted first (`shift_labels`), so
the loss of a shard is exact and the engine's token normalisation (trainable tokens over all processes)
covers the whole sequence. Gradients are reduced by the engine over every process, as in data parallel:
the all-to-all's backward brings each process the gradient of its shard's keys and values from the
others.

Why finetune registers DeepSpeed's components itself rather than through Accelerate's ParallelismConfig
(sp_size, sp_backend deepspeed): Accelerate 1.15 registers them only in `Accelerator._prepare_deepspeed`,
inside its DeepSpeed engine, and its ParallelismConfig refuses a MULTI_CPU run ("ParallelismConfig is
only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
DistributedType.DEEPSPEED"), while Accelerate runs DeepSpeed on CPUs as one process only. Registered
here they run under DDP on gloo (the CPU tests) and on GPUs. Groups of processes that split the same
rows under DeepSpeed's ZeRO or FSDP2 are allowed but have not run here (docs/scale-out.md).

Packed rows: DeepSpeed's Ulysses drops transformers' attention mask (built for the local shard) and
relies on the gathered position_ids; transformers' SDPA then attends causally over the whole row, so
two packed sequences would see each other (measured: the loss of a packed row under SP=2 was the
unpacked row's). `segmented_sdpa` runs SDPA causally within each sequence the restarting position_ids
delimit instead, with no s x s mask. flash_attention_2 reads the position_ids itself (varlen).
"""

from __future__ import annotations

from itertools import islice
from typing import Any


def sequence_starts(position_ids) -> list[list[int]]:
    """Per row, the offsets where a sequence starts (position_ids restart or jump).

    >>> import torch
    >>> sequence_starts(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    [[0, 3, 5]]
    """
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return [torch.nonzero(row).flatten().tolist() for row in starts]


def segmented_sdpa(sdpa):
    """transformers' SDPA attention function applied causally within each packed sequence of a row, as
    the gathered position_ids delimit them; a row of one sequence is one call, unchanged."""
    import torch

    def attention(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        # A decoding step (one query over a cache) or an explicit mask: nothing to segment.
        if position_ids is None or attention_mask is not None or query.shape[2] != key.shape[2]:
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        starts = sequence_starts(position_ids)
        if query.shape[0] == 1 and len(starts[0]) == 1:
            return sdpa(module, query, key, value, None, *args, **kwargs)
        rows = []  # [batch] x [seq, heads, head_dim], as transformers' attention functions return
        for b, row_starts in enumerate(starts):
            ends = [*row_starts[1:], query.shape[2]]
            parts = [
                sdpa(
                    module,
                    query[b : b + 1, :, s:e],
                    key[b : b + 1, :, s:e],
                    value[b : b + 1, :, s:e],
                    None,
                    *args,
                    **kwargs,
                )[0]
                for s, e in zip(row_starts, ends, strict=True)
            ]
            rows.append(torch.cat(parts, dim=1))
        return torch.cat(rows, dim=0), None

    return attention


def register_sequence_parallel(model, *, size: int, micro_batch_size: int, attn_implementation: str):
    """Register DeepSpeed's Ulysses attention with transformers for `model` (its config's heads) over
    groups of `size` processes; returns DeepSpeed's sequence-parallel state (its groups). SDPA runs
    per packed sequence (`segmented_sdpa`). Every process calls it, after torch.distributed is up."""
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not ds_comm.is_initialized():  # DeepSpeed's comm over the process group Accelerate set up
        import torch.distributed

        backend = torch.distributed.get_backend()
        ds_comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    if attn_implementation == "sdpa":
        # DeepSpeed takes the function registered under the name as the attention it wraps.
        ALL_ATTENTION_FUNCTIONS["sdpa"] = segmented_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    base = getattr(model, "get_base_model", lambda: model)()
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=base,
        core_attn_implementation=attn_implementation,
        sequence_parallel_size=size,
        micro_batch_size=micro_batch_size,
        seq_length_is_variable=True,  # rows are padded to a multiple of pad_to_multiple_of, not one length
        disable_in_eval=True,  # evaluation reads whole rows on every process
    )


def pad_batch(batch: dict, length: int) -> dict:
    """`batch` with its rows padded on the right to `length` tokens as finetune's collator pads them
    (finetune.data.batching.collate): labels -100, position_ids restarting at 0 (a segment of its own),
    attention_mask 0; the padded input ids are 0, which nothing reads (no label, after every real token).

    >>> import torch
    >>> b = pad_batch({"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[-100, 6]]),
    ...                "position_ids": torch.tensor([[0, 1]])}, 4)
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["position_ids"].tolist()
    ([[5, 6, 0, 0]], [[-100, 6, -100, -100]], [[0, 1, 0, 1]])
    """
    import torch

    missing = length - batch["input_ids"].shape[1]
    if missing <= 0:
        return batch
    fill = {"labels": -100}
    out = {}
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() < 2:
            out[key] = value
        elif key == "position_ids":
            tail = torch.arange(missing, dtype=value.dtype).expand(value.shape[0], missing)
            out[key] = torch.cat([value, tail], dim=1)
        else:
            out[key] = torch.nn.functional.pad(value, (0, missing), value=fill.get(key, 0))
    return out


class EvenLengths:
    """A loader whose batches are padded to the longest of the sequence-parallel group's current batches.
    DeepSpeed's loader adapter all-gathers the group's batches, and gloo's all_gather refuses tensors of
    different lengths (measured: "ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected
    (1, 504), got (1, 496))"); the padding trains nothing (`pad_batch`). One all-reduce of a length per
    batch."""

    def __init__(self, loader, group):
        self.loader, self.group = loader, group

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        import torch
        import torch.distributed as dist

        for batch in self.loader:
            length = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.int64)
            dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.group)
            yield pad_batch(batch, int(length))


class SequenceShards:
    """The train loader of a sequence-parallel run: DeepSpeed's UlyssesSPDataLoaderAdapter over this
    process's loader, made afresh each epoch. One item is this process's shard of one row batch of the
    group (the group's batches in turn, the group's first process's first), so an epoch is `size` times
    as many items as the loader has batches. The loop sets the epoch on `batch_sampler` and resumes
    mid-epoch through `skip_first_batches`, which skips whole gathered rounds in the loader and the
    rest of a round in the adapter."""

    def __init__(self, loader, groups, *, device, skip: int = 0):
        self.loader, self.groups, self.device, self.skip = loader, groups, device, skip
        self.size = groups.get_sequence_parallel_world_size()

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader) * self.size

    def __iter__(self):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        adapter = UlyssesSPDataLoaderAdapter(
            EvenLengths(self.loader, self.groups.get_sequence_parallel_group()),
            sp_rank=self.groups.get_sequence_parallel_rank(),
            sp_group=self.groups.get_sequence_parallel_group(),
            sp_world_size=self.size,
            device=self.device,
        )
        return islice(adapter, self.skip, None)

    def skip_first_batches(self, num_items: int) -> SequenceShards:
        """This loader without its first `num_items` items (a resumed epoch)."""
        from accelerate import skip_first_batches

        rounds, rest = divmod(num_items, self.size)
        loader = skip_first_batches(self.loader, rounds) if rounds else self.loader
        return SequenceShards(loader, self.groups, device=self.device, skip=rest)


def shard_sequences(model, loader, train: Any, accelerator) -> Any:
    """The train loader of a run with train.sequence_parallel_size > 1, with DeepSpeed's Ulysses
    registered for `model` (SequenceShards); `loader` itself otherwise."""
    size = getattr(train, "sequence_parallel_size", 1)  # (a train section without it: off)
    if size <= 1:
        return loader
    model = accelerator.unwrap_model(model)
    groups = register_sequence_parallel(
        model,
        size=size,
        micro_batch_size=train.micro_batch_size,
        attn_implementation=model.config._attn_implementation,
    )
    return SequenceShards(loader, groups, device=accelerator.device)
