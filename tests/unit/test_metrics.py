"""finetune.metrics: FLOPs per token, peak FLOP/s lookup, memory, the progress log."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import finetune.metrics
from finetune.metrics import (
    ProgressLog,
    device_peak_flops,
    host_peak_rss_gib,
    model_flops_per_token,
    peak_memory_gib,
)

CONFIG = SimpleNamespace(num_hidden_layers=4, hidden_size=256)


def test_flops_full_fine_tuning_is_6n_plus_attention():
    n = 1_000_000
    assert model_flops_per_token(CONFIG, num_params=n, num_trainable=n, seq_len_sq_mean=0.0) == 6 * n
    # Attention: 12 * layers * hidden * effective length (PaLM appendix B).
    assert model_flops_per_token(CONFIG, num_params=n, num_trainable=n, seq_len_sq_mean=512.0) == (
        6 * n + 12 * 4 * 256 * 512
    )


def test_flops_lora_skips_weight_gradients_of_frozen_weights():
    n, trainable = 1_000_000, 10_000
    assert model_flops_per_token(CONFIG, num_params=n, num_trainable=trainable, seq_len_sq_mean=0.0) == (
        4 * n + 2 * trainable
    )


def test_packed_sequences_count_attention_over_their_own_length():
    # Two sequences of 100 and 300 tokens packed in one row attend within themselves:
    # effective length sum(len^2)/sum(len) = 250, not the row length 400.
    lengths = [100, 300]
    effective = sum(x * x for x in lengths) / sum(lengths)
    flops = model_flops_per_token(CONFIG, num_params=0, num_trainable=0, seq_len_sq_mean=effective)
    assert flops == 12 * 4 * 256 * 250


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA H20", None),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(finetune.metrics.torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops(torch.device("cuda", 0)) == peak


def test_cpu_has_no_peak_flops_or_device_memory():
    assert device_peak_flops(torch.device("cpu")) is None
    assert peak_memory_gib(torch.device("cpu")) is None


def test_host_rss_is_in_gib():
    _ = bytearray(64 * 2**20)  # at least this much is resident at some point
    rss = host_peak_rss_gib()
    assert 64 / 1024 < rss < 1024


def test_structured_log_writes_jsonl_and_key_value_lines(tmp_path, capsys):
    path = tmp_path / "progress.jsonl"
    log = ProgressLog(path, enabled=True, log_format="structured", total_steps=3)
    log.log({"step": 1, "loss": 2.5, "lr": 1e-4, "grad_norm": None, "mfu": float("inf")})
    log.log({"step": 2, "event": "nonfinite_loss", "loss": float("nan"), "samples": [{"output": "x"}]})
    log.message("a message")
    log.close()
    lines = path.read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    # Strict JSON: nonfinite values are written by name, never as null or a bare NaN.
    assert first == {"step": 1, "loss": 2.5, "lr": 1e-4, "grad_norm": None, "mfu": "inf"}
    assert second["event"] == "nonfinite_loss" and second["loss"] == "nan"
    assert math.isnan(float(second["loss"])) and second["samples"] == [{"output": "x"}]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step=1 loss=2.5 lr=0.0001 mfu=inf"  # None left out
    assert out[1] == "step=2 event=nonfinite_loss loss=nan"  # lists stay in the file
    assert out[2] == "a message"


def test_progress_bar_log_still_writes_every_record(tmp_path, capsys):
    path = tmp_path / "progress.jsonl"
    log = ProgressLog(path, enabled=True, log_format="progress_bar", total_steps=2)
    log.log({"step": 1, "loss": 1.0})
    log.log({"step": 1, "event": "eval", "eval_loss": 0.9})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1]
    assert "event=eval eval_loss=0.9" in capsys.readouterr().out


def test_appends_on_resume_and_disabled_off_the_main_process(tmp_path, capsys):
    path = tmp_path / "progress.jsonl"
    for step in (1, 2):
        log = ProgressLog(path, enabled=True, log_format="structured", total_steps=2, initial_step=step - 1)
        log.log({"step": step})
        log.close()
    assert path.read_text().splitlines() == ['{"step": 1}', '{"step": 2}']
    other = tmp_path / "rank1.jsonl"
    log = ProgressLog(other, enabled=False, log_format="structured", total_steps=2)
    log.log({"step": 1})
    log.message("hidden")
    log.close()
    assert not other.exists()
    assert "hidden" not in capsys.readouterr().out
