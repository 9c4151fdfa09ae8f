"""The plan: states + activations for the recipe and engine (`estimate`), whether it fits, and what
to change when it does not (`suggest`); `make_plan` is the entry `finetune plan` calls."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from finetune.accelerate_config import (
    ACCELERATE_CONFIGS,
    DistributedSetup,
    read_accelerate_config,
    resolve_accelerate_config,
)
from finetune.errors import FinetuneError
from finetune.plan.activations import (
    Activations,
    ImageInput,
    activation_bytes,
    frozen_tower_forward_bytes,
    vision_backward_bytes,
    vision_bytes,
)
from finetune.plan.inventory import (
    _MEMORY_UNITS,
    CUDA_ALLOWANCE_BYTES,
    DEFAULT_GPU_MEMORY,
    Adapter,
    ModelInventory,
    _modules_to_save,
    adapter_counts,
    gib_text,
    inspect_model,
)
from finetune.plan.parallel import (
    offloaded_bytes,
    shard_len,
    split_note,
    split_of,
    split_states,
    tensor_data_parallel,
    tensor_view,
    with_segments,
)
from finetune.plan.rollout import (
    Rollout,
    online_assumptions,
    online_section,
    reference_part,
    rollout_plan,
    training_tokens,
)
from finetune.plan.states import Layout, Part, gathered_bytes, model_states, shard_states
from finetune.recipe import Recipe
from finetune.recipe.objectives import OBJECTIVES

# ---------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Estimate:
    """Every part on one device for one (recipe, engine, micro batch, checkpointing): the training
    step's `parts`, and an online objective's `rollout` (finetune.plan.rollout)."""

    parts: tuple[Part, ...]
    activations: Activations
    layout: Layout
    rollout: Rollout | None = None

    @property
    def training_gpu(self) -> float:
        """The training step's bytes: the sum of `parts`."""
        return sum(p.gpu_bytes for p in self.parts)

    @property
    def total_gpu(self) -> float:
        """The peak of a step: the training step's, or the larger of it and the rollout's."""
        if self.rollout is None:
            return self.training_gpu
        return max(self.training_gpu, self.rollout.total_gpu)

    def headroom(self, gpu_memory: float) -> float:
        """Bytes left on a device of `gpu_memory` (negative: over by that much); a vLLM engine's share
        is not training's (finetune.plan.rollout.Rollout.headroom)."""
        if self.rollout is None:
            return gpu_memory - self.total_gpu
        return self.rollout.headroom(gpu_memory, self.training_gpu)

    @property
    def total_host(self) -> float:
        return sum(p.host_bytes for p in self.parts)


