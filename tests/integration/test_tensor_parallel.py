"""Tensor parallel on CPU (docs/scale-out.md): 2 gloo processes (`finetune train --accelerate-config
multi_cpu --train.tensor_parallel_size 2`, torchrun) split each decoder layer by the model's own TP plan
(transformers' DistributedConfig tp_plan "auto", DTensor) and give the one-process run's losses and
gradient norms over 6 steps, for a tiny Llama and a tiny Qwen2, full fine-tuning and LoRA; a run resumed
from its step-3 checkpoint (the shards through torch.distributed.checkpoint) continues exactly; the final
folder is a plain Hugging Face one that loads in transformers (PEFT for the adapter) on one process and
gives the one-process run's logits. With data parallel beside it, 4 gloo processes (TP=2 x DP=2:
transformers' FSDP2 across the two TP groups) give the losses and gradient norms of one process with the
same global batch, and resume exactly.

The one-process runs they are compared with run in this process (tests/inprocess.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration._run import DEMO, cli_here, progress, run, short_run, step_grad_norms, step_losses

pytestmark = pytest.mark.slow

STEPS = ["--train.max_steps", "6", "--train.save_steps", "3", "--train.micro_batch_size", "2"]
FULL = ["--lora.enable_lora", "false"]
# The demo's tiny model as a Qwen2 (biases on q/k/v, which its TP plan splits with the weights).
QWEN2 = ["--model.config_path.model_type", "qwen2"]
# Adapters beside the plan's column-wise layers only (finetune.parallel.tensor.check_adapter_layers).
LORA = [
    "--lora.lora_target_modules",
    "[q_proj,k_proj,v_proj,gate_proj,up_proj]",
    "--lora.modules_to_save",
    "[]",
]
TOLERANCE = 1e-5


def train(out: Path, prepared: Path, *args: str, tp: int = 1) -> None:
    cmd = ["train", str(DEMO), *short_run(), *STEPS, *args]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    if tp == 1:
        result = cli_here(*cmd)
    else:
        cmd += ["--accelerate-config", "multi_cpu", "--train.tensor_parallel_size", str(tp)]
        result = run([sys.executable, "-m", "finetune.cli", *cmd])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= TOLERANCE * max(1.0, abs(a[k])) for k in a)


def assert_same_run(split: Path, whole: Path) -> None:
    split_log, whole_log = progress(split), progress(whole)
    losses = step_losses(split_log)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]
    assert close(losses, step_losses(whole_log)), (losses, step_losses(whole_log))
    norms = step_grad_norms(split_log)
    assert close(norms, step_grad_norms(whole_log)), (norms, step_grad_norms(whole_log))


IDS = torch.tensor([[5, 17, 200, 31, 8, 99, 410, 3, 64, 12]])


def logits_of(folder: Path, base: Path | None = None) -> torch.Tensor:
    """The logits of a saved folder loaded the plain way, on one process (an adapter onto `base`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base or folder, dtype=torch.float32)
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder)
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory, demo_prepared) -> dict[str, Path]:
    """Full fine-tuning of the demo's Llama on 2 TP processes and on one."""
    tmp = tmp_path_factory.mktemp("tp-full")
    train(tmp / "tp2", demo_prepared, *FULL, tp=2)
    train(tmp / "tp1", demo_prepared, *FULL)
    return {"tp2": tmp / "tp2", "tp1": tmp / "tp1", "prepared": demo_prepared, "tmp": tmp}


def test_tp2_full_fine_tuning_matches_one_process(full_runs):
    """Losses and gradient norms (every step, before clipping) within 1e-5 relative; the split weights
    start as the whole model's (the random init is built whole, saved, and loaded split)."""
    assert_same_run(full_runs["tp2"], full_runs["tp1"])
    # Both processes compute the same tokens: the run's total rate is one process's.
    rates = [r for r in progress(full_runs["tp2"]) if r.get("tokens_per_sec")]
    assert rates and all(r["tokens_per_sec_total"] == pytest.approx(r["tokens_per_sec"]) for r in rates)
    checkpoint = full_runs["tp2"] / "checkpoints" / "step-3"
    assert (checkpoint / "tp_state" / ".metadata").is_file()  # the shards, through DCP


def test_tp2_output_loads_in_plain_transformers_with_the_same_logits(full_runs):
    split, whole = logits_of(full_runs["tp2"]), logits_of(full_runs["tp1"])
    assert torch.allclose(split, whole, atol=1e-4, rtol=0), (split - whole).abs().max()
    assert not torch.allclose(split, logits_of(full_runs["tp2"] / "base_model"), atol=1e-3)  # it trained


def test_tp2_resumes_exactly_from_its_sharded_checkpoint(full_runs):
    """Steps 4-6 of a run resumed from the step-3 checkpoint equal the uninterrupted run's."""
    resumed = full_runs["tmp"] / "resumed"
    checkpoint = full_runs["tp2"] / "checkpoints" / "step-3"
    train(resumed, full_runs["prepared"], *FULL, "--train.load_checkpoint_path", str(checkpoint), tp=2)
    again, first = step_losses(progress(resumed)), step_losses(progress(full_runs["tp2"]))
    assert sorted(again) == [4, 5, 6]
    assert close(again, {k: first[k] for k in again}), (again, first)
    assert close(
        step_grad_norms(progress(resumed)), {k: step_grad_norms(progress(full_runs["tp2"]))[k] for k in again}
    )
    assert torch.allclose(logits_of(resumed), logits_of(full_runs["tp2"]), atol=1e-5, rtol=0)


