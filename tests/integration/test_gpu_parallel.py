"""Context parallel, activation offloading and tensor-parallel throughput on CUDA GPUs (skipped without
one; docs/scale-out.md):

- activation offloading (finetune.parallel.offload) lowers the peak GPU memory of a 16k-token forward and
  backward with gradient checkpointing by about what the planner says it moves, with the same gradients;
- context parallel (ring attention through Accelerate's cp_size, FSDP2) on 2 GPUs gives the one-GPU
  run's losses to bf16 precision; on one GPU a context_parallel_size of 2 is refused before training;
- tensor parallel on 2 GPUs trains and reports its throughput beside one GPU's;
- sequence parallel (Ulysses) under ZeRO-1, ZeRO-3 and FSDP2 on 2 GPUs gives the one-GPU run's losses
  (the engines that shard on GPUs only: on CPU, Accelerate runs DeepSpeed as one process and FSDP not at
  all, so the CPU tests run sequence parallel under DDP);
- activation offloading under ZeRO-3 and FSDP2 and with LoRA trains to the losses of the same run without it.

Run on a GPU machine with `pytest -m gpu tests/integration/test_gpu_parallel.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.integration._run import DEMO, progress, run, short_run, step_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
COMMON = short_run("--train.mixed_precision", "bf16", "--train.max_steps", "4", "--lora.enable_lora", "false")
COMMON += ["--lora.modules_to_save", "[]", "--data.sample_packing", "false", "--train.micro_batch_size", "1"]


def train(out: Path, prepared: Path, config: str, processes: int, *args: str):
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(DEMO), "--accelerate-config", config]
    cmd += ["--num-processes", str(processes), *COMMON, *args]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    return run(cmd, unset=("ACCELERATE_USE_CPU",))


def peak_of(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_activation_offloading_lowers_the_peak_at_16k_tokens():
    from finetune.parallel.offload import offloaded
    from finetune.plan.activations import activation_bytes
    from finetune.plan.inventory import inventory_of
    from finetune.plan.parallel import offloaded_bytes
    from tests.tiny import tiny_model

    model = tiny_model(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=1024, max_position_embeddings=16384,
    ).cuda()  # fmt: skip
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(4, 1024, (1, 16384), device="cuda")

    def step(offload: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with offloaded(SimpleNamespace(activation_offloading=offload)):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    step(False)  # warm up kernels and the allocator
    grads = {}
    plain = peak_of(lambda: grads.setdefault("plain", step(False)))
    moved = peak_of(lambda: grads.setdefault("offloaded", step(True)))
    for name, grad in grads["plain"].items():
        assert torch.allclose(grads["offloaded"][name], grad, atol=1e-5), name
    acts = activation_bytes(
        inventory_of(model), micro_batch_size=1, seq_len=16384, attn_implementation="sdpa",
        residual_bytes=4, compute_bytes=4, autocast=False,
    )  # fmt: skip
    predicted = offloaded_bytes(acts, True)
    print(
        f"peak without offloading {plain / 2**20:.0f} MiB, with {moved / 2**20:.0f} MiB, planner moves {predicted / 2**20:.0f} MiB"
    )
    assert plain - moved >= 0.5 * predicted, (plain, moved, predicted)


def saved_base(folder: Path) -> Path:
    """The demo model's config with random weights, saved: QLoRA quantizes weights it loads from disk."""
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(yaml.safe_load(DEMO.read_text())["model"]["config_path"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config)
    ).save_pretrained(folder)
    return folder


def adapters(kind: str, tmp_path: Path) -> list[str]:
    """The flags of full fine-tuning (none), LoRA, or QLoRA (nf4 on a saved base)."""
    if kind == "full":
        return []
    flags = ["--lora.enable_lora", "true", "--lora.modules_to_save", "[]"]
    if kind == "qlora":
        base = saved_base(tmp_path / "base")
        flags += ["--model.model_path", str(base), "--model.config_path", "null"]
        flags += ["--lora.enable_qlora", "true", "--lora.quant_type", "nf4"]
    return flags


@TWO_GPUS
@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
def test_context_parallel_on_two_gpus_matches_one(tmp_path, kind):
    """CP=2 (ring attention over FSDP2) against one GPU: full fine-tuning, LoRA adapters beside the split
    attention, and QLoRA (4-bit base layers, bitsandbytes' CUDA kernels, under FSDP2's sharding)."""
    prepared, extra = tmp_path / "prepared", adapters(kind, tmp_path)
    cp = train(tmp_path / "cp", prepared, "fsdp2", 2, *extra, "--train.context_parallel_size", "2")
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-6000:]
    one = train(tmp_path / "one", prepared, "fsdp2", 1, *extra)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-6000:]
    split, whole = step_losses(progress(tmp_path / "cp")), step_losses(progress(tmp_path / "one"))
    assert sorted(split) == [1, 2, 3, 4]
    for step in split:  # bf16 activations, different attention kernels (ring vs whole)
        assert abs(split[step] - whole[step]) <= 2e-2 * abs(whole[step]), (split, whole)