def estimate(
    inv: ModelInventory,
    recipe: Recipe,
    engine: DistributedSetup,
    *,
    micro_batch_size: int,
    checkpointing: bool,
    adapter: Adapter | None = None,
    images: ImageInput | None = None,
) -> Estimate:
    """Per-device bytes by part: model states, engine extras, activations, the fixed allowance
    (`images`: what a vision-language model's tower sees per row; finetune.plan.images)."""
    adapter = adapter if adapter is not None else adapter_counts(inv, recipe.lora, recipe.model)
    layout = model_states(inv, adapter, recipe, engine, checkpointing=checkpointing)
    split = split_of(recipe.train)
    parts = split_states(shard_states(layout.states, engine), inv, split, full=not recipe.lora.enable_lora)
    if engine.kind == "ddp" and split.tensor > 1:  # TP x DP: transformers' FSDP2 across the TP groups
        fsdp = DistributedSetup("fsdp", num_processes=engine.num_processes, zero_stage=3)
        trained = min(1.0, layout.states.trainable_params / inv.total)
        parts = tensor_data_parallel(
            parts, gathered_bytes(inv, layout, fsdp, trained), inv, split, engine.num_processes
        )
    # Tensor parallel runs without DDP (finetune.parallel.tensor): no gradient buckets.
    if engine.kind == "ddp" and engine.num_processes > 1 and split.tensor <= 1:
        note = "gradient_as_bucket_view=False (accelerate's default): a second gradient copy"
        parts.append(Part("DDP gradient buckets", layout.states.grads, note=note))
    if layout.autocast_copies:
        parts.append(
            Part("autocast weight copies", layout.autocast_copies, note="bf16 casts of fp32 matmul weights")
        )
    gathered = gathered_bytes(inv, layout, engine, min(1.0, layout.states.trainable_params / inv.total))
    if gathered is not None:
        parts.append(gathered)
    data = recipe.data
    trained = {m.name for m in _modules_to_save(inv, recipe.lora.modules_to_save)}
    full = not recipe.lora.enable_lora
    embedding = next((m.name for m in inv.modules if m.kind == "embedding"), None)
    online = online_section(recipe)
    seq_len = data.packing_len if data.sample_packing else data.sequence_len
    rows = micro_batch_size
    if online is not None:  # the micro-batch's completions packed in one row; the loss is never chunked
        rows, seq_len = 1, training_tokens(micro_batch_size, recipe, online)
        reference = reference_part(inv, recipe, needed=online.beta > 0, what=f"grpo.beta {online.beta:g} > 0")
        parts += [reference] if reference is not None else []
    chunk = 0 if online is not None else loss_chunk(recipe, inv, micro_batch_size * seq_len)
    head_adapted = any(m.name == inv.output_name for m in adapter.targets) or inv.output_name in trained
    # Image features that need a gradient (trained tower or projector) make the first norm save its input.
    vision_grad = inv.vision is not None and (recipe.model.train_vision_tower or recipe.model.train_projector)
    acts = activation_bytes(
        tensor_view(inv, split),
        micro_batch_size=rows,
        seq_len=shard_len(seq_len, split),
        # Ulysses' and ring attention build no seq x seq mask (finetune.plan.parallel)
        attn_implementation="flash_attention_2" if split.sequence > 1 else recipe.model.attn_implementation,
        residual_bytes=layout.residual_bytes,
        compute_bytes=layout.compute_bytes,
        autocast=layout.autocast,
        adapter=adapter,
        lora_dropout=recipe.lora.lora_dropout,
        lora_bytes=layout.lora_bytes,
        linear_out_bytes=layout.linear_out_bytes,
        lm_head_trainable=full or inv.output_name in trained,
        embedding_trainable=full or embedding in trained or vision_grad,
        loss_chunk=chunk,
        lm_head_plain=full or not head_adapted,
        rotary_rows=_rotary_rows(inv, rows),
        embedding_frozen=not (full or embedding in trained),
    )
    acts = with_segments(
        acts,
        tensor_view(inv, split),
        split,
        attn=recipe.model.attn_implementation if recipe.train.sequence_parallel_size > 1 else "",
        rows=rows,
        tokens=shard_len(seq_len, split),
        compute_bytes=layout.compute_bytes,
    )
    if inv.vision is not None:
        acts = _with_vision(acts, inv, recipe, layout, rows, images)
    label = "activations, " + ("gradient checkpointing" if checkpointing else "no checkpointing")
    offloaded = offloaded_bytes(acts, checkpointing) if split.offload else 0.0
    note = "; ".join(filter(None, ["<- recipe", split_note(split)]))
    parts.append(Part(label, acts.peak(checkpointing) - acts.logits_and_loss - offloaded, note=note))
    if offloaded:
        parts.append(Part("offloaded activations", 0.0, offloaded, note="pinned host memory"))
    note = (
        f"chunked loss ({chunk} tokens per chunk): no logits held"
        if chunk
        else "full logits: fp32 log-softmax and its two gradients at its backward"
    )
    parts.append(Part("logits + loss", acts.logits_and_loss, note=note))
    parts.append(Part("CUDA context + fragmentation", CUDA_ALLOWANCE_BYTES, note="fixed allowance"))
    rollout = None
    if online is not None:
        rollout = rollout_plan(inv, recipe, engine, layout, adapter, parts, micro_batch_size=micro_batch_size)
    return Estimate(tuple(parts), acts, layout, rollout)


