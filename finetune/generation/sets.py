"""Generation sets end to end: rows -> greedy answers -> a score per row -> a summary.

`eval.generation_sets` are scored by `finetune eval` (`score_generation_sets` on each model) and,
with eval.during_training, at every evaluation of a training run (`generation_metrics`: the main
process generates, the scores go to progress.jsonl and the trackers). A vision-language model's sets
may carry images in their prompts, in the SFT data's shapes (`image_prompt`): they are opened and
checked when the set loads, and generated with the recipe's processor. Answers come from a generation
backend (finetune.generation.backends.answers; the transformers backend with the model being trained or
evaluated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from finetune import trackers
from finetune.data.formats.rows import BadRow
from finetune.errors import FinetuneError
from finetune.generation.backends import answers, backend_for
from finetune.generation.metrics import GSM8K_ANSWER_PATTERN, METRICS, require_math_verify, score


def evaluate_generations(
    backend,
    rows: Sequence[Mapping[str, Any]],
    *,
    metric: str = "exact_match",
    max_new_tokens: int = 256,
    batch_size: int = 8,
    num_samples: int | None = 5,
    pattern: str | None = GSM8K_ANSWER_PATTERN,
    case_sensitive: bool = False,
    use_chat_template: bool = True,
    progress: bool = True,
    toolbox=None,
) -> dict[str, Any]:
    """Generate an answer for every row with `backend` (finetune.generation.protocol) and score it;
    with a `toolbox` (finetune.generation.tools) the model calls its tools while it answers, and each
    sample also shows its calls ("tool_calls": `name(arguments) -> result`, the result as inserted).

    rows: mappings with "prompt" (a string or a list of chat messages) and, unless metric is none,
    "expected" (the reference answer; for exact_match a GSM8K answer with "#### 42" works as is).
    Returns {"metric", "score" (fraction correct; None for none), "n" (rows), "samples"}: the
    first `num_samples` rows (all of them when None) as {"prompt", "output", "expected", "correct"},
    plus "images" (where each came from) for rows with images. With a vision-language model's backend
    (it has a processor), rows from `load_generation_rows(..., vision=True)` are answered with their
    images.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    missing = [
        k for k, row in enumerate(rows) if "prompt" not in row or (metric != "none" and "expected" not in row)
    ]
    if missing:
        need = "prompt" if metric == "none" else "prompt and expected"
        raise ValueError(f"rows {missing[:5]} have no {need}; every row needs them for metric {metric}")
    vision = {}  # a vision-language model's prompts: the rows' messages, with their images
    if backend.processor is not None:
        vision = {"images": [row.get("image_bytes") or [] for row in rows]}
    prompts = [row.get("messages", row["prompt"]) if vision else row["prompt"] for row in rows]
    options = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "progress": progress}
    calls = None
    if toolbox is not None and vision:
        raise FinetuneError("tools in a generation set of a vision-language model are not supported yet")
    if toolbox is None:
        outputs = answers(backend, prompts, use_chat_template=use_chat_template, **options, **vision)
    else:
        from finetune.generation.tools import answers_with_tools

        outputs, calls = answers_with_tools(
            backend, prompts, toolbox, use_chat_template=use_chat_template, **options
        )
    results = [
        {
            "prompt": row["prompt"],
            **({"images": row["images"]} if row.get("images") else {}),
            "output": output,
            "expected": row.get("expected"),
            "correct": score(
                metric, output, row.get("expected"), pattern=pattern, case_sensitive=case_sensitive
            ),
            **({"tool_calls": [f"{c.name}({c.arguments}) -> {c.result}" for c in calls[k]]} if calls else {}),
        }
        for k, (row, output) in enumerate(zip(rows, outputs, strict=True))
    ]
    return summarize(results, metric=metric, num_samples=num_samples)


