"""The plan for people (`format_plan`, a table with the verdict, suggestions and assumptions) and for
programs (`plan_json`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from finetune.accelerate_config import REPO_ROOT
from finetune.plan.inventory import gib_text
from finetune.plan.planner import Plan
from finetune.plan.rollout import online_section, training_tokens, vllm_part

# -------------------------------------------------------------------------------------------- output


def _params(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def format_plan(plan: Plan) -> str:
    """The plan as a readable table with the verdict, suggestions and assumptions."""
    inv, est, eng = plan.inventory, plan.estimate, plan.engine
    trainable = est.layout.states.trainable_params
    lines = [
        f"plan: {plan.recipe_path}",
        f"model:  {_params(inv.total)} parameters ({inv.total:,}), {_params(trainable)} trainable; "
        f"{inv.num_layers} layers, hidden {inv.hidden_size}, vocab {inv.vocab_size:,}, "
        f"embeddings {'tied' if inv.tied else 'untied'}",
        *_vision_lines(plan),
        f"engine: {eng.describe()}" + (f" [{_short_path(eng.source)}]" if Path(eng.source).is_file() else ""),
        _batch_line(plan),
        "",
        f"{'part':34s} {'per-GPU GiB':>11s} {'host GiB':>9s}  note",
    ]
    other = "no checkpointing" if plan.checkpointing else "gradient checkpointing"
    for part in est.parts:
        host = gib_text(part.host_bytes) if part.host_bytes else "-"
        note = part.note + (f"; NVMe {gib_text(part.nvme_bytes)} GiB" if part.nvme_bytes else "")
        lines.append(f"{part.name:34s} {gib_text(part.gpu_bytes):>11s} {host:>9s}  {note}")
        if part.name.startswith("activations"):
            label, size = f"(activations, {other})", f"({gib_text(plan.other_activations)})"
            lines.append(f"{label:34s} {size:>11s} {'':>9s}  not counted")
    if est.rollout is None:
        lines.append(f"{'total':34s} {gib_text(est.total_gpu):>11s} {gib_text(est.total_host):>9s}")
    else:
        lines += rollout_lines(plan)
    verdict = "yes" if plan.fits else "NO"
    vllm = est.rollout.vllm_bytes(plan.gpu_memory) if est.rollout is not None else 0.0
    beside = f" beside vLLM's {gib_text(vllm)} GiB" if vllm else ""
    lines.append(
        f"fits in {gib_text(plan.gpu_memory)} GiB ({plan.gpu_memory_source}){beside}: {verdict}, "
        f"{'headroom' if plan.fits else 'over by'} {gib_text(abs(plan.headroom))} GiB"
    )
    if est.total_host:
        lines.append(f"host RAM per node: {gib_text(est.total_host * eng.gpus_per_node)} GiB")
    if (logits := logits_line(est)) is not None:
        lines.append(logits)
    lines += [f"suggestion: {line}" for line in plan.suggestion.lines]
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def _batch_line(plan: Plan) -> str:
    checkpointing = f"gradient checkpointing {'on' if plan.checkpointing else 'off'}"
    if plan.estimate.rollout is None:
        return f"batch:  micro_batch_size {plan.micro_batch_size} x {plan.seq_len} tokens, {checkpointing}"
    return (
        f"batch:  micro_batch_size {plan.micro_batch_size} completions packed in one row of up to {plan.seq_len} "
        f"tokens, {checkpointing}"
    )


def rollout_lines(plan: Plan) -> list[str]:
    """An online plan's totals: the training step's, the rollout's parts on top of what stays through
    it, the step's peak (the larger), and a vLLM engine's share of the device."""
    est, rollout = plan.estimate, plan.estimate.rollout
    backend = "vllm" if rollout.vllm_utilization else "transformers"
    lines = [
        f"{'total (training step)':34s} {gib_text(est.training_gpu):>11s} {gib_text(est.total_host):>9s}",
        f"rollout (grpo.generation_backend {backend}), before each step's training:",
        f"{'  stays: weights, optimizer, ...':34s} {gib_text(rollout.resident):>11s} {'':>9s}  "
        "the parts above that the rollout keeps (gradients are freed after every update)",
    ]
    for part in rollout.parts:
        lines.append(f"{'  ' + part.name:34s} {gib_text(part.gpu_bytes):>11s} {'-':>9s}  {part.note}")
    for part in rollout.other:
        label, size = f"  ({part.name})", f"({gib_text(part.gpu_bytes)})"
        lines.append(f"{label:34s} {size:>11s} {'':>9s}  not counted: not at the rollout's peak; {part.note}")
    lines.append(f"{'total (rollout)':34s} {gib_text(rollout.total_gpu):>11s}")
    which = "the rollout" if rollout.total_gpu > est.training_gpu else "the training step"
    lines.append(f"{'peak of a step':34s} {gib_text(est.total_gpu):>11s} {'':>9s}  {which}'s")
    if rollout.vllm_utilization:
        part = vllm_part(rollout, plan.gpu_memory, plan.gpu_memory_source)
        host = gib_text(part.host_bytes) if part.host_bytes else "-"
        lines.append(f"{part.name:34s} {gib_text(part.gpu_bytes):>11s} {host:>9s}  {part.note}")
    return lines


def logits_line(est) -> str | None:
    """A line when the logits and loss take most of the activation memory (or when chunking is what
    keeps them small), saying what train.loss_chunk_size does about it."""
    parts = {p.name: p for p in est.parts}
    loss = parts.get("logits + loss")
    acts = next((p for name, p in parts.items() if name.startswith("activations")), None)
    if loss is None or acts is None or loss.gpu_bytes == 0:
        return None
    share = loss.gpu_bytes / (loss.gpu_bytes + acts.gpu_bytes)
    if loss.note.startswith("chunked"):
        return f"logits: {loss.note}; {share:.0%} of the activation memory"
    if share < 0.5:
        return None
    if est.rollout is not None:  # online objectives take full logits (train.loss_chunk_size is SFT's)
        return (
            f"logits: the full logits take {share:.0%} of the activation memory ({gib_text(loss.gpu_bytes)} GiB); "
            "the online loss takes full logits: a smaller train.micro_batch_size (more accumulation) lowers them"
        )
    return (
        f"logits: the full logits take {share:.0%} of the activation memory ({gib_text(loss.gpu_bytes)} GiB); "
        "--train.loss_chunk_size 512 computes the loss in chunks without them"
    )


def _short_path(path: str) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else path


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan's numbers (bytes) as plain data for --json."""
    inv, est, acts = plan.inventory, plan.estimate, plan.estimate.activations
    engine = {**asdict(plan.engine), "name": plan.engine.name, "shard_degree": plan.engine.shard_degree}
    engine["ds_config_path"] = str(engine["ds_config_path"]) if engine["ds_config_path"] else None
    out = {
        "recipe": plan.recipe_path,
        "model": {
            "params_total": inv.total,
            "params_trainable": est.layout.states.trainable_params,
            "lora_params": plan.adapter.lora_params,
            "modules_to_save_params": plan.adapter.saved_params,
            "num_layers": inv.num_layers,
            "hidden_size": inv.hidden_size,
            "vocab_size": inv.vocab_size,
            "tied_embeddings": inv.tied,
            "vision": _vision_dict(plan),
        },
        "engine": engine,
        "batch": {
            "micro_batch_size": plan.micro_batch_size,
            "seq_len": plan.seq_len,
            "gradient_checkpointing": plan.checkpointing,
        },
        "parts": [asdict(p) for p in est.parts],
        "activations": {
            "with_checkpointing_bytes": acts.peak(True) - acts.logits_and_loss,
            "without_checkpointing_bytes": acts.peak(False) - acts.logits_and_loss,
            "logits_and_loss_bytes": acts.logits_and_loss,
            "saved_bytes": acts.saved,
            "used": "with_checkpointing" if plan.checkpointing else "without_checkpointing",
        },
        "total_gpu_bytes": est.total_gpu,
        "total_host_bytes": est.total_host,
        "host_bytes_per_node": est.total_host * plan.engine.gpus_per_node,
        "gpu_memory_bytes": plan.gpu_memory,
        "gpu_memory_source": plan.gpu_memory_source,
        "fits": plan.fits,
        "headroom_bytes": plan.headroom,
        "suggestion": asdict(plan.suggestion),
        "assumptions": list(plan.assumptions),
    }
    if est.rollout is not None:
        out["online"] = online_dict(est, plan.gpu_memory)
    return out