def _rotary_rows(inv: ModelInventory, micro_batch_size: int) -> int:
    """Rows with their own rotary tables: a VLM batch carries no position_ids (collate_vlm), so a
    Llama-style language model makes one 0..s table for all rows; a multimodal RoPE (Qwen2-VL's: its
    family's `rope_per_row`) makes per-row positions (the images' places)."""
    if inv.vision is None or inv.vision.family.rope_per_row:
        return micro_batch_size
    return 1


def _with_vision(
    acts: Activations,
    inv: ModelInventory,
    recipe: Recipe,
    layout: Layout,
    micro: int,
    images: ImageInput | None,
) -> Activations:
    """The language model's activations plus the vision tower's and projector's (both checkpointing
    settings: the plan shows the other one too)."""
    if images is None:
        raise FinetuneError(
            "the planner needs the images per row and patches per image of a vision-language model"
        )
    model = recipe.model
    common = {
        "micro_batch_size": micro,
        "tower_trains": model.train_vision_tower,
        "projector_trains": model.train_projector,
        "residual_bytes": layout.residual_bytes,
        "compute_bytes": layout.compute_bytes,
        "lora_rank": recipe.lora.lora_rank if recipe.lora.enable_lora else 0,
        "lora_dropout": recipe.lora.lora_dropout if recipe.lora.enable_lora else 0.0,
    }
    recompute = {k: v for k, v in common.items() if k != "projector_trains"}
    return replace(
        acts,
        vision=vision_bytes(inv.vision, images, checkpointing=False, **common),
        vision_checkpointed=vision_bytes(inv.vision, images, checkpointing=True, **common),
        vision_backward=vision_backward_bytes(inv.vision, images, **recompute),
        vision_forward=frozen_tower_forward_bytes(
            inv.vision,
            images,
            **{k: v for k, v in recompute.items() if not k.startswith("lora")},
            text_embeddings=acts.layer_input,
        ),
    )


def loss_chunk(recipe: Recipe, inv: ModelInventory, tokens_per_micro_batch: int) -> int:
    """train.loss_chunk_size as training resolves it for this model (0 = full logits; Liger fuses the
    loss itself, which the planner counts as chunked at the default size)."""
    from finetune.losses.chunked_ce import default_chunk_size, resolve_loss_chunk_size

    if recipe.train.tensor_parallel_size > 1:  # the TP plan splits the head, which the chunked loss replaces
        return 0
    if recipe.model.enable_liger_kernel:
        return default_chunk_size(inv.vocab_size)
    return resolve_loss_chunk_size(
        recipe.train.loss_chunk_size, vocab_size=inv.vocab_size, tokens_per_micro_batch=tokens_per_micro_batch
    )


@dataclass(frozen=True)
class Suggestion:
    """A micro batch that fits with the global batch kept, or what would fit instead."""

    global_batch: int
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool = False
    alternatives: tuple[dict, ...] = ()
    lines: tuple[str, ...] = ()