def summarize(
    results: Sequence[Mapping[str, Any]], *, metric: str, num_samples: int | None = 5
) -> dict[str, Any]:
    """{"metric", "score", "n", "samples"} from scored rows: score is the fraction of rows correct
    (None for metric none or no rows).

    >>> summarize([{"correct": True}, {"correct": False}], metric="contains", num_samples=1)
    {'metric': 'contains', 'score': 0.5, 'n': 2, 'samples': [{'correct': True}]}
    """
    scored = [bool(r["correct"]) for r in results if r["correct"] is not None]
    value = sum(scored) / len(scored) if scored and metric != "none" else None
    samples = list(results if num_samples is None else results[:num_samples])
    return {"metric": metric, "score": value, "n": len(results), "samples": [dict(s) for s in samples]}


def load_generation_rows(
    gen_set, *, vision: bool = False, image_max_pixels: int | None = None, images_outside: bool = False
) -> list[dict[str, Any]]:
    """The rows of one generation set as {"prompt", "expected"} (its first num_rows rows).

    Loaded with the data layer's own loader (local files, Hub ids, damaged-file errors that name the
    file and line), then reduced to the columns the set names. For a vision-language model (`vision`)
    the prompts may carry images as the SFT data does (`image_prompt`): each row then also holds
    "messages" (the prompt, an image a SENTINEL in its text), "images" (where each image came from,
    for the samples) and "image_bytes" (each opened and checked now, resized to `image_max_pixels`).
    A text model's set with images is an error: the images would be lost.
    """
    from finetune.data.formats.images import base_dir
    from finetune.data.sources.readers import load_source
    from finetune.recipe import dataset_entry

    label = f"eval.generation_sets[{gen_set.name}]"
    if gen_set.metric == "math_verify":
        require_math_verify(f"{label}.metric")
    entry = dataset_entry(path=gen_set.path, type="input_output", split=gen_set.split)
    ds = load_source(entry, entry_label=label)
    columns = [c for c in (gen_set.field_prompt, gen_set.field_expected) if c is not None]
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise FinetuneError(
            f"{label}: {gen_set.path} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); "
            "set field_prompt / field_expected"
        )
    if gen_set.num_rows is not None:
        ds = ds.select(range(min(gen_set.num_rows, len(ds))))
    field_images = gen_set.field_images if gen_set.field_images in ds.column_names else None
    root = base_dir(gen_set.path)
    rows = []
    for k, row in enumerate(ds):
        out = {
            "prompt": row[gen_set.field_prompt],
            "expected": row.get(gen_set.field_expected) if gen_set.field_expected else None,
        }
        if not vision:
            if has_image_parts(out["prompt"]):
                raise FinetuneError(
                    f"{label}: {gen_set.path} row {k} has image parts, but the model reads only text "
                    "(model.kind is not vlm), so they would be lost; use a vision-language model "
                    "(model.kind: vlm) or a set without images"
                )
            rows.append(out)
            continue
        refs = row.get(field_images) if field_images else None
        found = image_prompt(
            out["prompt"], refs, gen_set, root=root, max_pixels=image_max_pixels, outside_ok=images_outside
        )
        if isinstance(found, BadRow):
            raise FinetuneError(f"{label}: {gen_set.path} row {k}: {found.detail}; {IMAGE_ROW_FIX}")
        rows.append(out | found)
    return rows


def has_image_parts(prompt: Any) -> bool:
    """Whether a prompt's messages hold image parts.

    >>> has_image_parts([{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]), has_image_parts("Hi")
    (True, False)
    """
    if isinstance(prompt, str) or not isinstance(prompt, list):
        return False
    contents = [m.get("content") for m in prompt if isinstance(m, dict)]
    return any(
        isinstance(part, dict) and (part.get("type") == "image" or part.get("image") is not None)
        for content in contents
        if isinstance(content, list)
        for part in content
    )