def online_dict(est, gpu_memory: float) -> dict[str, Any]:
    """An online plan's rollout as plain data (bytes): total_gpu_bytes is the step's peak, the larger
    of training_step_gpu_bytes and rollout.total_gpu_bytes."""
    rollout = est.rollout
    return {
        "training_step_gpu_bytes": est.training_gpu,
        "rollout": {
            "resident_gpu_bytes": rollout.resident,
            "parts": [asdict(p) for p in rollout.parts],
            "not_counted": [asdict(p) for p in rollout.other],
            "total_gpu_bytes": rollout.total_gpu,
            "generation": asdict(rollout.generation) if rollout.generation is not None else None,
            "prompts_per_generate_call": rollout.prompts_per_call,
        },
        "vllm_engine_bytes": rollout.vllm_bytes(gpu_memory),
        "vllm_sleep_mode": rollout.vllm_sleep,
        "step_peak_gpu_bytes": est.total_gpu,
    }


def _vision_lines(plan: Plan) -> list[str]:
    vision = _vision_dict(plan)
    if vision is None:
        return []
    return [
        f"vision: tower {_params(vision['tower_params'])} ({vision['tower_layers']} layers, hidden "
        f"{vision['tower_hidden_size']}), projector {_params(vision['projector_params'])}, language model "
        f"{_params(vision['language_model_params'])}; {vision['images_per_row']:g} image(s) x "
        f"{vision['patches_per_image']} patches per row"
    ]


