"""Token counts, throughput, FLOPs / MFU, and the progress log (progress.jsonl + console)."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

# Dense bf16/fp16 tensor-core peak FLOP/s per device, from the vendors' datasheets (no sparsity).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Peak dense 16-bit FLOP/s of a CUDA device from the table, None on CPU or unknown devices."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():  # ordered most specific first
        if key in name:
            return value
    return None


def model_flops_per_token(config, *, num_params: int, num_trainable: int, seq_len_sq_mean: float) -> float:
    """Training FLOPs per token: matmuls + attention.

    Matmuls: 2 FLOPs per parameter forward, 2 backward for activation gradients, and 2 more for
    weight gradients of trainable parameters (6N for full fine-tuning, ~4N for LoRA).
    Attention: 12 * layers * hidden * (effective sequence length), where the effective length is
    sum(len^2)/sum(len) over the sequences in the batch (packed sequences only attend within
    themselves), counted non-causally as in the PaLM MFU formula.
    """
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    matmul = 4 * num_params + 2 * num_trainable
    return matmul + 12 * layers * hidden * seq_len_sq_mean


def forward_flops_per_token(config, *, num_params: int, seq_len_sq_mean: float) -> float:
    """FLOPs per token of a forward pass only (a reference model's, or a no-grad pass): a third of the
    training formula's attention and 2 FLOPs per parameter."""
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 2 * num_params + 4 * layers * hidden * seq_len_sq_mean


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak allocated accelerator memory (GiB) since start; None on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def host_peak_rss_gib() -> float:
    """Peak resident memory of this process (GiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20


class ProgressLog:
    """progress.jsonl on the main process plus a tqdm bar or key=value lines on the console."""

    def __init__(
        self, path: Path, *, enabled: bool, log_format: str, total_steps: int, initial_step: int = 0
    ):
        self.enabled = enabled
        self.log_format = log_format
        self.file = open(path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115
        self.bar = None
        if enabled and log_format == "progress_bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # Strict JSON has no NaN or infinity: a nonfinite value is written as its name ("nan", "inf",
        # "-inf"), so a diverging loss or gradient norm stays visible instead of turning into null.
        clean = {
            k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
        }
        self.file.write(json.dumps(clean, allow_nan=False) + "\n")
        self.file.flush()
        if self.bar is not None:
            if "step" in record and record.get("event") is None:
                self.bar.n = record["step"]
                post = {k: record[k] for k in ("loss", "lr", "tokens_per_sec") if record.get(k) is not None}
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in post.items()}, refresh=False)
                self.bar.refresh()
            else:
                self.bar.write(_kv(record))
        else:
            print(_kv(record), file=sys.stdout, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def _kv(record: dict[str, Any]) -> str:
    """key=value for the console; lists and mappings (e.g. sample generations) stay in the file."""
    parts = []
    for key, value in record.items():
        if value is None or isinstance(value, (list, dict)):
            continue
        parts.append(f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)
