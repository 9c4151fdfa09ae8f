"""Write what recipes/diffusion/tiny_cpu.yaml trains on: a tiny random SD pipeline and captioned images.

python recipes/diffusion/make_tiny_demo.py [outputs/diffusion-demo]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image

from finetune.diffusion.tiny import build_tiny_pipeline

COLORS = {"red": (230, 20, 20), "green": (20, 200, 40), "blue": (20, 40, 230), "yellow": (240, 230, 20)}
SIZES = [(48, 48), (64, 32), (32, 64), (40, 40)]  # squares, wide and tall: three buckets


def main(root: Path) -> None:
    build_tiny_pipeline(root / "tiny-sd")
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for (name, color), size in zip(COLORS.items(), SIZES, strict=True):
        for shade in range(2):
            file_name = f"{name}-{shade}.png"
            Image.new("RGB", size, tuple(max(0, c - 40 * shade) for c in color)).save(images / file_name)
            rows.append({"file_name": file_name, "text": f"a {name} square"})
    (images / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"tiny pipeline and {len(rows)} images written under {root}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/diffusion-demo"))