def image_prompt(
    prompt: Any, refs: Any, gen_set, *, root, max_pixels: int | None, outside_ok: bool = False
) -> dict[str, Any] | BadRow:
    """A prompt's images, in the shapes the SFT data reads: image parts in its messages
    ({"type": "image", "image": path relative to the set's file, or bytes}), or "<image>"
    placeholders in its text with the images in the row's `field_images` column (a string prompt is
    one user turn). Returns {"messages" (an image a SENTINEL in the text), "images" (where each came
    from), "image_bytes" (opened and checked: finetune.data.formats.images.load_image)}, or the bad row."""
    from finetune.data.formats import images
    from finetune.data.formats.chat import conversation
    from finetune.data.formats.chat_template import with_row_images

    field = gen_set.field_prompt
    if isinstance(prompt, str):
        conv = [{"role": "user", "content": prompt}]
    else:
        conv = conversation(prompt, field)
    if refs is None and not isinstance(conv, BadRow):
        # Placeholders without an images column: the count check says what is missing.
        refs = [] if any(images.IMAGE_PLACEHOLDER in m["content"] for m in conv) else None
    conv = with_row_images(conv, refs, gen_set.field_images)
    if isinstance(conv, BadRow):
        return conv
    where, loaded = [], []
    for j, message in enumerate(conv):
        for i, ref in enumerate(message.get("images") or []):
            at = f"{field}[{j}] (image {i})" if not isinstance(prompt, str) else f"{field} (image {i})"
            data = images.load_image(ref, at, root, max_pixels, outside_ok=outside_ok)
            if isinstance(data, BadRow):
                return data
            where.append(_image_name(ref, root))
            loaded.append(data)
    messages = [{k: v for k, v in m.items() if k != "images"} for m in conv]
    return {"messages": messages, "images": where, "image_bytes": loaded}


def _image_name(ref: Any, root) -> str:
    """How a sample names its image: the file's path (as found from the current folder), else what
    it is (an image stored in the set: its size)."""
    from PIL import Image

    from finetune.data.formats.images import describe

    path = ref if isinstance(ref, str) else (ref.get("path") if isinstance(ref, dict) else None)
    if isinstance(ref, Image.Image):  # a datasets Image feature, decoded by the loader
        path = getattr(ref, "filename", None) or None
        if path is None:
            return f"{ref.width}x{ref.height} image stored in the set"
    if isinstance(path, str) and not (isinstance(ref, dict) and ref.get("bytes")):
        return str(root / path) if root is not None and not Path(path).is_absolute() else path
    return f"{describe(ref)} stored in the set"


IMAGE_ROW_FIX = (
    "fix the row: image paths are relative to the set's file, an image part is "
    '{"type": "image", "image": PATH}, and each <image> placeholder needs one image in field_images'
)


def score_generation_sets(
    backend,
    sets: Sequence,
    rows: dict[str, list[dict]],
    *,
    batch_size: int,
    progress: bool = True,
    base: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """{set name: {"metric", "score", "n", "samples"}} for every generation set, answered by `backend`
    (a vision-language model's: the prompts with their images; a set's tools in the loop, their
    functions found beside the recipe, `base`, first)."""
    results = {}
    for gen_set in sets:
        toolbox = _set_toolbox(gen_set, backend.tokenizer, base)
        try:
            results[gen_set.name] = _score_set(backend, gen_set, rows, batch_size, progress, toolbox)
        finally:
            if toolbox is not None:
                toolbox.close()
    return results


def _set_toolbox(gen_set, tokenizer, base: Path | None):
    """A generation set's tools, loaded (None without)."""
    if not getattr(gen_set, "tools", None):
        return None
    from finetune.generation.tools import load_tools

    return load_tools(
        gen_set.tools, tokenizer=tokenizer, max_tool_calls=gen_set.max_tool_calls, timeout_s=gen_set.tool_timeout_s,
        base=base, label=f"eval.generation_sets[{gen_set.name}]",
    )  # fmt: skip


def _score_set(backend, gen_set, rows, batch_size: int, progress: bool, toolbox) -> dict[str, Any]:
    return evaluate_generations(
        backend,
        rows[gen_set.name],
        metric=gen_set.metric,
        max_new_tokens=gen_set.max_new_tokens,
        batch_size=batch_size,
        num_samples=gen_set.num_samples,
        pattern=gen_set.answer_pattern,
        case_sensitive=gen_set.case_sensitive,
        use_chat_template=gen_set.use_chat_template,
        progress=progress,
        toolbox=toolbox,
    )


def training_generation_rows(
    eval_settings,
    accelerator,
    *,
    vision: bool = False,
    image_max_pixels: int | None = None,
    images_outside: bool = False,
) -> dict[str, list[dict]]:
    """The eval.generation_sets' rows by set name, when they are scored during training ({} otherwise);
    a vision-language model's (`vision`) with their images (`load_generation_rows`)."""
    from accelerate.utils import DistributedType

    if not (eval_settings.generation_sets and eval_settings.during_training):
        return {}
    sharded = accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.zero_stage == 3
    )
    if sharded:
        raise FinetuneError(
            "eval.generation_sets during training: generation with a sharded model (FSDP, ZeRO-3) is not "
            "supported; set eval.during_training: false and run `finetune eval` on the saved model"
        )
    return {
        s.name: load_generation_rows(
            s, vision=vision, image_max_pixels=image_max_pixels, images_outside=images_outside
        )
        for s in eval_settings.generation_sets
    }


