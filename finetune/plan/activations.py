"""Activations: what autograd saves for a Llama-style decoder layer per micro batch
(`activation_bytes`), with and without gradient checkpointing, LoRA inputs and the logits."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.plan.inventory import Adapter, ModelInventory, VisionInventory

# -------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch (see `activation_bytes` for the formula)."""

    num_layers: int
    per_layer: float  # saved by autograd in one decoder layer
    layer_input: float  # one layer's input: all a checkpointed layer keeps
    head: float  # final norm, lm_head input, ids/labels, rotary tables
    mask: float  # transformers' mask (bool for sdpa, float for eager), alive through the forward
    loss_saved: float  # the fp32 log-softmax the cross entropy saves for backward
    loss_held: float  # what the chunked loss holds outside autograd from forward to backward
    loss_transient: float  # alive only at the loss's own peak (gradient buffers, one chunk's logits)
    vision: float = 0.0  # a VLM's vision tower and projector: saved without checkpointing (`vision_bytes`)
    vision_checkpointed: float = 0.0  # what they keep with gradient checkpointing
    layer_backward: float = 0.0  # a recomputed layer's backward beyond what it saved (the MLP's gradients)
    vision_backward: float = 0.0  # the vision tower's checkpointed backward (`vision_backward_bytes`)
    vision_forward: float = 0.0  # a frozen vision tower's forward, first (`frozen_tower_forward_bytes`)
    rotary: float = 0.0  # the rotary cos/sin tables (part of `head`): every layer reads them, to the end
    # checkpointing with frozen embeddings: enable_input_require_grads makes their output a leaf that
    # requires grad, which the graph keeps alive to the end of the backward
    embedding_leaf: float = 0.0

    @property
    def saved(self) -> float:
        """What autograd saves without checkpointing (what saved_tensors_hooks sees)."""
        return self.num_layers * self.per_layer + self.head + self.loss_saved + self.vision

    @property
    def logits_and_loss(self) -> float:
        return self.loss_held + self.loss_saved + self.loss_transient

    def peak(self, checkpointing: bool) -> float:
        """Peak bytes: the start of the backward (the loss's backward, every activation still saved),
        or with checkpointing the larger of the loss backward and one layer's recomputation and
        backward (what it saves again, its input being a kept one and the gradient from the layer above
        taking that input's place, plus its MLP's gradients), the vision tower's kept inputs alive
        throughout; or, last, the vision tower's own recomputation, once the language model's are freed;
        or, first, a frozen vision tower's forward (either setting)."""
        if not checkpointing:
            return max(self.saved + self.mask + self.loss_held + self.loss_transient, self.vision_forward)
        loss_step = self.head + self.loss_saved + self.loss_transient
        kept = self.num_layers * self.layer_input + self.mask + self.loss_held + self.vision_checkpointed
        kept += self.embedding_leaf
        layer_step = self.rotary + self.per_layer + self.layer_backward
        language = kept + max(loss_step, layer_step)
        # the merged input embeddings' gradient (layer_input's size) lives until the tower's backward ends
        tower = self.layer_input + self.vision_backward if self.vision_backward else 0.0
        return max(language, tower, self.vision_forward)


