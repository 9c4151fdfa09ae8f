"""Images, folders and recipes for the diffusion tests (generated here: nothing is downloaded).

Every image is a solid colour named in its caption ("a red square"), so a test can tell from a
caption which image a cached latent must come from.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from PIL import Image

COLORS = {
    "red": (230, 20, 20),
    "green": (20, 200, 40),
    "blue": (20, 40, 230),
    "white": (250, 250, 250),
    "black": (5, 5, 5),
    "yellow": (240, 230, 20),
    "purple": (140, 20, 160),
    "cyan": (20, 220, 220),
}
# (width, height): squares, wide and tall images -> several buckets at 32 px.
SIZES = [(40, 40), (64, 32), (32, 64), (48, 48), (72, 36), (36, 36), (30, 60), (44, 44)]


def caption(color: str) -> str:
    return f"a {color} square"


def color_of(text: str) -> str:
    return text.split()[1]


def write_color_folder(folder: Path, *, captions: str = "jsonl", count: int = len(COLORS)) -> list[str]:
    """Solid-colour images of several aspect ratios with captions in metadata.jsonl, metadata.csv or
    .txt sidecars; returns the colour names in file order."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(COLORS)[:count]
    rows = []
    for name, size in zip(names, SIZES, strict=False):
        Image.new("RGB", size, COLORS[name]).save(folder / f"{name}.png")
        rows.append({"file_name": f"{name}.png", "text": caption(name)})
        if captions == "txt":
            (folder / f"{name}.txt").write_text(caption(name) + "\n")
    if captions == "jsonl":
        (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif captions == "csv":
        with open(folder / "metadata.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["file_name", "text"])
            writer.writeheader()
            writer.writerows(rows)
    return names


def diffusion_recipe(tmp: Path, pipeline: Path, data: Path, *, type_: str = "images", **diffusion) -> dict:
    """A small CPU diffusion recipe (32 px, batch 2, fp32) as a dict."""
    return {
        "model": {"kind": "diffusion", "model_path": str(pipeline)},
        "data": {
            "datasets": [{"path": str(data), "type": type_}],
            "dataset_prepared_path": str(tmp / "prepared"),
            "dataloader_num_workers": 0,
            "dataloader_prefetch_factor": None,
        },
        "train": {
            "output_dir": str(tmp / "out"),
            "micro_batch_size": 2,
            "max_steps": 4,
            "lr": 1e-3,
            "mixed_precision": "no",
            "save_epochs": 0,
            "log_format": "structured",
        },
        "lora": {"lora_rank": 4, "lora_alpha": 8},
        "diffusion": {"resolution": 32, "encode_batch_size": 4, **diffusion},
    }
