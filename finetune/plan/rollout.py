"""Online RL's rollout in the plan (a `train.objective` of kind online: grpo, rloo; the table is
finetune.recipe.objectives).

An online step first samples completions (the rollout, finetune.objectives.online), then trains on
them. The two never hold their working sets at once, so the step's peak is the larger of the two, each
on top of what stays on the device through both: weights, optimizer states, the reference model and the
CUDA allowance (gradients are set to None after every update, except DeepSpeed's partitions and DDP's
buckets, which stay).

The rollout's own parts (`rollout_plan`):
* generation with the transformers backend (`generation_bytes`, measured on CPU in
  tests/unit/test_plan_online.py): the KV cache, the growing ids, one step's logits and sampling, or the
  prompts' forward (prefill), whichever is larger;
* a sharded model's weights for the generate call (grpo.sharded_generation): whole on every process
  (gather), or the units one forward gathers (layerwise);
* the log-prob passes without gradient (`logprob_pass_bytes`): the reference's (beta > 0) and the
  sampling policy's (num_iterations > 1, or a KL paid from the reward), one micro-batch at a time, after
  generation (the KV cache is gone by then);
* vLLM (grpo.generation_backend: vllm): the engine's share of the device
  (grpo.vllm_gpu_memory_utilization) is not training's, so the fit check uses the rest; with
  vllm_enable_sleep_mode the engine gives its share back during training steps (its weights go to the
  host), so only the rollout has to fit beside it. A sharded model is gathered whole for every sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from finetune.accelerate_config import DistributedSetup
from finetune.plan.inventory import Adapter, ModelInventory, gib_text
from finetune.plan.states import Layout, Part, gathered_bytes
from finetune.recipe.objectives import OBJECTIVES

# What stays on the device through the rollout, by the training table's part names (gradients only
# under DeepSpeed: the other engines set them to None after every update, before the next rollout).
RESIDENT = (
    "weights",
    "optimizer states",
    "DDP gradient buckets",
    "reference model",
    "CUDA context + fragmentation",
)
# The sampler's bytes per (sequence x vocabulary) element, its input included: the tempered scores,
# the probabilities and the -inf/0 output (SeededSampler); top_p sorts: sorted scores, int64 indices,
# the softmax and its cumsum, two bool masks and the masked scores (transformers' TopPLogitsWarper).
SAMPLER_BYTES, TOP_P_BYTES = 12, 26
LSE_CHUNK_ELEMENTS = 2**25  # finetune.losses.preference._CHUNK_ELEMENTS: the log-prob pass's logsumexp chunk


def online_section(recipe):
    """The recipe's online section (grpo) when train.objective is of kind online, else None."""
    spec = OBJECTIVES.get(recipe.train.objective)
    if spec is None or spec.kind != "online":
        return None
    return getattr(recipe, spec.section)


# -------------------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Generation:
    """Bytes of one generate call of the transformers backend (see `generation_bytes`)."""

    sequences: int  # rows of the call: prompts x completions each
    prompt_tokens: int
    cached_tokens: int  # the KV cache's length at the last step: prompt + max_new_tokens - 1
    kv_cache: float  # at the last step
    kv_growth: float  # one layer's keys copied as the cache grows (torch.cat)
    ids: float  # input_ids and attention mask (int64), one copy as they grow
    held_scores: float  # the previous step's fp32 logits and scores, alive through the next forward
    step_activations: float  # one new token per sequence through a decoder layer
    step_logits: float  # one step's logits, generate's fp32 copy, the previous scores and the sampler
    prompt_kv: float  # the KV cache after the prompt forward
    prefill: float  # the prompt forward's activations (one layer at a time) and the prompts' ids
    autocast_copies: float  # 16-bit casts of trainable fp32 weights autocast keeps through a forward
    merged_weights: float = 0.0  # LoRA merged into new copies of the adapted weights (grpo.merged_generation)
    # autocast's casts made after the decoder layers' peak (the output head's, the last down_proj's): alive
    # with the others when a step's logits come out of the head inside autocast
    late_autocast_copies: float = 0.0
    head_logits: float = 0.0  # one step's logits as the head makes them (compute dtype), under autocast
    compute_dtype_copy: bool = False  # merged_weights is grpo.generation_dtype's copy of every weight

    @property
    def decode_peak(self) -> float:
        forward = self.kv_growth + self.held_scores + self.step_activations + self.autocast_copies
        head = 0.0
        if self.autocast_copies:  # the head's moment inside autocast: every cast alive, the logits made
            head = self.held_scores + self.step_activations + self.autocast_copies + self.late_autocast_copies
            head += self.head_logits
        return self.merged_weights + self.kv_cache + self.ids + max(forward, self.step_logits, head)

    @property
    def prefill_peak(self) -> float:
        return self.merged_weights + self.prompt_kv + self.prefill + self.autocast_copies

    @property
    def peak(self) -> float:
        return max(self.decode_peak, self.prefill_peak)