SAMPLE_COLUMNS = ["prompt", "output", "expected", "correct"]
IMAGE_SAMPLE_COLUMNS = ["images", *SAMPLE_COLUMNS]


def generation_metrics(
    accelerator, model, tokenizer, eval_settings, rows: dict, *, step: int, processor=None, base=None
) -> dict[str, Any]:
    """Generation sets scored on the main process (greedy decoding of the unwrapped model, through the
    transformers backend); the others wait. Scores and samples go to progress.jsonl, and to the trackers as scalars and tables;
    a vision-language model's samples (`processor`) name their images, and trackers that take images
    get each sample's images captioned with its answer."""
    acc, fields = accelerator, {}
    if acc.is_main_process:
        backend = backend_for("transformers", acc.unwrap_model(model), tokenizer, processor=processor)
        results = score_generation_sets(
            backend, eval_settings.generation_sets, rows, batch_size=eval_settings.batch_size, progress=False,
            base=base,
        )  # fmt: skip
        for name, result in results.items():
            if result["score"] is not None:
                fields[f"eval_{name}_{result['metric']}"] = result["score"]
                trackers.log_scalars(acc, {f"eval/{name}_{result['metric']}": result["score"]}, step)
            fields[f"eval_{name}_samples"] = result["samples"]
            _log_samples(acc, name, result["samples"], rows[name], step)
    acc.wait_for_everyone()
    return fields


def _log_samples(acc, name: str, samples: list[dict], rows: list[dict], step: int) -> None:
    """A set's samples as a tracker table (with an images column when they have images), and the
    samples' images to the trackers that take images, each captioned with its prompt and answer."""
    columns = IMAGE_SAMPLE_COLUMNS if any("images" in s for s in samples) else SAMPLE_COLUMNS
    table = [[_cell(sample, c) for c in columns] for sample in samples]
    trackers.log_table(acc, f"eval/{name}_samples", columns, table, step)
    shown = [(s, row) for s, row in zip(samples, rows, strict=False) if row.get("image_bytes")]
    if shown and acc.trackers:
        from finetune.data.formats.images import decode

        pictures = [[decode(b) for b in row["image_bytes"]] for _, row in shown]
        captions = [f"{_text(s['prompt'])} -> {s['output']}" for s, _ in shown]
        trackers.log_images(acc, f"eval/{name}_images", pictures, captions, step)


def _cell(sample: dict, column: str) -> Any:
    value = sample.get(column)
    return ", ".join(value) if column == "images" and value else value


def _text(prompt: Any) -> str:
    """A prompt as one line of text (its messages' text contents joined)."""
    if isinstance(prompt, str):
        return prompt
    pieces = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        pieces.append(str(content or ""))
    return " / ".join(p for p in pieces if p)