def suggest(
    inv: ModelInventory,
    recipe: Recipe,
    engine: DistributedSetup,
    gpu_memory: float,
    images: ImageInput | None = None,
) -> Suggestion:
    """Largest micro_batch_size dividing the per-device rows (micro x accumulation) that fits, so
    micro x accumulation x GPUs stays the recipe's global batch; checkpointing is turned on only
    when nothing fits without it; if micro 1 does not fit either, other engines and QLoRA are tried."""
    train = recipe.train
    rows = train.micro_batch_size * train.gradient_accumulation_steps
    global_batch = rows * engine.num_processes
    adapter = adapter_counts(inv, recipe.lora, recipe.model)

    def fits(micro: int, ckpt: bool, eng: DistributedSetup = engine, rec: Recipe = recipe) -> bool:
        ad = adapter if rec is recipe else adapter_counts(inv, rec.lora, rec.model)
        est = estimate(inv, rec, eng, micro_batch_size=micro, checkpointing=ckpt, adapter=ad, images=images)
        return est.headroom(gpu_memory) >= 0

    micros = [m for m in range(rows, 0, -1) if rows % m == 0]
    for ckpt in dict.fromkeys((train.gradient_checkpointing, True)):
        micro = next((m for m in micros if fits(m, ckpt)), None)
        if micro is not None:
            found = _batch_suggestion(recipe, engine, global_batch, micro, ckpt, fits(micro, False))
            est = estimate(
                inv,
                recipe,
                engine,
                micro_batch_size=micro,
                checkpointing=ckpt,
                adapter=adapter,
                images=images,
            )
            line = _sequence_split_line(inv, recipe, engine, est)
            return replace(found, lines=found.lines + ((line,) if line else ()))
    alternatives = []
    splits = _sequence_alternatives(inv, recipe, engine)
    for name, eng, rec, change in (
        _online_alternatives(recipe, engine) + splits + _alternatives(recipe, engine)
    ):
        if name not in {a["name"] for a in alternatives} and fits(1, True, eng, rec):
            est = estimate(inv, rec, eng, micro_batch_size=1, checkpointing=True, images=images)
            alternatives.append({"name": name, "change": change, "total_gpu_bytes": est.total_gpu})
    lines = [
        f"does not fit even at micro_batch_size 1 with gradient checkpointing ({gib_text(gpu_memory)} GiB)"
    ]
    lines += [
        f"would fit at micro_batch_size 1 with checkpointing: {a['change']} ({gib_text(a['total_gpu_bytes'])} GiB)"
        for a in alternatives[:3]
    ]
    if not alternatives:
        lines.append(
            "nothing tried fits: more GPUs, a shorter data.sample_packing_sequence_len, or LoRA/QLoRA"
        )
    return Suggestion(
        global_batch, gradient_checkpointing=True, alternatives=tuple(alternatives), lines=tuple(lines)
    )


def _sequence_sizes(inv: ModelInventory, recipe: Recipe, engine: DistributedSetup) -> list[int]:
    """Sequence-parallel sizes this run could take: above 1, dividing the processes and the heads
    (finetune.parallel.sizes), for an sft run of a causal LM that splits nothing yet."""
    train = recipe.train
    split = split_of(train)
    if split.sequence > 1 or split.tensor > 1 or recipe.model.kind != "llm":
        return []
    if OBJECTIVES[train.objective].kind != "sft":
        return []
    n = engine.num_processes
    return [size for size in range(2, n + 1) if n % size == 0 and inv.num_heads % size == 0]


def _sequence_alternatives(
    inv: ModelInventory, recipe: Recipe, engine: DistributedSetup
) -> list[tuple[str, DistributedSetup, Recipe, str]]:
    """Sequence parallel over 2, 4 ... of the processes (smallest first): each row's activations and
    logits split over them (finetune.plan.parallel)."""
    out = []
    for size in _sequence_sizes(inv, recipe, engine):
        train = recipe.train.model_copy(update={"sequence_parallel_size": size})
        change = f"--train.sequence_parallel_size {size} (Ulysses: each row's tokens split over {size} GPUs)"
        out.append((f"sequence_parallel_{size}", engine, recipe.model_copy(update={"train": train}), change))
    return out