def generation_bytes(
    inv: ModelInventory,
    *,
    sequences: int,
    prompt_tokens: int,
    max_new_tokens: int,
    residual_bytes: int,
    compute_bytes: int,
    autocast: bool,
    attn_implementation: str,
    sampling: bool = True,
    top_p: float = 1.0,
    autocast_copies: float = 0.0,
    fp32_lora: tuple[str, ...] = (),
    distinct_prompts: int = 0,
) -> Generation:
    """One `generate` call (finetune.generation.transformers_backend.generate_ids) of N sequences:
    left-padded prompts of up to P tokens, each sampled to M new tokens, with transformers' DynamicCache.

    With L layers, kv KV heads of d dims, h hidden, q = heads x d, i intermediate, V vocabulary, r and c
    the residual and compute bytes, k = max(r, c) (the rotary tables are in the residual dtype, so the
    rotated keys are promoted to it; values stay in c), T = P + M - 1 (the last token is never fed back):
      KV cache       L x kv x d x (k + c) x N x T, plus one layer's keys N x kv x d x k x T (torch.cat
                     makes the grown copy while the old one is alive)
      ids            3 x 8 x N x (P + M)                 input_ids and attention mask, one growing copy
      step           N x V x (lo + 4 + 4 + s)            the model's logits (lo: 4 under autocast,
                                                         Accelerate casts them; else c), generate's fp32
                                                         copy of the last position, the previous step's
                                                         scores, and the sampler: s = 12 (tempered,
                                                         probabilities, output) or 26 with top_p (its
                                                         sort); greedy: N x V x (lo + 8)
      during a forward  the previous step's fp32 logits and scores (8 x N x V), the grown keys and the
                     new tokens' residual streams (as the prefill's, P = 1)
      prefill        KV of P tokens + N x P x (3r x h + r x h + max(attention, 3c x i)) + rotary
                     2r x N x P x d + mask (sdpa: N x P x P bool) + ids 16 x N x P
                     (the embeddings, the layer input, the residual and the normed input; sdpa with a
                     padding mask repeats k and v to every head; eager adds its fp32 softmax)
    Under autocast the 16-bit casts of trainable fp32 weights are cached until each forward ends
    (`autocast_copies`). `fp32_lora` names the layer's Linears (q_proj, ..., down_proj) whose PEFT LoRA
    adapters run in fp32 on c-byte activations (PEFT's generate bypasses Accelerate's autocast): each casts
    its input to fp32 (4 x in) and adds its fp32 output to the promoted base output (c + 12 bytes x out
    at once), the prompt forward's largest moments (`_prefill_layer`). The peak is the last step's or the
    prompt forward's, whichever is larger. `distinct_prompts` u > 0: the prompts' cache is made once per
    prompt (transformers_backend.generate_batch: u rows of P - 1 tokens, then repeated for the N
    sequences), so the prompt forward is u x (P - 1) tokens; the repeated cache is the last step's less.
    """
    n, p = sequences, prompt_tokens
    rows, fed = (distinct_prompts, p - 1) if distinct_prompts and p > 1 else (n, p)  # the prompt forward's
    cached = p + max_new_tokens - 1
    r, c = residual_bytes, compute_bytes
    k = max(r, c)
    h, d, vocab = inv.hidden_size, inv.head_dim, inv.vocab_size
    kv = inv.num_kv_heads * d
    per_token = inv.num_layers * kv * (k + c)
    logits = 4 if autocast else c
    if sampling:
        held = 8 * n * vocab
        step = n * vocab * (logits + 8 + (TOP_P_BYTES if top_p < 1 else SAMPLER_BYTES))
    else:  # greedy: generate's fp32 copy is the score; argmax adds nothing
        held, step = 4 * n * vocab, n * vocab * (logits + 8)
    eager = attn_implementation == "eager"
    streams = 3 if inv.num_layers > 1 else 2  # the embeddings' output is the first layer's input

    def streams_of(tokens: int) -> float:  # the residual streams, normed input and rotary tables
        return tokens * (streams * r * h + r * h) + 2 * r * tokens * d

    mask = (r if eager else 1) * rows * fed * fed if attn_implementation in ("sdpa", "eager") else 0
    layer = _prefill_layer(
        inv, rows, fed, r=r, c=c, k=k, attn_implementation=attn_implementation, fp32_lora=fp32_lora
    )
    prefill = streams_of(rows * fed) + layer + mask + 16 * rows * fed
    return Generation(
        sequences=n,
        prompt_tokens=p,
        cached_tokens=cached,
        kv_cache=per_token * n * cached,
        kv_growth=kv * k * n * cached,
        ids=3 * 8 * n * (p + max_new_tokens),
        held_scores=held,
        step_activations=streams_of(n),
        step_logits=step,
        prompt_kv=per_token * rows * fed,
        prefill=prefill,
        autocast_copies=autocast_copies,
    )


