"""`prepare_images(recipe)`: image sources -> cached VAE latents and text-encoder outputs.

The diffusion counterpart of finetune.data.prepare.build.prepare, with the same cache discipline (its
helpers are reused): the output lives in `data.dataset_prepared_path/<fingerprint>/` (`train/`, an
Arrow dataset, and `manifest.json`), is written to a temporary folder and renamed into place, and a
file lock keeps two processes from building the same fingerprint.

What one row holds (one row = one example, identified by `index`, never by a dataloader position,
so shuffling can never pair a latent with another image's caption):

* the caption and the text-encoder outputs of that caption (`prompt_embeds`, SDXL, SD3 and Flux:
  also `pooled_prompt_embeds`; SD3: CLIP-L + CLIP-G + T5 as StableDiffusion3Pipeline.encode_prompt
  computes them, Flux: T5 hidden states and CLIP's pooled output as FluxPipeline.encode_prompt does,
  with diffusion.max_sequence_length T5 tokens; Qwen-Image: Qwen2.5-VL's hidden states, unpadded, each
  caption its own length; Flux.2: Qwen3's stacked hidden states as Flux2KleinPipeline.encode_prompt
  computes them), computed once per distinct caption;
* the latent distribution of the resized and cropped image: `latent_mean` and `latent_std`
  (raw: neither shifted nor scaled, for every family). Training samples `mean + std * N(0, 1)` at
  every step, as encoding every step would, instead of freezing one sample at prepare time, then
  applies the VAE's `(z - shift_factor) * scaling_factor` (both recorded in the manifest; SD3's and
  Flux's VAEs have a shift factor, SD/SDXL's none; Qwen-Image's and Flux.2's are per channel: the
  VAE's latents_mean / latents_std, and its BatchNorm statistics of the 2x2-patchified latents);
* with `random_flip`, the same for the horizontally flipped image (`*_flipped`): flips cannot be
  drawn per step once latents are cached, so both variants are stored and the loader picks one per
  (seed, epoch, position);
* the bucket and SDXL's size conditioning (original size, crop offsets, target size).

The fingerprint covers the image files' contents, captions (metadata/sidecar files, instance and
class prompts), the VAE and text encoders (file hashes of local folders, the commit of Hub repos),
resolution, buckets, crop and flip settings, and a format version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch

from finetune.data.prepare.cache import (
    MANIFEST_NAME,
    Prepared,
    cached_or_built,
    canonical_json,
    compute_fingerprint,
    library_versions,
    load_complete,
    write_atomically,
)
from finetune.data.sources.location import file_hash
from finetune.diffusion import images as img
from finetune.diffusion.model import (
    PipelineInfo,
    check_settings,
    encode_pixels,
    encode_prompts,
    load_text_encoders,
    load_vae,
    max_pixel_side,
    pipeline_info,
    pixel_multiple,
)
from finetune.diffusion.sources import (
    ImageRecord,
    SourceRecords,
    entry_fingerprint,
    folder_fingerprint,
    list_images,
    load_class_images,
    load_entry,
)
from finetune.errors import DataError, RecipeError

if TYPE_CHECKING:
    from finetune.recipe import Recipe

# Bump when the cached columns or their meaning change: old caches are then ignored.
CACHE_FORMAT_VERSION = 1
# Files of a model folder that do not change its outputs.
_NOT_HASHED = {"README.md", ".gitattributes"}


def prepare_images(
    recipe: Recipe, *, push: bool = False, log: Callable[[str], None] = print, device: Any = None
) -> Prepared:
    """The cached latents of a diffusion recipe: from the cache when present, else built and cached.

    `device` runs the VAE and text encoders (default: CUDA when available). Prior preservation
    first generates the missing class images (saved in diffusion.class_data_dir, so they are part
    of the fingerprint like any other image).
    """
    data = recipe.data
    if push:
        raise RecipeError("pushing prepared image datasets (cached latents) to the Hub is not supported yet")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = recipe.diffusion
    info = pipeline_info(recipe.model.model_path, recipe.model.revision, settings.vae_path)
    check_settings(info, settings)  # before any encoding or class-image generation
    if settings.with_prior_preservation and not data.skip_prepare_dataset:
        from finetune.diffusion.sampling import ensure_class_images

        ensure_class_images(settings, info, seed=recipe.train.seed, device=device, log=log)
    inputs = fingerprint_inputs(recipe, info)
    fingerprint = compute_fingerprint(inputs)
    root = Path(data.dataset_prepared_path)
    if data.skip_prepare_dataset:
        prepared = load_complete(root / fingerprint)
        if prepared is None:
            raise DataError(
                f"data.skip_prepare_dataset: no cached latents for this recipe at {root / fingerprint}; create "
                "them with `finetune prepare-dataset <recipe.yaml>` (same recipe and overrides)"
            )
    else:
        prepared = cached_or_built(
            root,
            fingerprint,
            build=lambda: _build(recipe, info, inputs, root, fingerprint, log, device),
            log=log,
            what="image dataset",
        )
    if prepared.source == "cache":
        log(f"reusing prepared image dataset {fingerprint} at {prepared.path} (nothing to encode)")
    log(summary(prepared))
    return prepared


# ------------------------------------------------------------------------------------- fingerprint


def fingerprint_inputs(recipe: Recipe, info: PipelineInfo) -> dict:
    """Everything the cached latents depend on, as plain JSON data (hashed by compute_fingerprint).

    Not included because they do not change the output: the folder paths of local sources (their
    contents are hashed), encode_batch_size, and everything about training and sampling.
    """
    settings, data = recipe.diffusion, recipe.data
    entries = []
    for entry in data.datasets:
        fields = {"type": entry.type, "name": entry.name, "split": entry.split, "revision": entry.revision}
        entries.append({"settings": fields, "source": entry_fingerprint(entry)})
    prior = None
    if settings.with_prior_preservation:
        folder = Path(settings.class_data_dir)
        files = folder_fingerprint(folder, captions=False)["files"] if folder.is_dir() else {}
        kept = dict(sorted(files.items())[: settings.num_class_images])  # list_images order = sorted names
        prior = {
            "prompt": settings.class_prompt,
            "num_class_images": settings.num_class_images,
            "files": kept,
        }
    image_settings = {
        "resolution": settings.resolution,
        "aspect_ratio_buckets": settings.aspect_ratio_buckets,
        "pixel_multiple": pixel_multiple(info),
        "center_crop": settings.center_crop,
        "random_flip": settings.random_flip,
        "min_image_side": min_image_side(settings),
    }
    if not settings.center_crop:
        image_settings["crop_seed"] = recipe.train.seed  # random crops are drawn from it
    vae_path, vae_subfolder = info.vae_location()
    text_parts = [*info.text_encoder_names, *info.tokenizer_names]
    inputs = {
        "format_version": CACHE_FORMAT_VERSION,
        "kind": "diffusion",
        "datasets": entries,
        "prior": prior,
        "captions": {
            "caption_column": settings.caption_column,
            "image_column": settings.image_column,
            "instance_prompt": settings.instance_prompt,
        },
        "on_bad_row": data.on_bad_row,
        "pipeline": {"class_name": info.class_name, "family": info.family},
        "vae": component_identity(vae_path, vae_subfolder, info.revision),
        "text_encoders": [component_identity(info.path, name, info.revision) for name in text_parts],
        "image": image_settings,
    }
    # Only the T5 pipelines (SD3, Flux) read it, resolved (null = the pipeline's default); the key is
    # absent for SD/SDXL, so their fingerprints stay what they were.
    length = info.sequence_length(settings.max_sequence_length)
    if length is not None:
        inputs["text"] = {"max_sequence_length": length}
    return inputs


def min_image_side(settings: Any) -> int:
    """diffusion.min_image_side, or half the resolution when it is null."""
    return settings.min_image_side or max(1, settings.resolution // 2)


def component_identity(path: str, subfolder: str | None, revision: str | None) -> dict:
    """A pipeline part's identity: content hashes of its local files, or the Hub commit."""
    local = Path(path).expanduser()
    if local.is_dir():
        folder = local / subfolder if subfolder else local
        if not folder.is_dir():
            raise DataError(f"{local} has no {subfolder}/ folder: is it a complete diffusers pipeline?")
        files = {
            p.relative_to(folder).as_posix(): file_hash(p)
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in _NOT_HASHED and not p.name.startswith(".")
        }
        return {"kind": "local", "subfolder": subfolder, "files": files}
    return {"kind": "hub", "repo": path, "subfolder": subfolder, "sha": _hub_sha(path, revision)}