def _sequence_split_line(inv: ModelInventory, recipe: Recipe, engine: DistributedSetup, est: Estimate) -> str:
    """A line recommending sequence parallel when activations (and logits) are most of the memory."""
    sizes = _sequence_sizes(inv, recipe, engine)
    acts = sum(p.gpu_bytes for p in est.parts if p.name.startswith(("activations", "logits")))
    if not sizes or acts <= est.training_gpu / 2:
        return ""
    size = sizes[-1]
    return (
        f"activations dominate ({acts / est.training_gpu:.0%} of the step's memory): "
        f"--train.sequence_parallel_size {size} splits each row over {size} GPUs and divides them by {size} "
        "(context parallel, --train.context_parallel_size, under fsdp2 on GPUs, does too, rows unpacked)"
    )


def _batch_suggestion(
    recipe: Recipe,
    engine: DistributedSetup,
    global_batch: int,
    micro: int,
    ckpt: bool,
    fits_without_ckpt: bool,
) -> Suggestion:
    train = recipe.train
    accumulation = global_batch // (micro * engine.num_processes)
    same = (micro, accumulation, ckpt) == (
        train.micro_batch_size,
        train.gradient_accumulation_steps,
        train.gradient_checkpointing,
    )
    head = (
        f"micro_batch_size {micro} x gradient_accumulation_steps {accumulation} x {engine.num_processes} "
        f"device{'s' if engine.num_processes > 1 else ''} = global batch {global_batch}"
    )
    lines = [head + (" (the recipe's; the largest micro batch that fits)" if same else "")]
    if not same:
        flags = f"--train.micro_batch_size {micro} --train.gradient_accumulation_steps {accumulation}"
        if ckpt and not train.gradient_checkpointing:
            flags += " --train.gradient_checkpointing true"
            lines.append("nothing fits without gradient checkpointing: turn it on")
        lines.append(f"use: {flags}")
    if ckpt and fits_without_ckpt:
        lines.append(
            "fits without gradient checkpointing too (no recompute, faster): --train.gradient_checkpointing false"
        )
    return Suggestion(global_batch, micro, accumulation, ckpt, lines=tuple(lines))


def _online_alternatives(
    recipe: Recipe, engine: DistributedSetup
) -> list[tuple[str, DistributedSetup, Recipe, str]]:
    """An online recipe's rollout settings that take less memory: vLLM's sleep mode (its share is given
    back during training steps), or fewer prompts per generate call (the largest that fits is offered)."""
    section = online_section(recipe)
    if section is None:
        return []
    name = OBJECTIVES[recipe.train.objective].section

    def changed(**update) -> Recipe:
        return recipe.model_copy(update={name: section.model_copy(update=update)})

    if section.generation_backend == "vllm":
        if section.vllm_enable_sleep_mode:
            return []
        change = f"--{name}.vllm_enable_sleep_mode true (vLLM frees its share during training steps)"
        return [("vllm_sleep_mode", engine, changed(vllm_enable_sleep_mode=True), change)]
    train = recipe.train
    prompts = min(
        section.generation_batch_size,
        train.micro_batch_size * train.gradient_accumulation_steps // section.num_generations,
    )
    return [
        (
            "generation_batch_size",
            engine,
            changed(generation_batch_size=size),
            f"--{name}.generation_batch_size {size} ({size * section.num_generations} sequences per generate call)",
        )
        for size in range(prompts - 1, 0, -1)
    ]