def activation_bytes(
    inv: ModelInventory,
    *,
    micro_batch_size: int,
    seq_len: int,
    attn_implementation: str,
    residual_bytes: int,
    compute_bytes: int,
    autocast: bool,
    adapter: Adapter | None = None,
    lora_dropout: float = 0.0,
    lora_bytes: int = 4,
    linear_out_bytes: int | None = None,
    lm_head_trainable: bool = True,
    embedding_trainable: bool = True,
    loss_chunk: int = 0,
    lm_head_plain: bool = True,
    rotary_rows: int | None = None,
    embedding_frozen: bool = False,
) -> Activations:
    """Bytes autograd saves in a Llama-style decoder layer for b rows of s tokens.

    With r = residual bytes, c = compute bytes, h hidden, q = heads*head_dim, k = kv_heads*head_dim,
    i intermediate, a heads, bs = b*s; "copies" = autocast with an fp32 residual (each Linear casts
    its input separately). Full fine-tuning, per layer:
      2 RMSNorms        2*((4 + r)*bs*h + 4*bs)        fp32 input, normalized input (for the weight
                                                       grad; not with frozen norms), rsqrt
      Linear inputs     bs*h*(3c or r) + bs*h*(2c or r) + c*bs*i   q/k/v, gate/up, down; o_proj
                                                       reads sdpa's saved output
      attention sdpa    c*bs*(2q + 2k') + 4*b*a*s      q, k, v, out, logsumexp, plus a c*b*s^2 mask;
                        + c*b*s^2                      k' = q when a mask makes transformers repeat
                                                       k/v to every head (packed or padded rows);
                                                       flash/flex: k' = k, no mask
      attention eager   4c*bs*q + (4 + c)*b*a*s^2      q, k, v (repeated), o_proj's contiguous input;
                                                       fp32 softmax and its c-dtype copy
      MLP               3c*bs*i                        gate output, silu output, up output (in the
                                                       input dtype r for 4-bit QLoRA linears)
    LoRA (frozen base): Linear layers save no input, norms only the fp32 input; each adapted Linear
    saves lora_A's input (its own c copy under autocast, else PEFT's cast to the LoRA dtype, shared
    by q/k/v and gate/up when no cast is needed; dropout: its output + a bool mask) and lora_A's
    output (bs*rank).
    Head: final norm, lm_head input (c*bs*h if trained), ids and labels, rotary cos/sin (per row, or
    once with `rotary_rows` 1); minus the
    first norm when the embeddings are frozen (its input needs no grad). Transformers' mask (bool
    b*s^2 for sdpa, r*b*s^2 float for eager) is shared by all layers.
    Gradient checkpointing keeps r*bs*h per layer and recomputes one layer at a time; that layer's
    backward holds what it saves again plus 2c*bs*i (down_proj's input gradient and the gate product's
    two gradients, less the product down_proj saved; measured on CPU in tests/unit/test_plan_ckpt_vlm.py).
    The rotary tables stay alive through it, and, with frozen embeddings (`embedding_frozen`), their
    r*bs*h output: checkpointing's enable_input_require_grads makes it a leaf that requires grad.
    Loss, full logits (model(...).loss; V vocabulary; measured on CPU, tests/unit/test_plan.py):
    the cross entropy saves its fp32 log-softmax (4*bs*V). The logits themselves are not kept: the
    log-softmax does not save its input, and the model output that holds them (and Accelerate's
    fp32 copy under autocast) is dropped once the loss is taken. The peak is the log-softmax's
    backward: the saved log-softmax, NLL's gradient and the log-softmax's gradient, three fp32
    buffers (12*bs*V), whatever the logits' dtype (the forward holds at most 10*bs*V: 16-bit logits,
    their fp32 copy and the log-softmax).
    Chunked loss (train.loss_chunk_size, `loss_chunk` tokens per chunk; finetune.losses.chunked_ce):
    no logits are held. A plain Linear head (`lm_head_plain`) computes its gradients in the forward:
    it holds d_hidden (r*bs*h) and, when the head trains, an fp32 d_weight (4*V*h) until backward;
    at a time, one chunk's fp32 logits and logsumexp's temporary (8*chunk*V), or, for a 16-bit
    matmul into a trained head, the chunk's 16-bit gradient and its [V x h] product for d_weight
    (c*chunk*V + c*V*h). Any other head (LoRA on lm_head, modules_to_save) is recomputed chunk by
    chunk in backward, where one chunk has the three fp32 buffers of the full-logits peak
    (12*chunk*V) while autograd sums the head's trainable weights' gradients over the chunks (in the
    compute dtype, before they become .grad).
    """
    b, s = micro_batch_size, seq_len
    bs = b * s
    h, i, a, vocab = inv.hidden_size, inv.intermediate_size, inv.num_heads, inv.vocab_size
    q, kv = inv.num_heads * inv.head_dim, inv.num_kv_heads * inv.head_dim
    r, c = residual_bytes, compute_bytes
    eager = attn_implementation == "eager"
    full = adapter is None or not adapter.targets
    norm = (4 + (r if full else 0)) * bs * h + 4 * bs
    if eager:
        attention = 3 * c * bs * q + (4 + (c if c != 4 else 0)) * b * a * s * s
    else:
        k_saved = q if attn_implementation == "sdpa" else kv
        attention = c * bs * (2 * q + 2 * k_saved) + 4 * b * a * s
        attention += c * b * s * s if attn_implementation == "sdpa" else 0
    if full:
        copies = autocast and r != c
        inputs = bs * h * ((3 * c if copies else r) + (2 * c if copies else r)) + c * bs * i
        inputs += c * bs * q if eager else 0  # the contiguous o_proj input
    else:
        inputs = _lora_inputs(
            adapter, lora_dropout, lora_bytes, autocast=autocast, eager=eager, c=c, r=r, bs=bs
        )
    # Rotary cos/sin: one table per row, or one for the batch when the model makes position ids itself
    # from 0..s (a VLM batch has none: finetune.data.batching.vision.collate_vlm; `rotary_rows` 1).
    rotary = 2 * r * (b if rotary_rows is None else rotary_rows) * s * inv.head_dim
    head = norm + (c * bs * h if lm_head_trainable else 0) + 16 * bs + rotary
    if not embedding_trainable:  # the first norm's input needs no grad: nothing saved there
        head -= norm
    if loss_chunk:
        chunk = min(loss_chunk, bs)
        if lm_head_plain:
            held = r * bs * h + (4 * vocab * h if lm_head_trainable else 0)
            per_chunk = 8 * chunk * vocab
            if lm_head_trainable and c != 4:
                per_chunk = max(per_chunk, c * chunk * vocab + c * vocab * h)
        else:  # autograd sums the head's weight gradients over the chunks before they become .grad
            head_lora = sum(
                adapter.rank * (m.in_features + m.out_features) for m in _head_targets(inv, adapter)
            )
            summed = (c if autocast else lora_bytes) * head_lora + (c * vocab * h if lm_head_trainable else 0)
            held, per_chunk = 0, 12 * chunk * vocab + summed
        loss = {"loss_saved": 0, "loss_held": held, "loss_transient": per_chunk}
    else:
        loss = {"loss_saved": 4 * bs * vocab, "loss_held": 0, "loss_transient": 8 * bs * vocab}
    return Activations(
        num_layers=inv.num_layers,
        per_layer=2 * norm + attention + 3 * (linear_out_bytes or c) * bs * i + inputs,
        layer_input=r * bs * h,
        # down_proj's input gradient and the gate product's two (silu output, up): three, less the product
        # down_proj saved, freed by its backward
        layer_backward=2 * (linear_out_bytes or c) * bs * i,
        rotary=rotary,
        embedding_leaf=r * bs * h if embedding_frozen else 0,
        head=head,
        mask=(1 if attn_implementation == "sdpa" else r if eager else 0) * b * s * s,
        **loss,
    )


