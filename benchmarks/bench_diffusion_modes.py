"""What each diffusion training mode costs on a tiny pipeline (CPU): trainable parameters, seconds per
optimizer step, and the size of what it saves.

Modes: denoiser LoRA (the baseline), LoRA + text-encoder LoRA, LoKr, LoHa, full fine-tuning with EMA;
each trains `--steps` steps (batch 2, 32 px, 8 solid-colour images) through finetune/train.py's main
in this process (tests/inprocess.py), on the tiny SD pipeline (or `--family sdxl|flux`).

    python benchmarks/bench_diffusion_modes.py [--steps 8] [--family sd]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {
    "lora": {},
    "lora + text encoder": {"train_text_encoder": True},
    "lokr": {"adapter": "lokr"},
    "loha": {"adapter": "loha"},
    "full + EMA": {"adapter": "full", "use_ema": True},
}
SAVED = {"lora": "pytorch_lora_weights.safetensors", "lokr": "{d}/", "loha": "{d}/", "full": "pipeline/{d}/"}


def _size(path: Path) -> int:
    return (
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def run(tmp: Path, family: str, steps: int, name: str, settings: dict) -> dict:
    import yaml

    from finetune.diffusion.tiny import build_tiny_pipeline
    from tests.diffusion_data import diffusion_recipe, write_color_folder
    from tests.integration._run import progress, train_here

    flags = {"sd": {}, "sdxl": {"sdxl": True}, "flux": {"flux": True}}[family]
    pipeline = build_tiny_pipeline(tmp / "pipeline", **flags)
    write_color_folder(tmp / "imgs")
    extra = {"max_sequence_length": 24} if family == "flux" else {}
    recipe = diffusion_recipe(tmp, pipeline, tmp / "imgs", **extra, **settings)
    recipe["train"].update({"max_steps": steps, "log_steps": 1})
    recipe["data"]["dataloader_drop_last"] = False
    if settings.get("adapter") == "full":
        recipe.pop("lora")  # no adapter sizes (the recipe would warn)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = train_here(path)
    if result.returncode != 0:
        raise SystemExit(f"{name}: training failed\n{result.stderr[-3000:]}")
    out = tmp / "out"
    records = [r for r in progress(out) if r.get("event") is None and "loss" in r]
    per_step = [2 / r["images_per_sec"] for r in records[1:]]  # 2 images per step; the first step warms up
    trainable = sum(int(m.replace(",", "")) for m in re.findall(r"([\d,]+) trainable", result.stdout))
    adapter = settings.get("adapter", "lora")
    denoiser = "transformer" if family == "flux" else "unet"
    saved = out / SAVED[adapter].format(d=denoiser)
    return {
        "mode": name,
        "trainable": trainable,
        "s_per_step": statistics.median(per_step),
        "saved": f"{SAVED[adapter].format(d=denoiser)}",
        "saved_bytes": _size(saved),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--family", default="sd", choices=["sd", "sdxl", "flux"])
    args = parser.parse_args()
    rows = []
    for name, settings in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run(Path(tmp), args.family, args.steps, name, settings))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| mode ({args.family}) | trainable params | s / step (median) | saved | size |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['trainable']:,} | {r['s_per_step']:.3f} | `{r['saved']}` | "
            f"{r['saved_bytes'] / 1024:.0f} KiB |"
        )


if __name__ == "__main__":
    main()