def test_tp2_qwen2_full_fine_tuning_matches_one_process(tmp_path, demo_prepared):
    train(tmp_path / "tp2", demo_prepared, *FULL, *QWEN2, tp=2)
    train(tmp_path / "tp1", demo_prepared, *FULL, *QWEN2)
    assert_same_run(tmp_path / "tp2", tmp_path / "tp1")
    assert torch.allclose(logits_of(tmp_path / "tp2"), logits_of(tmp_path / "tp1"), atol=1e-4, rtol=0)


def test_tp2_lora_matches_one_process_and_saves_a_plain_adapter(full_runs, tmp_path):
    """LoRA beside the column-wise layers: PEFT shards each lora_B with its layer and keeps lora_A whole
    (broadcast from the first process). PEFT draws a TP model's initial adapter differently from a whole
    model's (measured: lora_A differs), so both runs start from one adapter (lora.init_adapter)."""
    base = full_runs["tp2"] / "base_model"
    model = ["--model.model_path", str(base), "--model.config_path", "null", *LORA]
    start = tmp_path / "start"
    train(start, full_runs["prepared"], *model, "--train.max_steps", "1")
    lora = [*model, "--lora.init_adapter", str(start)]
    train(tmp_path / "tp2", full_runs["prepared"], *lora, tp=2)
    train(tmp_path / "tp1", full_runs["prepared"], *lora)
    assert_same_run(tmp_path / "tp2", tmp_path / "tp1")
    split = logits_of(tmp_path / "tp2", base=base)
    assert torch.allclose(split, logits_of(tmp_path / "tp1", base=base), atol=1e-4, rtol=0)


def test_tp2_lora_on_row_wise_layers_is_refused_naming_the_column_wise_ones(full_runs, tmp_path):
    base = full_runs["tp2"] / "base_model"
    cmd = ["train", str(DEMO), *short_run(), "--train.max_steps", "1", "--lora.modules_to_save", "[]"]
    cmd += [
        "--model.model_path",
        str(base),
        "--model.config_path",
        "null",
        "--train.output_dir",
        str(tmp_path),
    ]
    cmd += ["--data.dataset_prepared_path", str(full_runs["prepared"]), "--accelerate-config", "multi_cpu"]
    result = run([sys.executable, "-m", "finetune.cli", *cmd, "--train.tensor_parallel_size", "2"])
    assert result.returncode != 0
    assert "beside column-wise layers" in result.stderr + result.stdout
    assert "[q_proj, k_proj, v_proj, gate_proj, up_proj]" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------- tensor parallel x data parallel

TP_DP_STEPS = ["--train.max_steps", "4", "--train.save_steps", "2"]


def train_2d(out: Path, prepared: Path, *args: str) -> subprocess.CompletedProcess:
    """TP=2 x DP=2 on 4 gloo processes: micro batch 2 per data-parallel group, 4 rows a step."""
    cmd = ["train", str(DEMO), *short_run(), *FULL, *TP_DP_STEPS, "--train.micro_batch_size", "2", *args]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    cmd += ["--accelerate-config", "multi_cpu", "--num-processes", "4", "--train.tensor_parallel_size", "2"]
    result = run([sys.executable, "-m", "finetune.cli", *cmd])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def test_tp2_dp2_on_four_processes_matches_one_process_and_resumes_exactly(tmp_path, demo_prepared):
    """The 2-D mesh (transformers' DistributedConfig tp_size 2, fsdp_size 2: FSDP2 across the two TP
    groups) gives the losses and gradient norms of one process with the same global batch (micro batch 4)
    over 4 steps, evaluates each eval row once, exports a plain folder with the same logits, and a run
    resumed from its step-2 checkpoint (the 2-D shards through DCP) continues exactly."""
    result = train_2d(tmp_path / "tp2dp2", demo_prepared)
    one = tmp_path / "one"
    cmd = ["train", str(DEMO), *short_run(), *FULL, *TP_DP_STEPS, "--train.micro_batch_size", "4"]
    cmd += ["--train.output_dir", str(one), "--data.dataset_prepared_path", str(demo_prepared)]
    assert cli_here(*cmd).returncode == 0
    split_log, whole_log = progress(tmp_path / "tp2dp2"), progress(one)
    losses = step_losses(split_log)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert close(losses, step_losses(whole_log)), (losses, step_losses(whole_log))
    assert close(step_grad_norms(split_log), step_grad_norms(whole_log))
    # Two data-parallel groups: the run's rate is two processes' (the two of a TP group compute together).
    rates = [r for r in split_log if r.get("tokens_per_sec")]
    assert rates and all(r["tokens_per_sec_total"] == pytest.approx(2 * r["tokens_per_sec"]) for r in rates)
    (split_eval,) = [r for r in split_log if r.get("event") == "eval"]
    (whole_eval,) = [r for r in whole_log if r.get("event") == "eval"]
    assert split_eval["eval_tokens"] == whole_eval["eval_tokens"]
    assert split_eval["eval_loss"] == pytest.approx(whole_eval["eval_loss"], rel=TOLERANCE)
    assert "process 3: 4 steps" in result.stdout + result.stderr
    assert torch.allclose(logits_of(tmp_path / "tp2dp2"), logits_of(one), atol=1e-4, rtol=0)

    checkpoint = tmp_path / "tp2dp2" / "checkpoints" / "step-2"
    assert (checkpoint / "tp_state" / ".metadata").is_file()
    resumed = tmp_path / "resumed"
    train_2d(resumed, demo_prepared, "--train.load_checkpoint_path", str(checkpoint))
    again = step_losses(progress(resumed))
    assert sorted(again) == [3, 4]
    assert close(again, {k: losses[k] for k in again}), (again, losses)
    norms = step_grad_norms(split_log)
    assert close(step_grad_norms(progress(resumed)), {k: norms[k] for k in again})
    assert torch.allclose(logits_of(resumed), logits_of(tmp_path / "tp2dp2"), atol=1e-5, rtol=0)