def _lora_inputs(
    adapter: Adapter, dropout: float, lora_bytes: int, *, autocast: bool, eager: bool, c: int, r: int, bs: int
) -> float:
    """What LoRA saves in one decoder layer: lora_A's input and output per adapted Linear."""
    targets = [m for m in adapter.targets if m.layer is not None and m.kind == "linear"]
    layer = [m for m in targets if m.layer == targets[0].layer] if targets else []
    saved_input = c if autocast else lora_bytes  # the dtype lora_A sees and saves
    saved = sum(bs * adapter.rank * saved_input for _ in layer)  # lora_A output, saved by lora_B
    shared: set[str] = set()
    for m in layer:
        group = _input_group(m.name)
        x_bytes = r if group in ("attn_in", "mlp_in") else c  # dtype of the tensor the Linear reads
        if dropout > 0:  # each adapter: its dropout output and a bool mask
            saved += (saved_input + 1) * bs * m.in_features
        elif autocast or x_bytes != lora_bytes:  # PEFT's / autocast's cast: one copy per adapter
            saved += saved_input * bs * m.in_features
        elif group not in shared:  # same tensor for q/k/v and gate/up; sdpa already saved o's input
            shared.add(group)
            saved += 0 if group == "attn_out" and not eager else x_bytes * bs * m.in_features
    return saved