def _alternatives(
    recipe: Recipe, engine: DistributedSetup
) -> list[tuple[str, DistributedSetup, Recipe, str]]:
    """Other engines (named as the shipped configs) and QLoRA, in order of how much they change."""
    common = {"num_processes": engine.num_processes, "num_machines": engine.num_machines}
    cpu = {"offload_optimizer": "cpu", "offload_params": "cpu"}
    engines = [
        ("zero2", DistributedSetup("deepspeed", zero_stage=2, **common)),
        ("zero3", DistributedSetup("deepspeed", zero_stage=3, **common)),
        ("fsdp2", DistributedSetup("fsdp", zero_stage=3, **common)),
        ("zero2_offload", DistributedSetup("deepspeed", zero_stage=2, offload_optimizer="cpu", **common)),
        ("zero3_offload", DistributedSetup("deepspeed", zero_stage=3, **cpu, **common)),
        ("fsdp2_offload", DistributedSetup("fsdp", zero_stage=3, **cpu, **common)),
    ]
    out = []
    for name, eng in engines:
        if name == engine.name:
            continue
        path = ACCELERATE_CONFIGS / f"{name}.yaml"
        where = f"accelerate_configs/{name}.yaml" if path.is_file() else f"no {name}.yaml shipped: write one"
        out.append((name, eng, recipe, f"--accelerate-config {name} ({where})"))
    # A VLM's language model alone is 4-bit (finetune.model.vlm.unquantized_modules keeps the vision tower,
    # projector and head whole): the inventory's linears are the language model's, the rest is counted
    # in fp32 as prepare_model_for_kbit_training leaves it (tests/unit/test_plan_qlora_vlm.py).
    if not recipe.lora.enable_qlora:
        lora = recipe.lora.model_copy(update={"enable_lora": True, "enable_qlora": True})
        model = recipe.model
        if model.torch_dtype == "fp32":
            model = model.model_copy(update={"torch_dtype": "bf16"})
        qlora = recipe.model_copy(update={"lora": lora, "model": model})
        out.append(("qlora", engine, qlora, "QLoRA: --lora.enable_qlora true (4-bit base + LoRA)"))
    return out


@dataclass(frozen=True)
class Plan:
    """The whole answer of `finetune plan`."""

    recipe_path: str
    engine: DistributedSetup
    inventory: ModelInventory
    adapter: Adapter
    micro_batch_size: int
    seq_len: int
    checkpointing: bool
    estimate: Estimate
    other_activations: float  # peak activations with the other checkpointing setting
    gpu_memory: float
    gpu_memory_source: str
    suggestion: Suggestion
    assumptions: tuple[str, ...] = field(default=())
    images: ImageInput | None = None  # vision-language models: what the vision tower sees per row

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def headroom(self) -> float:
        return self.estimate.headroom(self.gpu_memory)


def make_plan(
    recipe: Recipe,
    *,
    recipe_path: str = "",
    accelerate_config: str | None = None,
    num_gpus: int | None = None,
    num_nodes: int | None = None,
    gpu_memory: str | None = None,
    inventory: ModelInventory | None = None,
    images_per_row: float | None = None,
    patches_per_image: int | None = None,
) -> Plan:
    """Plan the recipe under an accelerate config (name or path; default train.accelerate_config);
    a vision-language model's images per row and patches per image default as finetune.plan.images says."""
    if getattr(recipe.model, "kind", "llm") not in ("llm", "vlm"):
        raise FinetuneError(
            "finetune plan handles LLM recipes (model.kind: llm) and vision-language ones (vlm), "
            "not diffusion pipelines"
        )
    config = resolve_accelerate_config(accelerate_config or recipe.train.accelerate_config)
    engine = read_accelerate_config(config, num_processes=num_gpus, num_machines=num_nodes)
    memory, source = gpu_memory_bytes(gpu_memory)
    inv = inventory if inventory is not None else inspect_model(recipe.model)
    images = None
    if inv.vision is not None:
        from finetune.plan.images import image_input

        images = image_input(
            inv.vision, recipe, images_per_row=images_per_row, patches_per_image=patches_per_image
        )
    adapter = adapter_counts(inv, recipe.lora, recipe.model)
    train, data = recipe.train, recipe.data
    ckpt = train.gradient_checkpointing
    est = estimate(
        inv,
        recipe,
        engine,
        micro_batch_size=train.micro_batch_size,
        checkpointing=ckpt,
        adapter=adapter,
        images=images,
    )
    online = online_section(recipe)
    seq_len = data.packing_len if data.sample_packing else data.sequence_len
    if online is not None:  # one packed row of the micro-batch's completions
        seq_len = training_tokens(train.micro_batch_size, recipe, online)
    return Plan(
        recipe_path=recipe_path,
        engine=engine,
        inventory=inv,
        adapter=adapter,
        micro_batch_size=train.micro_batch_size,
        seq_len=seq_len,
        checkpointing=ckpt,
        estimate=est,
        other_activations=est.activations.peak(not ckpt) - est.activations.logits_and_loss,
        gpu_memory=memory,
        gpu_memory_source=source,
        suggestion=suggest(inv, recipe, engine, memory, images),
        assumptions=_assumptions(recipe, engine, est, source)
        + _vision_assumptions(inv, recipe, images)
        + online_assumptions(inv, recipe, engine, est.layout, est.rollout),
        images=images,
    )


