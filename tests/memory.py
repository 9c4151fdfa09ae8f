"""Peak CPU memory of a piece of torch code, and the bytes a forward saves for backward, for tests that
check memory formulas (the planner's activation terms, the chunked loss) against what really happens.

torch has no CPU counterpart of `torch.cuda.max_memory_allocated`, but its CPU allocator reports every
allocation and free to the profiler when `profile_memory=True`: the running sum of those sizes is
the bytes allocated inside the block and still alive, and its maximum is the peak. Unlike
`saved_tensors_hooks` it sees transients (gradient buffers in backward, temporaries inside an op);
unlike the process RSS it is exact and does not depend on glibc's allocator or other processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """The most CPU bytes allocated inside `fn()` and alive at once (tensors made before it that are
    freed inside it count as nothing: their frees are not reported to the profiler)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The profiler's event tree is the only place that keeps allocations one by one, in order;
    # key_averages() sums them per op. Frees are allocations with a negative size.
    allocations = []
    events = list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            allocations.append((event.start_time_ns, fields.alloc_size, fields.ptr))
        events.extend(event.children)
    # Only blocks allocated inside fn() count: the allocator also reports frees of blocks allocated
    # while an earlier profiler was running (a previous measurement's garbage collected now).
    live: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(allocations, key=lambda a: a[0]):
        if size > 0:
            live[ptr] = size
            total += size
        else:
            total -= live.pop(ptr, 0)
        peak = max(peak, total)
    return peak


def saved_tensor_bytes(model: torch.nn.Module, batch: dict, *, autocast: bool = False) -> int:
    """Bytes of the unique storages autograd saves in `model(**batch)`, parameters excluded (bf16
    autocast on CPU with `autocast`)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        model(**batch, use_cache=False)
    return sum(storages.values())
