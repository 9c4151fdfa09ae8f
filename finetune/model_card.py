"""The model card (README.md) written next to the final adapter or model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError
from finetune.gguf.convert import describe_gguf
from finetune.gguf.names import portable_base

_HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def _table(rows: list[tuple[str, Any]]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    return "\n".join(lines)


def hub_model_id(model_path: str | None) -> str | None:
    """`model_path` when it names a Hub model (`org/name` or `name`), None for a local folder.

    The Hub rejects a card whose `base_model` metadata is not a model id, so a local path (which
    means nothing to readers of the card anyway) stays out of the metadata.

    >>> hub_model_id("meta-llama/Llama-3.1-8B"), hub_model_id("/tmp/tiny")
    ('meta-llama/Llama-3.1-8B', None)
    """
    if not model_path or Path(model_path).exists() or not _HUB_ID_RE.fullmatch(model_path):
        return None
    return model_path


def _gguf_base(model: dict) -> dict | None:
    """For a GGUF base: the card's base-model sentence and the Hub repository the file was converted
    from (its metadata's, or None); None for any other base."""
    try:
        found = describe_gguf(model["model_path"], model.get("gguf_file"), model.get("revision"))
    except FinetuneError:  # the file is gone since training read it: the card names the reference only
        found = {
            "reference": portable_base(model["model_path"], model.get("gguf_file"), model.get("revision"))
        }
        if found["reference"] is None:
            return None
    if found is None:
        return None
    details = [f"GGUF file `{found['reference']}`"]
    if found.get("name"):
        details.append(f"({found['name']})")
    if found.get("source_repo"):
        details.append(
            f"converted from [{found['source_repo']}](https://huggingface.co/{found['source_repo']})"
        )
    text = " ".join(details) + (
        ", dequantized by finetune into a Hugging Face model; `finetune chat`, `finetune eval` and "
        "`finetune merge-lora` rebuild that base from the file on any machine (pass --base FILE where "
        "the file lies elsewhere)"
    )
    return {"text": text, "source_repo": found.get("source_repo")}


def history_section(extensions: list[dict]) -> list[str]:
    """The card's "Training history" section for a run made longer on resume (train.extend_run).

    >>> print(history_section([{"step": 4, "from_total_steps": 4, "to_total_steps": 8}])[0])
    ## Training history
    <BLANKLINE>
    - at step 4, the run of 4 steps was extended to 8 steps (`train.extend_run`): the learning-rate schedule was rebuilt for 8 steps and continued from step 4
    """
    if not extensions:
        return []
    lines = [
        f"- at step {e['step']}, the run of {e['from_total_steps']} steps was extended to {e['to_total_steps']} "
        f"steps (`train.extend_run`): the learning-rate schedule was rebuilt for {e['to_total_steps']} steps "
        f"and continued from step {e['step']}"
        for e in extensions
    ]
    return ["## Training history\n\n" + "\n".join(lines)]


def _dataset_text(entry: dict) -> str:
    """A training dataset in the card: its path and type, and its mixture weight unless 1.

    >>> _dataset_text({"path": "a.jsonl", "type": "alpaca", "weight": 0.5})
    '`a.jsonl` (alpaca, weight 0.5)'
    """
    weight = entry.get("weight", 1)
    return f"`{entry['path']}` ({entry['type']}{f', weight {weight:g}' if weight != 1 else ''})"


def manifest_rows(manifest: dict) -> list[tuple[str, Any]]:
    """The prepared LLM dataset's figures that the card shows (and `finetune report`): fingerprint,
    rows in and kept, drops by reason, tokens, packing efficiency.

    >>> manifest_rows({"fingerprint": "ab12", "rows_in": 10, "rows_kept": 9, "dropped": {"too_long": 1}})[1:3]
    [('rows in / kept', '10 / 9'), ('dropped', {'too_long': 1})]
    """
    return [
        ("prepared fingerprint", manifest.get("fingerprint")),
        ("rows in / kept", f"{manifest.get('rows_in')} / {manifest.get('rows_kept')}"),
        ("dropped", manifest.get("dropped") or "none"),
        (
            "tokens / trainable tokens",
            f"{manifest.get('num_tokens')} / {manifest.get('num_trainable_tokens')}",
        ),
        ("packing efficiency", manifest.get("packing_efficiency")),
    ]


def render_model_card(*, recipe: dict, manifest: dict, metrics: dict, extensions: list[dict] = ()) -> str:
    """Card text: base model, data (from the prepared dataset's manifest), hyperparameters, metrics,
    and the run's extensions (`history_section`).

    `recipe` is the resolved recipe as plain data; it never holds a token (tokens come from the
    environment only), so nothing secret can reach the card.
    """
    from huggingface_hub import ModelCard, ModelCardData

    model, train, lora, data = recipe["model"], recipe["train"], recipe["lora"], recipe["data"]
    base = model["model_path"] or "random initialisation from an inline config (see base_model/)"
    gguf = _gguf_base(model)
    if gguf is not None:
        base = gguf["text"]
    uses_lora = lora["enable_lora"]
    reward = train.get("objective") == "reward"  # a reward model scores text, it does not generate
    card_data = ModelCardData(
        base_model=gguf["source_repo"] if gguf is not None else hub_model_id(model["model_path"]),
        library_name="peft" if uses_lora and lora["save_lora_only"] else "transformers",
        tags=[
            "finetune",
            "lora" if uses_lora else "full-fine-tune",
            *(["qlora"] if lora["enable_qlora"] else []),
            *(["reward-model"] if reward else []),
        ],
        pipeline_tag="text-classification" if reward else "text-generation",
    )
    datasets = ", ".join(_dataset_text(d) for d in data["datasets"])
    hyper = [
        (
            "learning rate",
            f"{train['lr']} ({train['lr_decay_style']}, warmup ratio {train['lr_warmup_ratio']})",
        ),
        (
            "micro batch x accumulation",
            f"{train['micro_batch_size']} x {train['gradient_accumulation_steps']}",
        ),
        ("epochs / max steps", f"{train['num_train_epochs']} / {train['max_steps']}"),
        ("optimizer", f"{train['optimizer']} (weight decay {train['weight_decay']})"),
        ("mixed precision", train["mixed_precision"]),
        ("sequence length", f"{data['sequence_len']} (packing: {data['sample_packing']})"),
    ]
    if uses_lora:
        hyper.append(
            (
                "LoRA",
                f"r={lora['lora_rank']}, alpha={lora['lora_alpha']}, dropout={lora['lora_dropout']}, "
                f"targets={lora['lora_target_modules']}",
            )
        )
    data_rows = [("datasets", datasets), *manifest_rows(manifest)]
    metric_rows = [(k, f"{v:.4f}" if isinstance(v, float) else v) for k, v in metrics.items()]
    content = "\n\n".join(
        [
            f"---\n{card_data.to_yaml()}\n---",
            "# Fine-tuned with finetune",
            f"Base model: {base}.",
            "## Data\n\n" + _table(data_rows),
            "## Hyperparameters\n\n" + _table(hyper),
            "## Final metrics\n\n" + _table(metric_rows),
            *history_section(list(extensions)),
            "The full resolved recipe is in `recipe.resolved.yaml`.",
        ]
    )
    return str(ModelCard(content))


def write_model_card(
    folder: Path, *, recipe: dict, manifest: dict, metrics: dict, extensions: list[dict] = ()
) -> Path:
    path = Path(folder) / "README.md"
    text = render_model_card(recipe=recipe, manifest=manifest, metrics=metrics, extensions=extensions)
    path.write_text(text, encoding="utf-8")
    return path


def render_diffusion_model_card(
    *,
    recipe: dict,
    manifest: dict,
    metrics: dict,
    samples: list[tuple[str, str]],
    extensions: list[dict] = (),
) -> str:
    """Card of a diffusion LoRA: base pipeline, how to load it, data (manifest), settings, samples.

    `samples` are (prompt, path relative to the card) pairs of the final validation images.
    """
    from huggingface_hub import ModelCard, ModelCardData

    model, train, lora, diffusion = recipe["model"], recipe["train"], recipe["lora"], recipe["diffusion"]
    family = manifest.get("pipeline", {}).get("class_name", "StableDiffusionPipeline")
    card_data = ModelCardData(
        base_model=hub_model_id(model["model_path"]),
        library_name="diffusers",
        tags=["finetune", "lora", "diffusers", "text-to-image", "diffusers-training"]
        + (["dreambooth"] if diffusion["instance_prompt"] else []),
        pipeline_tag="text-to-image",
        instance_prompt=diffusion["instance_prompt"],
    )
    prompt = diffusion["instance_prompt"] or (diffusion["validation_prompts"] or ["a photo"])[0]
    usage = "\n".join(
        [
            "```python",
            f"from diffusers import {family}",
            "",
            f'pipeline = {family}.from_pretrained("{model["model_path"]}")',
            'pipeline.load_lora_weights("<this repo or folder>")',
            f'image = pipeline("{prompt}").images[0]',
            "```",
        ]
    )
    data_rows = [
        ("datasets", ", ".join(f"`{d['path']}` ({d['type']})" for d in recipe["data"]["datasets"])),
        ("prepared fingerprint", manifest.get("fingerprint")),
        ("images in / kept", f"{manifest.get('rows_in')} / {manifest.get('rows_kept')}"),
        ("class images (prior preservation)", manifest.get("class_images") or None),
        ("dropped", manifest.get("dropped") or "none"),
        ("buckets", ", ".join(f"{k}: {v}" for k, v in (manifest.get("buckets") or {}).items())),
    ]
    objective = ("noise offset / min-SNR gamma", f"{diffusion['noise_offset']} / {diffusion['snr_gamma']}")
    # Flow matching (SD3, Flux, Qwen-Image, Flux.2) weights timesteps its own way.
    if manifest.get("pipeline", {}).get("family") in ("sd3", "flux", "qwenimage", "flux2"):
        objective = ("objective", f"flow matching, weighting_scheme {diffusion['weighting_scheme']}")
    hyper = [
        ("resolution", f"{diffusion['resolution']} (buckets: {diffusion['aspect_ratio_buckets']})"),
        (
            "learning rate",
            f"{train['lr']} ({train['lr_decay_style']}, warmup ratio {train['lr_warmup_ratio']})",
        ),
        (
            "micro batch x accumulation",
            f"{train['micro_batch_size']} x {train['gradient_accumulation_steps']}",
        ),
        ("epochs / max steps", f"{train['num_train_epochs']} / {train['max_steps']}"),
        ("mixed precision", train["mixed_precision"]),
        ("LoRA", f"r={lora['lora_rank']}, alpha={lora['lora_alpha']}, targets={lora['lora_target_modules']}"),
        objective,
        ("EMA", diffusion["ema_decay"] if diffusion["use_ema"] else "off"),
    ]
    if diffusion["with_prior_preservation"]:
        hyper.append(
            ("prior preservation", f"{diffusion['class_prompt']!r}, weight {diffusion['prior_loss_weight']}")
        )
    sections = [
        f"---\n{card_data.to_yaml()}\n---",
        "# LoRA fine-tuned with finetune",
        f"LoRA weights (`pytorch_lora_weights.safetensors`, diffusers format) for {model['model_path']}.",
        "## Use\n\n" + usage,
    ]
    if samples:
        sections.append("## Samples\n\n" + "\n".join(f"![{p}]({path})" for p, path in samples))
    metric_rows = [(k, f"{v:.4f}" if isinstance(v, float) else v) for k, v in metrics.items()]
    sections += [
        "## Data\n\n" + _table(data_rows),
        "## Hyperparameters\n\n" + _table(hyper),
        "## Final metrics\n\n" + _table(metric_rows),
        *history_section(list(extensions)),
        "The full resolved recipe is in `recipe.resolved.yaml`.",
    ]
    return str(ModelCard("\n\n".join(sections)))


def write_diffusion_model_card(
    folder: Path,
    *,
    recipe: dict,
    manifest: dict,
    metrics: dict,
    samples: list[tuple[str, str]],
    extensions: list[dict] = (),
) -> Path:
    path = Path(folder) / "README.md"
    text = render_diffusion_model_card(
        recipe=recipe, manifest=manifest, metrics=metrics, samples=samples, extensions=extensions
    )
    path.write_text(text, encoding="utf-8")
    return path