def _hub_sha(repo: str, revision: str | None) -> str:
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        return HfApi().model_info(repo, revision=revision).sha
    except Exception as exc:  # offline: the cached snapshot names its commit
        cached = try_to_load_from_cache(repo, "model_index.json", revision=revision)
        if isinstance(cached, str) and "snapshots" in Path(cached).parts:
            parts = Path(cached).parts
            return parts[parts.index("snapshots") + 1]
        raise DataError(
            f"cannot resolve {repo!r} (revision {revision or 'main'}) to a commit: {type(exc).__name__}: {exc}"
        ) from exc


# ------------------------------------------------------------------------------------------ build


def _build(
    recipe: Any, info: PipelineInfo, inputs: dict, root: Path, fingerprint: str, log: Callable, device
) -> Prepared:
    settings, data = recipe.diffusion, recipe.data
    t_start = time.perf_counter()
    sources = [
        load_entry(entry, f"data.datasets[{i}]", settings, data.on_bad_row)
        for i, entry in enumerate(data.datasets)
    ]
    if settings.with_prior_preservation:
        sources.append(
            load_class_images(Path(settings.class_data_dir), settings.class_prompt, settings.num_class_images)
        )
    records = [r for s in sources for r in s.records]
    timings = {"list": time.perf_counter() - t_start}
    multiple = pixel_multiple(info)
    if settings.resolution % multiple:
        raise RecipeError(
            f"diffusion.resolution: {settings.resolution} is not a multiple of {multiple} (what {info.path} needs); "
            f"use e.g. {round(settings.resolution / multiple) * multiple}"
        )
    buckets = img.make_buckets(settings.resolution, multiple, enabled=settings.aspect_ratio_buckets)
    longest, limit = max(max(b) for b in buckets), max_pixel_side(info)
    if limit is not None and longest > limit:
        raise RecipeError(
            f"diffusion.resolution: {settings.resolution} gives buckets with sides up to {longest} px, beyond the "
            f"{limit} px that {info.path}'s position embeddings cover; lower resolution"
            + (" or set diffusion.aspect_ratio_buckets: false" if settings.aspect_ratio_buckets else "")
        )
    plan, drops = _assign_buckets(records, buckets, min_image_side(settings))
    log(f"{len(records)} images from {len(sources)} source(s); encoding {len(plan)} with the VAE on {device}")
    t0 = time.perf_counter()
    vae = load_vae(info, device)
    tokenizers, encoders = load_text_encoders(info, device)
    timings["load_models"] = time.perf_counter() - t0

    scratch = root / f".scratch-{fingerprint}-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        features = _features(flip=settings.random_flip, sdxl=info.spec.pooled)
        from datasets.arrow_writer import ArrowWriter

        # Written batch by batch: memory stays at one encode batch however large the dataset.
        with ArrowWriter(features=features, path=str(scratch / "rows.arrow")) as writer:
            for batch in _batches(plan, settings.encode_batch_size):
                for row in _encode_batch(
                    batch, records, settings, vae, tokenizers, encoders, info, recipe.train.seed, drops
                ):
                    writer.write(row)
            writer.finalize()
        timings["encode"] = time.perf_counter() - t0
        rows = datasets.Dataset.from_file(str(scratch / "rows.arrow"))
        if len(rows) == 0:
            counts = Counter()
            for source in sources:
                counts.update(source.dropped)
            for per_source in drops.counts.values():
                counts.update(per_source)
            raise DataError(
                f"no usable images: all {sum(s.rows_in for s in sources)} were dropped ({dict(counts)}); "
                f"examples: {drops.samples[:3] or [b for s in sources for b in s.bad_rows][:3]}"
            )
        manifest = _manifest(fingerprint, inputs, info, vae, sources, drops, rows, buckets, timings)
        write_atomically(
            root,
            fingerprint,
            {"train": rows},
            manifest,
            num_proc=1,
            num_shards=data.num_dataset_shards_to_save,
            started=t_start,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return load_complete(root / fingerprint, source="built")


class _Drops:
    """Images dropped while building (per source and reason), with a few named examples."""

    def __init__(self):
        self.counts: dict[str, Counter] = {}
        self.samples: list[dict] = []

    def add(self, record: ImageRecord, reason: str, detail: str) -> None:
        self.counts.setdefault(record.source, Counter())[reason] += 1
        if len(self.samples) < 20:
            self.samples.append(
                {"source": record.source, "key": record.key, "reason": reason, "detail": detail}
            )


def _assign_buckets(
    records: list[ImageRecord], buckets: list, min_side: int
) -> tuple[list[tuple[int, int]], _Drops]:
    """[(record index, bucket index)] for the usable images, grouped by bucket; drops counted.

    Reads only image headers (size and EXIF orientation), not the pixels.
    """
    from PIL import Image

    drops, plan = _Drops(), []
    for i, record in enumerate(records):
        try:
            with Image.open(_open(record)) as image:
                width, height = image.size
                if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # rotated by 90 degrees
                    width, height = height, width
        except Exception as exc:  # PIL raises many types for broken files
            drops.add(record, "unreadable", f"{type(exc).__name__}: {img._short(exc)}")
            continue
        if min(width, height) < min_side:
            drops.add(record, "too_small", f"{width}x{height}, shorter side below {min_side} px")
            continue
        plan.append((i, img.nearest_bucket(height, width, buckets)))
    plan.sort(key=lambda item: (item[1], item[0]))
    return [(i, bucket) for i, bucket in plan], drops


def _open(record: ImageRecord):
    import io

    return io.BytesIO(record.data) if record.data is not None else record.path


def _batches(plan: list[tuple[int, int]], size: int):
    """Runs of at most `size` plan items from the same bucket."""
    batch: list[tuple[int, int]] = []
    for item in plan:
        if batch and (len(batch) == size or batch[-1][1] != item[1]):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def _encode_batch(batch, records, settings, vae, tokenizers, encoders, info, seed: int, drops) -> list[dict]:
    """Decode, resize, crop (and flip) a batch of same-bucket images and encode them and their captions."""
    multiple = pixel_multiple(info)
    buckets = img.make_buckets(settings.resolution, multiple, enabled=settings.aspect_ratio_buckets)
    items = []
    for index, bucket in batch:
        record = records[index]
        try:
            image = img.load_image(record.read())
        except img.UnreadableImage as exc:  # header fine, pixels broken (e.g. a truncated file)
            drops.add(record, "unreadable", str(exc))
            continue
        rng = None if settings.center_crop else img.crop_rng(seed, f"{record.source}/{record.key}")
        cropped, crop = img.resize_and_crop(image, buckets[bucket], center=settings.center_crop, rng=rng)
        items.append((index, bucket, cropped, crop))
    if not items:
        return []
    pixels = torch.from_numpy(np.stack([img.to_pixels(c) for _, _, c, _ in items]))
    video = info.spec.video_vae
    mean, std = encode_pixels(vae, pixels, video=video)
    flipped = None
    if settings.random_flip:
        flipped = encode_pixels(
            vae, torch.from_numpy(np.stack([img.to_pixels(img.flip(c)) for _, _, c, _ in items])), video=video
        )
    captions = sorted({records[index].caption for index, *_ in items})
    embeds = encode_prompts(
        tokenizers,
        encoders,
        captions,
        info.family,
        max_sequence_length=info.sequence_length(settings.max_sequence_length),
    )
    position = {caption: k for k, caption in enumerate(captions)}
    prompt = embeds["prompt_embeds"]
    if "prompt_lengths" in embeds:  # Qwen-Image: each caption stored unpadded (the loader pads a batch)
        prompt = [prompt[k, : int(n)] for k, n in enumerate(embeds["prompt_lengths"])]
    rows = []
    for j, (index, bucket, _, crop) in enumerate(items):
        record, k = records[index], position[records[index].caption]
        row = {
            "index": index,
            "source": record.source,
            "key": record.key,
            "caption": record.caption,
            "is_prior": record.is_prior,
            "bucket": bucket,
            "height": crop.size[0],
            "width": crop.size[1],
            "original_height": crop.original_size[0],
            "original_width": crop.original_size[1],
            "crop_top": crop.top,
            "crop_left": crop.left,
            "crop_left_flipped": crop.left_flipped,
            "latent_shape": list(mean.shape[1:]),
            "latent_mean": mean[j].flatten().cpu().numpy(),
            "latent_std": std[j].flatten().cpu().numpy(),
            "prompt_shape": list(prompt[k].shape),
            "prompt_embeds": prompt[k].flatten().cpu().numpy(),
        }
        if flipped is not None:
            row["latent_mean_flipped"] = flipped[0][j].flatten().cpu().numpy()
            row["latent_std_flipped"] = flipped[1][j].flatten().cpu().numpy()
        if "pooled_prompt_embeds" in embeds:
            row["pooled_prompt_embeds"] = embeds["pooled_prompt_embeds"][k].cpu().numpy()
        rows.append(row)
    return rows


def _features(*, flip: bool, sdxl: bool) -> datasets.Features:
    """Column types; `sdxl`: the pooled text embedding column too (SDXL, SD3 and Flux)."""
    ints = ["bucket", "height", "width", "original_height", "original_width", "crop_top", "crop_left"]
    spec: dict[str, Any] = {
        "index": datasets.Value("int64"),
        "source": datasets.Value("string"),
        "key": datasets.Value("string"),
        "caption": datasets.Value("string"),
        "is_prior": datasets.Value("bool"),
        **{name: datasets.Value("int32") for name in [*ints, "crop_left_flipped"]},
        "latent_shape": datasets.List(datasets.Value("int32")),
        "latent_mean": datasets.List(datasets.Value("float32")),
        "latent_std": datasets.List(datasets.Value("float32")),
        "prompt_shape": datasets.List(datasets.Value("int32")),
        "prompt_embeds": datasets.List(datasets.Value("float32")),
    }
    if flip:
        spec["latent_mean_flipped"] = datasets.List(datasets.Value("float32"))
        spec["latent_std_flipped"] = datasets.List(datasets.Value("float32"))
    if sdxl:
        spec["pooled_prompt_embeds"] = datasets.List(datasets.Value("float32"))
    return datasets.Features(spec)


# --------------------------------------------------------------------------------------- manifest


def _manifest(
    fingerprint, inputs, info, vae, sources: list[SourceRecords], drops: _Drops, rows, buckets, timings
):
    per_source = []
    for s in sources:
        dropped = Counter(s.dropped) + drops.counts.get(s.label, Counter())
        stats = {
            "dataset": s.label,
            "path": s.path,
            "type": s.type,
            "rows_in": s.rows_in,
            "dropped": dict(sorted(dropped.items())),
            "rows_dropped": sum(dropped.values()),
        }
        stats["rows_kept"] = stats["rows_in"] - stats["rows_dropped"]
        per_source.append(stats)
    total_dropped: Counter = Counter()
    for stats in per_source:
        total_dropped.update(stats["dropped"])
    bucket_column = np.asarray(rows["bucket"], dtype=np.int64) if len(rows) else np.zeros(0, np.int64)
    histogram = {f"{h}x{w}": int((bucket_column == b).sum()) for b, (h, w) in enumerate(buckets)}
    prior = np.asarray(rows["is_prior"], dtype=bool) if len(rows) else np.zeros(0, bool)
    manifest = {
        "fingerprint": fingerprint,
        "fingerprint_sha256": hashlib.sha256(canonical_json(inputs).encode()).hexdigest(),
        "format_version": CACHE_FORMAT_VERSION,
        "kind": "diffusion",
        "fingerprint_inputs": inputs,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pipeline": {"path": info.path, "class_name": info.class_name, "family": info.family},
        "rows_in": sum(s["rows_in"] for s in per_source),
        "rows_kept": len(rows),
        "rows_dropped": sum(total_dropped.values()),
        "dropped": dict(sorted(total_dropped.items())),
        "instance_images": int((~prior).sum()),
        "class_images": int(prior.sum()),
        "rows_out": {"train": len(rows)},
        "buckets": {k: v for k, v in histogram.items() if v},
        "bucket_sizes": [list(b) for b in buckets],
        "latents": {
            "stored": "mean and std of the VAE latent distribution (unscaled); sampled every step",
            "flipped_variants": "latent_mean_flipped" in rows.column_names,
            **info.spec.latent_norm(vae),  # scaling_factor and shift_factor: numbers or per channel
        },
        "sources": per_source,
        "bad_row_samples": [b for s in sources for b in s.bad_rows][:20] + drops.samples,
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "versions": library_versions("diffusers", "pillow"),
    }
    if manifest["rows_in"] != manifest["rows_kept"] + manifest["rows_dropped"]:
        raise AssertionError(f"image accounting does not balance: {json.dumps(per_source)}")
    return manifest


def summary(prepared: Prepared) -> str:
    """A few lines for the end of `finetune prepare-dataset`: images, drops, buckets, location."""
    m = prepared.manifest
    drops = ", ".join(f"{k}={v}" for k, v in m.get("dropped", {}).items()) or "none"
    buckets = ", ".join(f"{k}: {v}" for k, v in m.get("buckets", {}).items())
    return "\n".join(
        [
            f"prepared dataset {m['fingerprint']} ({prepared.source}) at {prepared.path}",
            f"  images: {m['rows_in']} in, {m['rows_kept']} kept ({m['instance_images']} instance, "
            f"{m['class_images']} class), {m['rows_dropped']} dropped ({drops})",
            f"  buckets: {buckets}",
        ]
    )


def class_image_count(folder: Path) -> int:
    return len(list_images(folder)) if folder.is_dir() else 0


__all__ = ["MANIFEST_NAME", "fingerprint_inputs", "prepare_images", "summary"]