def _vision_assumptions(inv: ModelInventory, recipe: Recipe, images: ImageInput | None) -> tuple[str, ...]:
    if inv.vision is None or images is None:
        return ()
    model = recipe.model
    trains = [
        n
        for n, on in (("vision tower", model.train_vision_tower), ("projector", model.train_projector))
        if on
    ]
    return (
        f"vision tower {inv.vision.tower_params:,} and projector {inv.vision.projector_params:,} parameters; "
        + (
            f"{' and '.join(trains)} trained"
            if trains
            else "both frozen (model.train_vision_tower/train_projector)"
        ),
        f"images: {images.source}; their image tokens are inside data.sequence_len (the rows are tokenized "
        "with them)",
        "vision activations: ViT-style encoder layers over all patches of the micro batch, no s^2 term "
        "(sdpa/flash); a frozen tower saves nothing for backward",
    )


def gpu_memory_bytes(text: str | None) -> tuple[int, str]:
    """(bytes, where it came from): --gpu-memory (80GiB, 80GB, 81920MiB), else the first visible CUDA
    device, else 80 GiB."""
    if text is not None:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", text)
        if not match or match.group(2).lower() not in _MEMORY_UNITS:
            raise FinetuneError(
                f"--gpu-memory {text!r}: expected a size with a unit, e.g. 80GiB, 80GB, 24GiB or 81920MiB"
            )
        return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()]), f"--gpu-memory {text}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"GPU 0 ({props.name})"
    return DEFAULT_GPU_MEMORY, "default 80 GiB: no CUDA device visible (set --gpu-memory)"


def _assumptions(
    recipe: Recipe, engine: DistributedSetup, est: Estimate, memory_source: str
) -> tuple[str, ...]:
    attn = recipe.model.attn_implementation
    out = [
        f"model states as this codebase holds them: {est.layout.states.weight_format}, "
        f"{est.layout.states.optimizer_format}",
        *est.layout.notes,
        f"activations: Llama-style decoder layers, {attn} attention"
        + (" (b*a*s^2 probabilities saved)" if attn == "eager" else " (no s^2 term)")
        + (", packed/padded rows carry a mask so k/v are repeated to every head" if attn == "sdpa" else ""),
        "vocabulary from the model config (special tokens added to the tokenizer grow the logits)",
        f"a fixed {gib_text(CUDA_ALLOWANCE_BYTES)} GiB for the CUDA context, allocator fragmentation and "
        "communication buckets",
        f"GPU memory: {memory_source}",
    ]
    if engine.kind == "ddp" and engine.num_processes > 1:
        out.append("DDP keeps gradients twice (accelerate's DDP default gradient_as_bucket_view=False)")
    if any(p.name == "gathered params" for p in est.parts):
        out.append(
            "ZeRO-3/FSDP working set: the unit in use + one prefetched (FSDP2's root unit stays "
            "gathered) and one layer's unsharded grads"
        )
    if est.total_host:
        out.append(
            f"host bytes are per GPU process; a node holds {engine.gpus_per_node}x "
            "(plus pinned buffers, not counted)"
        )
    if engine.use_cpu:
        out.append("CPU processes: 'per-GPU' means per process, in RAM")
    return tuple(out)