def _vision_dict(plan: Plan) -> dict[str, Any] | None:
    """A vision-language model's tower, projector and what the tower sees per row (None for an LLM)."""
    vision, images, acts = plan.inventory.vision, plan.images, plan.estimate.activations
    if vision is None or images is None:
        return None
    return {
        "tower_params": vision.tower_params,
        "projector_params": vision.projector_params,
        "language_model_params": plan.inventory.total - vision.tower_params - vision.projector_params,
        "tower_layers": vision.num_layers,
        "tower_hidden_size": vision.hidden_size,
        "images_per_row": images.images_per_row,
        "patches_per_image": images.patches_per_image,
        "images_source": images.source,
        "activations_bytes": acts.vision_checkpointed if plan.checkpointing else acts.vision,
    }


def plan_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2)


def training_prediction(recipe, engine) -> dict[str, Any]:
    """What the planner predicts for a run about to train (`finetune train` records it in
    progress.jsonl's "started" record, and `finetune report` sets it beside the measured peak):
    per-device bytes by part for the recipe's own micro batch and checkpointing under `engine`
    (the launched process's DistributedSetup). The planner's fixed CUDA allowance is listed apart:
    torch.cuda.max_memory_allocated (the measured peak) does not see it.

    {"unavailable": why} where the planner cannot predict (diffusion, a model it does not handle).
    """
    from finetune.errors import FinetuneError
    from finetune.plan.images import image_input
    from finetune.plan.inventory import CUDA_ALLOWANCE_BYTES, inspect_model
    from finetune.plan.planner import estimate

    if getattr(recipe.model, "kind", "llm") not in ("llm", "vlm"):
        return {"unavailable": "the planner handles LLM and vision-language recipes, not diffusion pipelines"}
    train, data = recipe.train, recipe.data
    try:
        inv = inspect_model(recipe.model)
        # A VLM: the planner's default images per row and patches per image (finetune.plan.images).
        images = image_input(inv.vision, recipe) if inv.vision is not None else None
        est = estimate(
            inv,
            recipe,
            engine,
            micro_batch_size=train.micro_batch_size,
            checkpointing=train.gradient_checkpointing,
            images=images,
        )
    except FinetuneError as exc:
        return {"unavailable": str(exc)}
    online = online_section(recipe)
    out = {
        "engine": engine.describe(),
        "micro_batch_size": train.micro_batch_size,
        "seq_len": data.packing_len
        if data.sample_packing
        else data.sequence_len
        if online is None
        else training_tokens(train.micro_batch_size, recipe, online),
        "gradient_checkpointing": train.gradient_checkpointing,
        "parts": [{"name": p.name, "gpu_bytes": p.gpu_bytes, "host_bytes": p.host_bytes} for p in est.parts],
        "total_gpu_bytes": est.total_gpu,
        "allowance_bytes": CUDA_ALLOWANCE_BYTES,
    }
    if est.rollout is not None:  # online RL: total_gpu_bytes is the larger of the two phases
        out["training_step_gpu_bytes"] = est.training_gpu
        out["rollout_parts"] = [{"name": "stays through the rollout", "gpu_bytes": est.rollout.resident}] + [
            {"name": p.name, "gpu_bytes": p.gpu_bytes} for p in est.rollout.parts
        ]
        out["rollout_gpu_bytes"] = est.rollout.total_gpu
    return out