def _prefill_layer(
    inv: ModelInventory, n: int, p: int, *, r: int, c: int, k: int, attn_implementation: str, fp32_lora=()
) -> float:
    """The largest moment of one decoder layer's forward without grad over n x p tokens, beyond the
    residual streams: attention (the rotated query, k and v repeated to every head by sdpa with a
    mask, the output; autocast's casts back to c; eager's softmax) or the MLP (its three i-sized
    intermediates), and with fp32 LoRA (see `generation_bytes`) the adapted projections' moments."""
    tokens = n * p
    h, d, i = inv.hidden_size, inv.head_dim, inv.intermediate_size
    q, kv = inv.num_heads * d, inv.num_kv_heads * d
    repeated = q if attn_implementation in ("sdpa", "eager") else kv  # sdpa with a mask repeats k/v
    attention = tokens * (q * k + repeated * (k + c) + q * c)
    if k != c:  # autocast casts the promoted query and keys back to the compute dtype for the kernel
        attention += c * tokens * (q + repeated)
    if attn_implementation == "eager":
        attention += (4 + c) * n * inv.num_heads * p * p
    mlp = 3 * c * tokens * i  # act(gate), up, their product
    if fp32_lora:
        lora = set(fp32_lora)

        def adapted(name: str, inputs: int, out: int, alive: int) -> int:
            # the input's fp32 copy, the base output, its fp32 promotion, the scaled LoRA output, the sum
            return alive + 4 * inputs + (c + 12) * out if name in lora else 0

        attention = max(
            attention,
            tokens * adapted("q_proj", h, q, 0),
            tokens * adapted("k_proj", h, kv, c * q),  # the query is made
            tokens * adapted("o_proj", q, h, 0),
        )
        mlp = max(
            mlp,
            tokens * adapted("gate_proj", h, i, 0),
            tokens * adapted("up_proj", h, i, c * i),  # act(gate) is alive
            tokens * adapted("down_proj", i, h, c * i),  # the product is its input
        )
    return max(attention, mlp)


