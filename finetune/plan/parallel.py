"""Per-rank memory under tensor, sequence and context parallel and activation offloading
(train.tensor_parallel_size, sequence_parallel_size, context_parallel_size, activation_offloading;
finetune.parallel runs them):

* tensor parallel (size t) splits every decoder Linear, the embeddings and the head by the model's TP
  plan: the weights (and, in full fine-tuning, their gradients and optimizer states) of those modules
  are 1/t per rank, the norms whole; LoRA's A matrices stay whole (PEFT shards B only) and are counted
  whole. Activations: each rank computes heads/t attention heads and intermediate/t MLP columns, so a
  layer's attention and MLP tensors are 1/t; its inputs, norms and residual stream are whole on every
  rank, and so are the logits (the head's plan gathers them). The activation formula runs on the model
  with heads, key/value heads and intermediate size divided by t (`tensor_view`);
* sequence parallel (Ulysses) and context parallel (ring attention), sizes s and c, give each rank
  seq/(s x c) tokens of every row: every activation term, the logits' included, is per token, so the
  formula runs at that length. Attention: Ulysses' ranks attend over the whole row with heads/s heads
  (the same bytes as seq/s tokens with every head), ring attention over its chunk; neither builds
  transformers' seq x seq mask (finetune's Ulysses attention runs SDPA per packed sequence without one,
  torch's ring attention is causal SDPA), so the mask term is dropped; finetune's Ulysses SDPA adds one
  copy of the attention output per layer (`with_segments`);
* activation offloading moves what autograd saves to pinned host memory: with gradient checkpointing
  the kept layer inputs (all but the layer being recomputed), without it everything saved but the
  last layer and the loss, which the backward needs first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.plan.activations import Activations
from finetune.plan.inventory import ModelInventory
from finetune.plan.states import Part

# the state parts shard_states returns
_STATE_PARTS = ("weights", "gradients", "optimizer states")


@dataclass(frozen=True)
class Split:
    """How a recipe splits one model or one row: tensor parallel size, sequence shards (sequence x context
    parallel sizes), and whether activations are offloaded."""

    tensor: int = 1
    sequence: int = 1
    offload: bool = False

    @property
    def any(self) -> bool:
        return self.tensor > 1 or self.sequence > 1 or self.offload


def split_of(train) -> Split:
    """The recipe train section's split."""
    return Split(
        tensor=train.tensor_parallel_size,
        sequence=train.sequence_parallel_size * train.context_parallel_size,
        offload=train.activation_offloading,
    )


def shard_len(seq_len: int, split: Split) -> int:
    """Tokens of a row on one rank.

    >>> shard_len(131072, Split(sequence=8))
    16384
    """
    return -(-seq_len // split.sequence)


def tensor_view(inv: ModelInventory, split: Split) -> ModelInventory:
    """The model as one tensor-parallel rank computes it: heads, key/value heads and MLP columns / t."""
    t = split.tensor
    if t <= 1:
        return inv
    return replace(
        inv,
        num_heads=max(1, inv.num_heads // t),
        num_kv_heads=max(1, inv.num_kv_heads // t),
        intermediate_size=max(1, inv.intermediate_size // t),
    )


def planned_fraction(inv: ModelInventory) -> float:
    """The share of the parameters the TP plan splits: every Linear (the head's included) and the input
    embeddings (Llama's and Qwen2's plans in transformers 5)."""
    planned = sum(m.num_params for m in inv.linears()) + inv.embedding_params
    return min(1.0, planned / max(1, inv.total))


def split_states(parts: list[Part], inv: ModelInventory, split: Split, *, full: bool) -> list[Part]:
    """`parts` (shard_states') with the weights, and in full fine-tuning their gradients and optimizer
    states, divided by the TP plan."""
    if split.tensor <= 1:
        return parts
    share = planned_fraction(inv)
    factor = 1 - share + share / split.tensor
    out = []
    for part in parts:
        if part.name in _STATE_PARTS and (full or part.name == "weights"):
            note = f"{part.note}, {share:.0%} split /{split.tensor} (TP plan)".lstrip(", ")
            part = replace(
                part, gpu_bytes=part.gpu_bytes * factor, host_bytes=part.host_bytes * factor, note=note
            )
        out.append(part)
    return out


def tensor_data_parallel(
    parts: list[Part], gathered: Part | None, inv: ModelInventory, split: Split, num_processes: int
) -> list[Part]:
    """`parts` (split_states') under data parallel beside tensor parallel on the DDP launcher: transformers'
    FSDP2 across the num_processes / t TP groups (finetune.parallel.tensor) shards each rank's TP shards
    of the weights, gradients and optimizer states over the groups, and gathers them a unit at a time
    (`gathered`: gathered_bytes' FSDP2 working set of the whole model, of which a rank gathers its TP
    shard)."""
    groups = num_processes // split.tensor if split.tensor > 1 else 1
    if groups <= 1:
        return parts
    out = []
    for part in parts:
        if part.name in _STATE_PARTS:
            note = f"{part.note}, /{groups} (FSDP2 across the TP groups)".lstrip(", ")
            part = replace(
                part, gpu_bytes=part.gpu_bytes / groups, host_bytes=part.host_bytes / groups, note=note
            )
        out.append(part)
    if gathered is not None:
        share = planned_fraction(inv)
        factor = 1 - share + share / split.tensor
        out.append(
            replace(gathered, gpu_bytes=gathered.gpu_bytes * factor, note=f"{gathered.note}, TP shards")
        )
    return out


def with_segments(
    acts: Activations,
    inv: ModelInventory,
    split: Split,
    *,
    attn: str,
    rows: int,
    tokens: int,
    compute_bytes: int,
) -> Activations:
    """`acts` (computed for a rank's `tokens` with no mask) plus what finetune's Ulysses SDPA saves beyond
    a masked-free attention: it runs SDPA per packed sequence and concatenates the outputs, a copy of
    the attention output per layer (c x tokens x heads x head_dim; measured on 2 gloo processes,
    tests/integration/test_sequence_parallel.py). flash_attention_2 and ring attention need none."""
    if split.sequence <= 1 or attn != "sdpa":
        return acts
    output = compute_bytes * rows * tokens * inv.num_heads * inv.head_dim
    return replace(acts, per_layer=acts.per_layer + output)


def offloaded_bytes(acts: Activations, checkpointing: bool) -> float:
    """The activation bytes activation offloading keeps in pinned host memory instead of on the GPU (what
    `Activations.peak` counts that the saved-tensor hooks move): with checkpointing the layer inputs
    but the one being recomputed, without it every saved tensor but the last layer's and the loss's."""
    if checkpointing:
        return max(0, acts.num_layers - 1) * acts.layer_input
    return max(0.0, acts.saved - acts.per_layer - acts.loss_saved)


def split_note(split: Split) -> str:
    """What the activation line says about the split."""
    words = []
    if split.tensor > 1:
        words.append(f"heads and MLP columns /{split.tensor} (TP)")
    if split.sequence > 1:
        words.append(f"tokens /{split.sequence} (SP/CP), no seq x seq mask")
    if split.offload:
        words.append("saved tensors offloaded to pinned host memory")
    return "; ".join(words)