def test_context_parallel_on_one_gpu_is_refused(tmp_path):
    result = train(tmp_path / "cp", tmp_path / "prepared", "fsdp2", 1, "--train.context_parallel_size", "2")
    assert result.returncode != 0
    assert "train.context_parallel_size 2 does not divide the 1 processes" in result.stderr + result.stdout


@TWO_GPUS
def test_tensor_parallel_throughput_on_two_gpus(tmp_path):
    prepared = tmp_path / "prepared"
    tp = train(tmp_path / "tp", prepared, "multi_gpu", 2, "--train.tensor_parallel_size", "2")
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-6000:]
    one = train(tmp_path / "one", prepared, "single_gpu", 1)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-6000:]
    rates = {}
    for name in ("tp", "one"):
        rows = [r for r in progress(tmp_path / name) if r.get("tokens_per_sec") and r["step"] > 1]
        rates[name] = sum(r["tokens_per_sec"] for r in rows) / len(rows)
    print(f"tokens/s per process: TP=2 {rates['tp']:.0f}, one GPU {rates['one']:.0f}")
    losses = step_losses(progress(tmp_path / "tp"))
    assert losses[4] < losses[1]


@TWO_GPUS
@pytest.mark.parametrize("config", ["zero1", "zero3", "fsdp2"])
def test_sequence_parallel_under_sharded_engines_matches_one_gpu(tmp_path, config):
    """SP=2 on 2 GPUs against one GPU under the same engine, packed rows, fp32 (the split changes only
    the order of sums)."""
    if config.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    prepared, fp32 = tmp_path / "prepared", ["--train.mixed_precision", "no", "--data.sample_packing", "true"]
    sp = train(tmp_path / "sp", prepared, config, 2, *fp32, "--train.sequence_parallel_size", "2")
    assert sp.returncode == 0, sp.stdout[-3000:] + sp.stderr[-6000:]
    one = train(tmp_path / "one", prepared, config, 1, *fp32)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-6000:]
    split, whole = step_losses(progress(tmp_path / "sp")), step_losses(progress(tmp_path / "one"))
    assert sorted(split) == [1, 2, 3, 4] and split[4] < split[1]
    for step in split:
        assert abs(split[step] - whole[step]) <= 1e-4 * abs(whole[step]), (split, whole)


@pytest.mark.parametrize(
    ("config", "kind"),
    [("zero3", "full"), ("fsdp2", "full"), ("single_gpu", "lora"), ("single_gpu", "qlora")],
    ids=["zero3", "fsdp2", "lora", "qlora"],
)
def test_activation_offloading_trains_to_the_same_losses(tmp_path, config, kind):
    """Offloading moves saved tensors and back, unchanged: the losses equal the run without it (QLoRA:
    the 4-bit layers' saved inputs move like any other)."""
    if config.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    prepared = tmp_path / "prepared"
    flags = ["--train.gradient_checkpointing", "true", *adapters(kind, tmp_path)]
    moved = train(tmp_path / "moved", prepared, config, 1, *flags, "--train.activation_offloading", "true")
    assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-6000:]
    plain = train(tmp_path / "plain", prepared, config, 1, *flags)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-6000:]
    a, b = step_losses(progress(tmp_path / "moved")), step_losses(progress(tmp_path / "plain"))
    assert sorted(a) == [1, 2, 3, 4] and a == pytest.approx(b, rel=1e-3), (a, b)


@TWO_GPUS
def test_activation_offloading_beside_sequence_parallel_trains_to_the_same_losses(tmp_path):
    """Offloading combines with a split: SP=2 on 2 GPUs with the saved tensors offloaded equals SP=2 without."""
    prepared = tmp_path / "prepared"
    flags = [
        "--train.gradient_checkpointing",
        "true",
        "--train.mixed_precision",
        "no",
        "--data.sample_packing",
        "true",
    ]
    flags += ["--train.sequence_parallel_size", "2"]
    moved = train(
        tmp_path / "moved", prepared, "multi_gpu", 2, *flags, "--train.activation_offloading", "true"
    )
    assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-6000:]
    plain = train(tmp_path / "plain", prepared, "multi_gpu", 2, *flags)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-6000:]
    a, b = step_losses(progress(tmp_path / "moved")), step_losses(progress(tmp_path / "plain"))
    assert sorted(a) == [1, 2, 3, 4] and a == pytest.approx(b, rel=1e-5), (a, b)