def logprob_pass_bytes(
    inv: ModelInventory,
    *,
    tokens: int,
    residual_bytes: int,
    compute_bytes: int,
    autocast: bool,
    attn_implementation: str,
    temperature: float,
    autocast_copies: float = 0.0,
) -> float:
    """A forward without gradient over one packed row of `tokens` (finetune.objectives.rollout.
    token_logps_at): one layer's activations at a time (as the prompt forward, with a block-diagonal
    mask), or the logits over every position (4 bytes under autocast, else c; Accelerate's fp32 cast of
    c-byte logits holds both for a moment) with, at once, either their copy divided by the temperature
    or one fp32 chunk of the log-sum-exp (finetune.losses.preference); whichever is larger, plus
    autocast's cached weight casts. Measured on CPU: tests/unit/test_plan_online.py."""
    layer = generation_bytes(
        inv, sequences=1, prompt_tokens=tokens, max_new_tokens=1, residual_bytes=residual_bytes,
        compute_bytes=compute_bytes, autocast=autocast, attn_implementation=attn_implementation,
    ).prefill  # fmt: skip
    vocab = inv.vocab_size
    lo = 4 if autocast else compute_bytes
    chunk = min(tokens, max(1, LSE_CHUNK_ELEMENTS // vocab)) * vocab
    # logsumexp's exp of one chunk (and the chunk's fp32 copy of 16-bit logits), or the tempered copy
    # while the logits are still alive
    second = max(4 * chunk * (2 if lo != 4 else 1), tokens * vocab * lo if temperature != 1.0 else 0)
    logits = tokens * vocab * lo + second
    if autocast:
        logits = max(logits, tokens * vocab * (compute_bytes + 4))
    return max(layer, logits) + autocast_copies


# ------------------------------------------------------------------------------------------ rollout


@dataclass(frozen=True)
class Rollout:
    """The rollout phase of an online step on one device: `resident` (the training table's parts that
    stay), `parts` (counted on top of them), `other` (the rollout's other working set, not at its peak)."""

    resident: float
    parts: tuple[Part, ...]
    other: tuple[Part, ...] = ()
    generation: Generation | None = None  # the transformers backend's call (None with vLLM)
    prompts_per_call: int = 0
    vllm_utilization: float = 0.0  # the vLLM engine's share of the device (0: no vLLM)
    vllm_sleep: bool = False  # the engine frees its share during training steps
    vllm_minimum: float = 0.0  # the least the engine needs: its weights and one sequence's KV cache
    vllm_weights: float = 0.0

    @property
    def total_gpu(self) -> float:
        return self.resident + sum(p.gpu_bytes for p in self.parts)

    def vllm_bytes(self, gpu_memory: float) -> float:
        return self.vllm_utilization * gpu_memory

    def headroom(self, gpu_memory: float, training: float) -> float:
        """Bytes left at the tighter of the two phases (negative: over by that much)."""
        if not self.vllm_utilization:
            return gpu_memory - max(training, self.total_gpu)
        engine = self.vllm_bytes(gpu_memory)
        if self.vllm_sleep:  # training steps run with the engine asleep
            room = min(gpu_memory - training, gpu_memory - engine - self.total_gpu)
        else:
            room = gpu_memory - engine - max(training, self.total_gpu)
        return min(room, engine - self.vllm_minimum)


def rollout_plan(
    inv: ModelInventory,
    recipe,
    engine: DistributedSetup,
    layout: Layout,
    adapter: Adapter,
    training_parts: list[Part],
    *,
    micro_batch_size: int,
) -> Rollout:
    """The rollout of an online recipe under `engine` with training micro-batches of
    `micro_batch_size` completions (see the module docstring)."""
    settings, train = online_section(recipe), recipe.train
    resident = sum(
        p.gpu_bytes
        for p in training_parts
        if p.name in RESIDENT or (p.name == "gradients" and engine.kind == "deepspeed")
    )
    prompts_per_step = train.micro_batch_size * train.gradient_accumulation_steps // settings.num_generations
    prompts = min(settings.generation_batch_size, max(1, prompts_per_step))
    whole = _whole_weights(inv, layout, adapter, engine)
    generation = None
    if settings.generation_backend == "vllm":
        note = "gathered from the shards after every update, while the engine loads them"
        parts = [Part("whole weights for the vLLM sync", whole.gpu_bytes, note=note)] if whole else []
    else:
        generation = generation_of(inv, recipe, engine, layout, adapter, prompts)
        parts = _generation_parts(generation, settings, recipe, prompts)
        gather = _generation_gather(inv, layout, engine, settings.sharded_generation, whole)
        parts += [gather] if gather is not None else []
    copies = logprob_autocast_copies(inv, adapter, recipe, layout)
    logprobs = _logprob_parts(inv, recipe, settings, engine, layout, copies, micro_batch_size)
    counted, other = parts, logprobs
    if sum(p.gpu_bytes for p in logprobs) > sum(p.gpu_bytes for p in parts):
        counted, other = logprobs, parts
    if generation is not None:
        return Rollout(resident, tuple(counted), tuple(other), generation, prompts)
    dtype_bytes = _vllm_weight_bytes(recipe, engine)
    engine_weights = inv.total * dtype_bytes
    max_len = settings.vllm_max_model_len or recipe.data.sequence_len + settings.max_new_tokens
    per_token = inv.num_layers * inv.num_kv_heads * inv.head_dim * 2 * dtype_bytes
    return Rollout(
        resident, tuple(counted), tuple(other), None, prompts,
        vllm_utilization=settings.vllm_gpu_memory_utilization, vllm_sleep=settings.vllm_enable_sleep_mode,
        vllm_minimum=engine_weights + per_token * max_len, vllm_weights=engine_weights,
    )  # fmt: skip


def generation_of(
    inv: ModelInventory, recipe, engine: DistributedSetup, layout: Layout, adapter: Adapter, prompts: int
) -> Generation:
    """The rollout's generate call as training makes it: `prompts` prompts a call. A PEFT model generates
    through PEFT's generate, which calls the base model's forward and so bypasses the autocast that
    Accelerate wraps around the PEFT model's: its activations are in the base weights' dtype, and fp32
    LoRA adapters on 16-bit activations compute in fp32 (`generation_bytes`'s fp32_lora). A plain model
    keeps Accelerate's autocast (and its cached casts of trainable fp32 weights)."""
    settings = online_section(recipe)
    r, c, autocast, fp32_lora = layout.residual_bytes, layout.compute_bytes, layout.autocast, ()
    merged = 0.0
    if recipe.lora.enable_lora:
        c, autocast = r, False
        fsdp_mixed = engine.kind == "fsdp" and recipe.train.mixed_precision != "no"  # LoRA cast to bf16
        if merges_for_generation(recipe, engine):  # the plain layers run: no adapter arithmetic
            merged = float(adapted_weights(adapter) * r)
        elif layout.lora_bytes == 4 and c != 4 and not fsdp_mixed:
            first = [m for m in adapter.targets if m.layer is not None and m.kind == "linear"]
            fp32_lora = tuple(m.name.rsplit(".", 1)[-1] for m in first if m.layer == first[0].layer)
    cast = getattr(settings, "generation_dtype", None) is not None
    if cast:  # grpo.generation_dtype: 16-bit activations, and a 16-bit copy of the weights (adapters merged)
        r = c = 2
        autocast, fp32_lora, merged = False, (), generation_dtype_copy(inv, recipe, adapter)
    gen = generation_bytes(
        inv,
        sequences=prompts * settings.num_generations,
        prompt_tokens=recipe.data.sequence_len,
        max_new_tokens=settings.max_new_tokens,
        residual_bytes=r,
        compute_bytes=c,
        autocast=autocast,
        attn_implementation=recipe.model.attn_implementation,
        top_p=settings.top_p,
        autocast_copies=0.0 if cast else generation_autocast_copies(inv, recipe, layout),
        fp32_lora=fp32_lora,
        distinct_prompts=prompts if prefills_once(recipe, engine) else 0,
    )
    late = late_autocast_copies(inv, recipe, layout) if gen.autocast_copies else 0.0
    head = gen.sequences * inv.vocab_size * c if late else 0.0
    return dataclasses.replace(
        gen, merged_weights=merged, late_autocast_copies=late, head_logits=head, compute_dtype_copy=cast
    )


def generation_dtype_copy(inv: ModelInventory, recipe, adapter: Adapter) -> float:
    """Bytes of the copy grpo.generation_dtype makes while generating (finetune.model.adapters.merged_adapters):
    every weight in 2 bytes when the weights are in another dtype; weights already in that dtype are used as
    they are, and only the merged LoRA weights are new (DoRA, which does not merge: its adapters cast)."""
    import torch

    from finetune.model.build import weight_dtype

    dtype = getattr(torch, online_section(recipe).generation_dtype)
    if weight_dtype(recipe.model, recipe.lora, recipe.train.mixed_precision) != dtype:
        return float(inv.total * 2)
    if not recipe.lora.enable_lora:
        return 0.0
    if recipe.lora.use_dora:
        return float(adapter.lora_params * 2)
    return float(adapted_weights(adapter) * 2)


def adapted_weights(adapter: Adapter) -> int:
    """Elements of the adapted layers' weights: what merging LoRA into new copies of them makes."""
    return sum(m.in_features * m.out_features for m in adapter.targets)


def prefills_once(recipe, engine: DistributedSetup) -> bool:
    """Whether the transformers backend computes each prompt's cache once for its completions
    (transformers_backend.generate_ids): several completions a prompt, a text model, and not generating
    layer by layer across processes (grpo.sharded_generation layerwise on sharded weights)."""
    settings = online_section(recipe)
    layerwise = settings.sharded_generation == "layerwise" and _weights_sharded(engine)
    return (
        settings.num_generations > 1 and getattr(recipe.model, "kind", "causal_lm") != "vlm" and not layerwise
    )


def merges_for_generation(recipe, engine: DistributedSetup) -> bool:
    """Whether the transformers backend generates from merged LoRA weights (grpo.merged_generation; null:
    on CPU processes, as the backend decides on the model's device; as finetune.model.adapters.merged_adapters
    decides on the model: not a 4-bit base, DoRA or sharded weights)."""
    settings, lora = online_section(recipe), recipe.lora
    sharded = engine.kind == "fsdp" or (engine.kind == "deepspeed" and engine.zero_stage == 3)
    asked = engine.use_cpu if settings.merged_generation is None else settings.merged_generation
    return bool(
        asked and lora.enable_lora and not lora.enable_qlora and not lora.use_dora and not sharded
    )  # fmt: skip


def _generation_parts(gen: Generation, settings, recipe, prompts: int) -> list[Part]:
    """The generate call's lines at its peak (they sum to `gen.peak`): the last step's forward or its
    logits and sampling, or the prompt forward."""
    shape = (
        f"{gen.sequences} sequences (grpo.generation_batch_size {settings.generation_batch_size} -> {prompts} "
        f"prompts a call x num_generations {settings.num_generations})"
    )
    kv = "2 (k, v) x layers x KV heads x head_dim x bytes"
    if gen.prefill_peak > gen.decode_peak:
        parts = [
            Part(
                "KV cache (generate, prompts)",
                gen.prompt_kv,
                note=f"{kv} x {shape} x {gen.prompt_tokens} tokens (data.sequence_len), at the prompt forward "
                "(the call's peak)",
            ),
            Part(
                "prompt forward (generate)",
                gen.prefill,
                note="one decoder layer's activations over every prompt token, without grad; ids",
            ),
        ]
        return parts + ([_copies_part(gen)] if gen.autocast_copies else []) + _merged_part(gen)
    lengths = (
        f"{gen.cached_tokens} tokens (data.sequence_len {recipe.data.sequence_len} + grpo.max_new_tokens "
        f"{settings.max_new_tokens} - 1)"
    )
    forward = gen.kv_growth + gen.held_scores + gen.step_activations + gen.autocast_copies
    if gen.step_logits >= forward:
        note = (
            "the last step's: the model's logits, generate's fp32 copy, the previous scores, the sampler's "
            f"tempered scores, probabilities and output{' (+ top_p sort)' if settings.top_p < 1 else ''}; ids"
        )
        return [
            Part("KV cache (generate)", gen.kv_cache, note=f"{kv} x {shape} x {lengths}"),
            Part("logits + sampling (generate)", gen.step_logits + gen.ids, note=note),
            *_merged_part(gen),
        ]
    note = "the last step's forward: the previous step's fp32 logits and scores, the new tokens' hidden states; ids"
    parts = [
        Part(
            "KV cache (generate)",
            gen.kv_cache + gen.kv_growth,
            note=f"{kv} x {shape} x {lengths}, + one layer's keys as the cache grows",
        ),
        Part("scores + ids (generate)", gen.held_scores + gen.step_activations + gen.ids, note=note),
    ]
    return parts + ([_copies_part(gen)] if gen.autocast_copies else []) + _merged_part(gen)


def _merged_part(gen: Generation) -> list[Part]:
    if not gen.merged_weights:
        return []
    note = (
        "the adapted weights with LoRA merged in, new copies while generating (grpo.merged_generation, "
        "by default on CPU processes; false: none, the adapters computed at every token)"
    )
    name = "merged LoRA weights (generate)"
    if gen.compute_dtype_copy:
        name, note = (
            "weights in generation_dtype (generate)",
            "weights copied to 2 B (or only the merged ones where already), LoRA merged in",
        )
    return [Part(name, gen.merged_weights, note=note)]


def _copies_part(gen: Generation) -> Part:
    return Part(
        "autocast weight copies (generate)",
        gen.autocast_copies,
        note="bf16 casts of trainable fp32 matmul weights, cached until each forward ends",
    )


def _logprob_parts(
    inv, recipe, settings, engine: DistributedSetup, layout: Layout, copies: float, micro: int
) -> list[Part]:
    """The log-prob passes without gradient after generation, and a sharded model's gathered units."""
    whose = []
    if settings.beta > 0:
        whose.append(f"the reference's (grpo.beta {settings.beta:g})")
    if settings.num_iterations > 1 or (settings.kl_in_reward and settings.beta > 0):
        reason = (
            f"num_iterations {settings.num_iterations}" if settings.num_iterations > 1 else "kl_in_reward"
        )
        whose.append(f"the sampling policy's ({reason})")
    if not whose:
        return []
    tokens = training_tokens(micro, recipe, settings)
    nbytes = logprob_pass_bytes(
        inv, tokens=tokens, residual_bytes=layout.residual_bytes, compute_bytes=layout.compute_bytes,
        autocast=layout.autocast, attn_implementation=recipe.model.attn_implementation,
        temperature=settings.temperature, autocast_copies=copies,
    )  # fmt: skip
    note = (
        f"{' and '.join(whose)} log-probs, no grad: one micro-batch of {micro} completions packed in "
        f"{tokens} tokens at a time, after generation"
    )
    parts = [Part("log-prob passes (rollout)", nbytes, note=note)]
    units = gathered_bytes(inv, layout, engine, 0.0)
    if units is not None:
        parts.append(
            Part("gathered params (log-prob passes)", units.gpu_bytes, note="as a training forward's")
        )
    return parts


def generation_autocast_copies(inv: ModelInventory, recipe, layout: Layout) -> float:
    """Bytes of the 16-bit casts autocast caches in a generate call's forward by the time its decoder
    layers peak: those of fp32 matmul weights that require grad (frozen ones are cast op by op and
    freed), less the output head's and the last layer's down_proj, cast after the last layer's MLP
    peak (measured on CPU: tests/unit/test_plan_online.py). None for a PEFT model, which generates
    without Accelerate's autocast (`generation_of`)."""
    if not layout.autocast or layout.compute_bytes == 4 or recipe.lora.enable_lora:
        return 0.0
    # full fine-tuning: every matmul weight trains (finetune.plan.states._autocast_copies)
    return layout.autocast_copies - late_autocast_copies(inv, recipe, layout)


def late_autocast_copies(inv: ModelInventory, recipe, layout: Layout) -> float:
    """The casts `generation_autocast_copies` leaves out (the output head's and the last layer's
    down_proj): alive with the others when a decode step's logits are made."""
    if not layout.autocast or layout.compute_bytes == 4 or recipe.lora.enable_lora:
        return 0.0
    late = [m for m in inv.linears() if m.layer is None]
    last = inv.num_layers - 1
    late += [m for m in inv.linears() if m.layer == last and m.name.endswith("down_proj")]
    return min(layout.autocast_copies, 2.0 * sum(m.num_params for m in late))


def logprob_autocast_copies(inv: ModelInventory, adapter: Adapter, recipe, layout: Layout) -> float:
    """The cached casts of a log-prob pass, which runs through Accelerate's autocast (PEFT model too):
    every trainable fp32 matmul weight's (LoRA's, and modules_to_save's in an fp32 base)."""
    if not layout.autocast or layout.compute_bytes == 4:
        return 0.0
    if not recipe.lora.enable_lora:
        return layout.autocast_copies
    saved = adapter.saved_matmul_params if layout.residual_bytes == 4 else 0
    return 2.0 * (adapter.lora_params + saved)


def _whole_weights(
    inv: ModelInventory, layout: Layout, adapter: Adapter, engine: DistributedSetup
) -> Part | None:
    """One whole copy of a sharded model's weights in the dtype they are gathered in (finetune.
    distributed.whole_weights; QLoRA's 4-bit linears stay packed), None where they are whole anyway."""
    if not _weights_sharded(engine):
        return None
    b, q = layout.gather_bytes, layout.quant_bytes
    linear = sum(m.num_params for m in inv.linears(include_output=False)) if q else 0
    whole = q * linear + b * (inv.total - linear) + b * adapter.lora_params
    return Part(
        "whole weights (generate)", whole, note="grpo.sharded_generation gather: one whole copy per process"
    )


def _generation_gather(
    inv: ModelInventory, layout: Layout, engine: DistributedSetup, mode: str, whole: Part | None
) -> Part | None:
    if whole is None:
        return None
    if mode == "gather":
        return whole
    units = gathered_bytes(inv, layout, engine, 0.0)
    note = "grpo.sharded_generation layerwise: the units one forward gathers" + (
        " (FSDP2: the outermost unit stays whole for the call)" if engine.kind == "fsdp" else ""
    )
    return Part("gathered layers (generate)", units.gpu_bytes if units else 0.0, note=note)


def _weights_sharded(engine: DistributedSetup) -> bool:
    if engine.kind == "deepspeed":
        return engine.zero_stage == 3
    return engine.kind == "fsdp" and engine.zero_stage >= 2


def _vllm_weight_bytes(recipe, engine: DistributedSetup) -> int:
    """Bytes per weight of the vLLM engine: its dtype is the training model's first weight's (the
    embeddings': finetune.generation.vllm_backend), as training loads or casts it (finetune.plan.states)."""
    mixed = recipe.train.mixed_precision != "no"
    if engine.kind == "deepspeed":
        return 2 if mixed else 4
    if recipe.lora.enable_qlora:  # prepare_model_for_kbit_training casts the embeddings to fp32
        return 4
    if not recipe.lora.enable_lora and engine.kind == "fsdp" and mixed:  # FSDP2 upcasts trainable weights
        return 4
    from finetune.model.build import weight_dtype

    return weight_dtype(recipe.model, recipe.lora, recipe.train.mixed_precision).itemsize


def vllm_part(rollout: Rollout, gpu_memory: float, memory_source: str) -> Part:
    """The vLLM engine's line: its share of the device, with what it holds in it."""
    engine = rollout.vllm_bytes(gpu_memory)
    note = (
        f"grpo.vllm_gpu_memory_utilization {rollout.vllm_utilization:g} x {gib_text(gpu_memory)} GiB "
        f"({memory_source}): its weights ({gib_text(rollout.vllm_weights)} GiB) and KV cache, not training's"
    )
    if engine < rollout.vllm_minimum:
        note += f"; too small: its weights and one sequence of vllm_max_model_len need {gib_text(rollout.vllm_minimum)} GiB"
    host = 0.0
    if rollout.vllm_sleep:
        note += "; asleep during training steps (vllm_enable_sleep_mode: weights on the host)"
        host = rollout.vllm_weights
    return Part("vLLM engine", engine, host, note)


def reference_part(inv: ModelInventory, recipe, *, needed: bool, what: str) -> Part | None:
    """The reference model's weights (finetune.objectives.reference): none with LoRA (the adapters are
    disabled for its forward) or when not `needed`; with full fine-tuning a frozen copy of the initial
    weights in the dtype they load in, resident for the whole run. `what` says why it is needed."""
    if not needed or recipe.lora.enable_lora:
        return None
    from finetune.model.build import weight_dtype

    nbytes = weight_dtype(recipe.model, recipe.lora, recipe.train.mixed_precision).itemsize * inv.total
    return Part("reference model", nbytes, note=f"{what}, full fine-tuning: a frozen copy of the weights")


def training_tokens(micro_batch_size: int, recipe, settings) -> int:
    """Tokens of one online training micro-batch: its micro_batch_size completions packed in one row
    (finetune.objectives.rollout.pack_completions), each a completion (at most max_new_tokens) after its
    prompt (at most data.sequence_len): one prompt copy per completion, or with grpo.share_prompts (SDPA or
    eager attention, a text model) one per group the micro-batch holds a part of (the most over the step's
    micro-batches).

    >>> from types import SimpleNamespace as NS
    >>> recipe = NS(data=NS(sequence_len=100), model=NS(kind="causal_lm", attn_implementation="sdpa"),
    ...             train=NS(gradient_accumulation_steps=2))
    >>> training_tokens(8, recipe, NS(max_new_tokens=50, num_generations=8, share_prompts=True))
    500
    >>> training_tokens(6, recipe, NS(max_new_tokens=50, num_generations=4, share_prompts=True))  # 2 groups each
    500
    >>> training_tokens(8, recipe, NS(max_new_tokens=50, num_generations=8, share_prompts=False))
    1200
    """
    copies = micro_batch_size
    if prompts_shared(recipe, settings):
        group, window = settings.num_generations, micro_batch_size
        step = window * recipe.train.gradient_accumulation_steps
        copies = max(len({k // group for k in range(s, s + window)}) for s in range(0, step, window))
    return copies * recipe.data.sequence_len + micro_batch_size * settings.max_new_tokens


def prompts_shared(recipe, settings) -> bool:
    """Whether the online rollout packs a prompt once for its group (finetune.objectives.rollout.shares_prompts)."""
    return (
        getattr(settings, "share_prompts", False)
        and getattr(recipe.model, "kind", "causal_lm") != "vlm"
        and recipe.model.attn_implementation in ("sdpa", "eager")
    )


def online_assumptions(
    inv: ModelInventory, recipe, engine: DistributedSetup, layout: Layout, rollout: Rollout | None
) -> tuple[str, ...]:
    """What the plan of an online recipe assumes (nothing for other objectives)."""
    settings = online_section(recipe)
    if settings is None or rollout is None:
        return ()
    kept = "weights, optimizer states" + (", gradients" if engine.kind == "deepspeed" else "")
    out = [
        f"online RL (train.objective {recipe.train.objective}): a step's peak is the larger of the rollout's "
        f"and the training step's; through both stay only {kept}, the reference and the CUDA allowance "
        "(the engine sets gradients to None after every update)",
        (
            f"training micro-batch: micro_batch_size completions of up to grpo.max_new_tokens {settings.max_new_tokens} "
            f"tokens packed in one row after one copy of each group's prompt (grpo.share_prompts; up to "
            f"data.sequence_len {recipe.data.sequence_len} tokens each)"
            if prompts_shared(recipe, settings)
            else f"training micro-batch: micro_batch_size completions packed in one row of up to micro_batch_size x "
            f"(data.sequence_len {recipe.data.sequence_len} + grpo.max_new_tokens {settings.max_new_tokens}) tokens"
        )
        + "; the log-probs' logits counted over the whole row (an upper bound: only completion positions are "
        "projected on the vocabulary), never chunked",
    ]
    if settings.beta > 0 and recipe.lora.enable_lora:
        out.append("reference: the policy with its adapters disabled (no second copy of the weights)")
    if settings.beta > 0 and not recipe.lora.enable_lora and engine.kind in ("deepspeed", "fsdp"):
        out.append(
            f"training refuses a frozen reference copy under {engine.kind} (finetune.objectives.reference): "
            "set grpo.beta 0 or train LoRA adapters"
        )
    if inv.vision is not None:
        out.append("generation: the vision tower's forward over the prompts' images is not counted")
    gen = rollout.generation
    if gen is not None:
        out.append(
            f"generation: transformers' generate with a DynamicCache, prompts at data.sequence_len "
            f"({gen.prompt_tokens} tokens, the longest allowed), every completion to max_new_tokens; peak at the "
            + ("last step" if gen.decode_peak >= gen.prefill_peak else "prompt forward")
        )
        held_out = _held_out_generation(inv, recipe, layout, gen.autocast_copies)
        if held_out is not None:
            below = held_out.peak <= gen.peak
            out.append(
                f"held-out rewards: eval.batch_size {held_out.sequences} prompts greedy, "
                f"{gib_text(held_out.peak)} GiB: " + ("below the rollout's generation" if below else
                "ABOVE the rollout's generation: lower eval.batch_size")
            )  # fmt: skip
    else:
        out.append(
            "vLLM: its share of each GPU is its own (weights, KV cache, CUDA graphs); training gets the rest"
            + (
                "; with sleep mode it is given back during training steps"
                if settings.vllm_enable_sleep_mode
                else ""
            )
        )
    return tuple(out)


def _held_out_generation(inv: ModelInventory, recipe, layout: Layout, copies: float) -> Generation | None:
    """The held-out rewards' greedy generate call (eval.batch_size prompts, one completion each)."""
    if not recipe.data.val_set_size:
        return None
    settings = online_section(recipe)
    return generation_bytes(
        inv, sequences=recipe.eval.batch_size, prompt_tokens=recipe.data.sequence_len,
        max_new_tokens=settings.max_new_tokens, residual_bytes=layout.residual_bytes,
        compute_bytes=layout.compute_bytes, autocast=layout.autocast,
        attn_implementation=recipe.model.attn_implementation, sampling=False, autocast_copies=copies,
    )  # fmt: skip
