"""Activation offloading: the tensors a forward saves for backward go to pinned host memory as they are
saved and come back to the GPU when the backward needs them, through torch's saved-tensor hooks (the
mechanism torchtune's and TRL's offloading use). With gradient checkpointing only each layer's input
(and the few tensors outside the layers) is saved, so only those move.

Not moved: parameters (they stay on the GPU anyway; autocast's 16-bit weight copies are not parameters
and do move), tensors already on the host, and tensors under 1 MiB, whose copy costs more than it saves.
The copies are synchronous from the compute stream's point of view (non_blocking into pinned memory, the
caching allocator reuses a freed block only after the copy that reads it): simpler than torchtune's
side stream, slower when the PCIe link is the bottleneck.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

MIN_OFFLOAD_BYTES = 2**20


def offloaded(train: Any):
    """The context of a forward whose saved activations go to the host (train.activation_offloading), or
    one that does nothing."""
    if not getattr(train, "activation_offloading", False):  # (a train section without it: off)
        return nullcontext()
    import torch

    def pack(tensor: torch.Tensor):
        if (
            isinstance(tensor, torch.nn.Parameter)
            or tensor.device.type == "cpu"
            or tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES
        ):
            return tensor
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return (tensor.device, host)

    def unpack(packed):
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=True)
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