def _head_targets(inv: ModelInventory, adapter: Adapter | None) -> list:
    return [m for m in (adapter.targets if adapter else ()) if m.name == inv.output_name]


def _input_group(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    return {
        "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
        "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_out",
    }.get(leaf, name)  # fmt: skip


@dataclass(frozen=True)
class ImageInput:
    """What the vision tower sees per row: images, patches per image and pixel values' bytes."""

    images_per_row: float
    patches_per_image: int  # over all crops of an image (Idefics3 splits large images into crops)
    pixel_bytes_per_image: int  # the fp32 pixel_values the collator makes
    source: str  # how the planner got these numbers (said in the plan's assumptions)


def vision_bytes(
    vision: VisionInventory,
    images: ImageInput,
    *,
    micro_batch_size: int,
    tower_trains: bool,
    projector_trains: bool,
    residual_bytes: int,
    compute_bytes: int,
    checkpointing: bool,
    lora_rank: int = 0,
    lora_dropout: float = 0.0,
) -> float:
    """Bytes autograd saves in a VLM's vision tower and projector for one micro batch (measured on CPU
    against saved_tensors_hooks in tests/unit/test_plan_vlm.py).

    With p = patches in the micro batch (rows x images x patches), h/i/a the tower's hidden,
    intermediate and heads, n the images' crops, r and c the residual and compute bytes, per layer:
      2 norms        2*(r*p*h + 8*p)             input and mean/rstd (LayerNorm; RMSNorm: 4*p)
      q/k/v input    r*p*h                       the normalised input, shared
      attention      4c*p*h + 4*a*p              q, k, v, output (the out projection reads it), logsumexp
      MLP            c*p*h + 2c*p*i              fc1's input, its output, the activation's output
                     (+ c*p*i gated: gate, up, act, product)
    plus the patch embedding's input (the pixels) and position ids, and the final norm.
    Only what the backward needs is saved: a frozen tower (model.train_vision_tower false) saves
    nothing, since neither its input nor its weights need a gradient; a trained projector then saves
    only its input (c*p*h, before any merge of patches). With checkpointing a trained tower keeps
    one r*p*h input per layer (its one-layer recomputation runs after the language model's), and so
    would a frozen one whose input embeddings checkpointing makes require grad
    (`VisionInventory.checkpointing_input_grad`): its layers are checkpointed, the final norm saves its
    input and mean/rstd (r*p*h + 8*p), and the tower runs a backward that updates nothing. Training
    removes that hook from a frozen tower (finetune.model.vlm.release_frozen_towers), so it saves nothing.
    LoRA on the tower (`lora_rank`): the frozen patch embedding saves no pixels and the first norm
    nothing (its input needs no gradient); each adapted linear adds lora_A's output (c*p*rank) and,
    with lora_dropout, the dropout's output and mask ((c+1)*p*in_features).
    """
    p = micro_batch_size * images.images_per_row * images.patches_per_image
    pixels = micro_batch_size * images.images_per_row * images.pixel_bytes_per_image
    r, c, h = residual_bytes, compute_bytes, vision.hidden_size
    projector = c * p * h if projector_trains else 0
    norm = r * p * h + 8 * p
    if not tower_trains:
        if checkpointing and vision.checkpointing_input_grad:
            return projector + vision.num_layers * r * p * h + norm
        return projector
    per_layer = _tower_layer_bytes(vision, p, r, c, lora_rank, lora_dropout)
    fixed = pixels + 8 * p + norm + projector
    if lora_rank:  # with checkpointing the final norm's input needs a gradient: it stays
        fixed -= pixels + (0 if checkpointing else norm)
    if checkpointing:
        return fixed + vision.num_layers * r * p * h
    return fixed + vision.num_layers * per_layer


def frozen_tower_forward_bytes(
    vision: VisionInventory,
    images: ImageInput,
    *,
    micro_batch_size: int,
    tower_trains: bool,
    residual_bytes: int,
    compute_bytes: int,
    text_embeddings: float,
) -> float:
    """The peak of a frozen vision tower's forward, which saves nothing for a backward (its hook removed
    under checkpointing, finetune.model.vlm.release_frozen_towers) and so runs like inference: the text
    embeddings (`text_embeddings`, made first), a copy of the pixels (the real images picked out),
    four p*h tensors in the last layer (the patch embeddings' sum, the residual, the norm's output
    and fc1's input) and the MLP's intermediates, fc1's and the activation's outputs (2c*p*i; gated,
    3c*p*i). Measured on CPU in tests/unit/test_plan_ckpt_vlm.py (a wide-MLP tower, where it is the
    step's peak). 0 for a tower that trains: its backward comes later and is larger."""
    if tower_trains:
        return 0.0
    p = micro_batch_size * images.images_per_row * images.patches_per_image
    pixels = micro_batch_size * images.images_per_row * images.pixel_bytes_per_image
    r, c = residual_bytes, compute_bytes
    mlp = (3 if _gated(vision) else 2) * c * p * vision.intermediate_size
    return text_embeddings + pixels + 4 * r * p * vision.hidden_size + mlp


def _tower_layer_bytes(
    vision: VisionInventory, p: float, r: int, c: int, lora_rank: int = 0, lora_dropout: float = 0.0
) -> float:
    """What one trained vision tower layer saves for p patches (see `vision_bytes`)."""
    h, i = vision.hidden_size, vision.intermediate_size
    norm = r * p * h + 8 * p
    attention = 4 * c * p * h + 4 * vision.num_heads * p
    mlp = c * p * h + (3 if _gated(vision) else 2) * c * p * i
    per_layer = 2 * norm + r * p * h + attention + mlp
    if lora_rank:
        per_layer += len(vision.tower_linears) / vision.num_layers * c * p * lora_rank
        if lora_dropout > 0:
            per_layer += sum((c + 1) * p * m.in_features for m in vision.tower_linears) / vision.num_layers
    return per_layer


def _gated(vision: VisionInventory) -> bool:
    return any(m.name.endswith("gate_proj") for m in vision.tower_linears)


def vision_backward_bytes(
    vision: VisionInventory,
    images: ImageInput,
    *,
    micro_batch_size: int,
    tower_trains: bool,
    residual_bytes: int,
    compute_bytes: int,
    lora_rank: int = 0,
    lora_dropout: float = 0.0,
) -> float:
    """The vision tower's backward under gradient checkpointing, which comes last (0 when the tower runs
    none): its kept layer inputs (L*r*p*h; a trained tower's patch embedding also its pixels and
    position ids) and one layer recomputed and differentiated: what it saves again (a frozen layer: its
    norms, attention and the activation's input, c*p*i, 3c*p*i gated, as its linears save nothing), its
    input being a kept one and the gradient from above taking its place, plus its MLP's input gradients
    (c*p*i, 2c*p*i gated: fc2's input gradient and the activation's, less fc2's saved input, as for a
    decoder layer; a trained fc2's weight gradient at its own backward; a frozen fc2 saved none, so one
    c*p*i more). The final norm's and the projector's
    saved tensors are freed by then (measured on CPU in tests/unit/test_plan_ckpt_vlm.py)."""
    if not (tower_trains or vision.checkpointing_input_grad):
        return 0.0
    p = micro_batch_size * images.images_per_row * images.patches_per_image
    r, c, h, i = residual_bytes, compute_bytes, vision.hidden_size, vision.intermediate_size
    gated = _gated(vision)
    kept = vision.num_layers * r * p * h
    mlp_grads = (2 if gated else 1) * c * p * i
    if tower_trains:
        pixels = micro_batch_size * images.images_per_row * images.pixel_bytes_per_image
        kept += 0 if lora_rank else pixels + 8 * p
        # A trained fc2 also makes its weight's gradient (r*i*h, the weights' dtype) while its input
        # gradient is alive, before the activation's backward frees fc2's input.
        weight_grad = 0 if lora_rank else r * i * h
        mlp_grads = max(mlp_grads, c * p * i + weight_grad)
        return kept + _tower_layer_bytes(vision, p, r, c, lora_rank, lora_dropout) + mlp_grads
    norm = r * p * h + 8 * p
    attention = 4 * c * p * h + 4 * vision.num_heads * p
    return kept + 2 * norm + attention + (3 if gated else 1) * c * p * i + mlp_grads + c * p * i
