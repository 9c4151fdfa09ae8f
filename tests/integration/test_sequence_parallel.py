"""Sequence parallel (Ulysses) on CPU (docs/scale-out.md): 2 gloo processes split each row's tokens through
DeepSpeed's UlyssesSPAttentionHF and UlyssesSPDataLoaderAdapter (ALST), registered by
finetune.parallel.sequence, and give one process's losses:

- a packed 4,096-token row of two sequences whose boundary falls inside a shard, for a tiny Llama and a
  tiny Qwen2 (one launch): the loss normalised over
  the whole row and the gradients equal the whole row's on one process, and differ from the row with
  the boundary ignored (so attention across it would be seen); the planner's per-rank activation term
  is what autograd saves on a rank;
- `finetune train --train.sequence_parallel_size 2` on the demo's packed rows: the losses and gradient
  norms of the one-process run over 4 steps, an exact resume from its step-2 checkpoint, and a final
  folder that loads in plain transformers with the one-process run's logits.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.plan.activations import activation_bytes
from finetune.plan.inventory import inventory_of
from finetune.plan.parallel import Split, shard_len, tensor_view, with_segments
from tests.integration._run import (
    DEMO,
    REPO,
    cli_here,
    progress,
    run,
    short_run,
    step_grad_norms,
    step_losses,
)
from tests.integration._sp_rows import BOUNDARY, LENGTH, MODEL, MODEL_TYPES, packed_row, row_model
from tests.tiny import tiny_model

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5


def torchrun(script: Path, *args: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), *args]
    result = run(cmd, quiet=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def whole_row(row: dict, model_type: str = "llama") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (sum over trained tokens / their count) and gradients of one row on one process."""
    model = row_model(model_type)
    count = (row["labels"][:, 1:] != -100).sum()
    loss = model(**row, use_cache=False, num_items_in_batch=count).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_packed_row_split_over_two_processes_matches_the_whole_row(tmp_path):
    out = tmp_path / "sp.pt"
    torchrun(REPO / "tests" / "integration" / "_sp_packed_worker.py", str(out))
    results = torch.load(out)
    row = packed_row()
    assert sorted(results) == sorted(MODEL_TYPES)  # a tiny Llama and a tiny Qwen2, in one launch
    for model_type, split in results.items():
        assert split["shard"] == LENGTH // 2 and BOUNDARY < LENGTH // 2  # the boundary is inside shard 0
        assert split["tokens"] == int((row["labels"][:, 1:] != -100).sum())  # trained tokens of the row
        loss, grads = whole_row(row, model_type)
        assert abs(split["loss"] - loss) <= TOLERANCE * loss, (model_type, split["loss"], loss)
        assert any(name.endswith("q_proj.bias") for name in grads) == (model_type == "qwen2")
        for name, grad in grads.items():
            gap = (split["grads"][name] - grad).abs().max()
            assert gap <= TOLERANCE * max(1.0, float(grad.abs().max())), (model_type, name, gap)
    split, loss = results["llama"], whole_row(row)[0]
    # The planner's activation term for one rank (its tokens, no mask, finetune.plan.parallel) against what
    # autograd saved on process 0 (measured: 0.15% under).
    inv = inventory_of(tiny_model(**MODEL))
    split_ = Split(sequence=2)
    tokens = shard_len(LENGTH, split_)
    acts = activation_bytes(
        tensor_view(inv, split_),
        micro_batch_size=1,
        seq_len=tokens,
        attn_implementation="flash_attention_2",
        residual_bytes=4,
        compute_bytes=4,
        autocast=False,
    )
    acts = with_segments(acts, inv, split_, attn="sdpa", rows=1, tokens=tokens, compute_bytes=4)
    assert abs(acts.saved - split["saved"]) <= 0.01 * split["saved"], (acts.saved, split["saved"])
    # The same tokens with the boundary ignored (one sequence): attention across it changes the loss by
    # far more than the tolerance, so a shard that attended across it would fail above.
    crossing = {**row, "position_ids": torch.arange(LENGTH)[None]}
    assert abs(whole_row(crossing)[0] - loss) > 100 * TOLERANCE * loss


# --------------------------------------------------------------------------------------- the CLI

RUN = [
    "--train.max_steps",
    "4",
    "--train.save_steps",
    "2",
    "--train.micro_batch_size",
    "1",
    "--lora.enable_lora",
    "false",
]


def train(out: Path, prepared: Path, *args: str, sp: int = 1) -> None:
    cmd = ["train", str(DEMO), *short_run(), *RUN, *args]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    if sp == 1:
        result = cli_here(*cmd)
    else:
        cmd += ["--accelerate-config", "multi_cpu", "--train.sequence_parallel_size", str(sp)]
        result = run([sys.executable, "-m", "finetune.cli", *cmd])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= TOLERANCE * max(1.0, abs(a[k])) for k in a)


def logits_of(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 17, 200, 31, 8, 99, 410, 3]])).logits


def test_sp2_training_matches_one_process_resumes_and_exports(tmp_path, demo_prepared):
    """An SP=2 step is one packed row of the group (process 0's, then process 1's: DeepSpeed's adapter),
    the one-process run's step is the same row (the sampler's order over 2 processes interleaves the
    rows as one process reads them)."""
    train(tmp_path / "sp2", demo_prepared, sp=2)
    train(tmp_path / "sp1", demo_prepared)
    split, whole = progress(tmp_path / "sp2"), progress(tmp_path / "sp1")
    losses = step_losses(split)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert close(losses, step_losses(whole)), (losses, step_losses(whole))
    assert close(step_grad_norms(split), step_grad_norms(whole))
    assert torch.allclose(logits_of(tmp_path / "sp2"), logits_of(tmp_path / "sp1"), atol=1e-4, rtol=0)
    resumed = tmp_path / "resumed"
    checkpoint = tmp_path / "sp2" / "checkpoints" / "step-2"
    train(resumed, demo_prepared, "--train.load_checkpoint_path", str(checkpoint), sp=2)
    again = step_losses(progress(resumed))
    assert sorted(again) == [3, 4] and close(again, {k: losses[k] for k in again}), (again, losses)
    assert torch.allclose(logits_of(resumed), logits_of(tmp_path / "sp2"), atol=1e-5, rtol=0)


def test_sp2_lora_matches_one_process(tmp_path, demo_prepared):
    """The demo's LoRA (every Linear, embeddings and head fully trained) under SP=2: PEFT's model takes
    DeepSpeed's Ulysses attention like the base model."""
    lora = ["--lora.enable_lora", "true", "--train.max_steps", "3", "--train.save_steps", "0"]
    train(tmp_path / "sp2", demo_prepared, *lora, sp=2)
    train(tmp_path / "sp1", demo_prepared, *lora)
    split, whole = progress(tmp_path / "sp2"), progress(tmp_path / "sp1")
    assert sorted(step_losses(split)) == [1, 2, 3]
    assert close(step_losses(split), step_losses(whole)), (step_losses(split), step_losses(whole))
    assert close(step_grad_norms(split), step_grad_norms(whole))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs bitsandbytes")
def test_sp2_qlora_matches_one_process(tmp_path, demo_prepared):
    """QLoRA (nf4, bitsandbytes' CPU kernels) under SP=2: the 4-bit base quantized alike on every process,
    DeepSpeed's Ulysses attention around the 4-bit layers; the losses and gradient norms of one process."""
    base = tmp_path / "base"
    config = dict(yaml.safe_load(DEMO.read_text())["model"]["config_path"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config)
    ).save_pretrained(base)
    qlora = ["--model.model_path", str(base), "--model.config_path", "null", "--lora.enable_lora", "true"]
    qlora += ["--lora.enable_qlora", "true", "--lora.quant_type", "nf4", "--lora.modules_to_save", "[]"]
    qlora += ["--train.max_steps", "3", "--train.save_steps", "0"]
    train(tmp_path / "sp2", demo_prepared, *qlora, sp=2)
    assert "- qlora" in (tmp_path / "sp2" / "README.md").read_text()  # the card of a 4-bit base's adapter
    train(tmp_path / "sp1", demo_prepared, *qlora)
    split, whole = progress(tmp_path / "sp2"), progress(tmp_path / "sp1")
    assert sorted(step_losses(split)) == [1, 2, 3]
    assert close(step_losses(split), step_losses(whole)), (step_losses(split), step_losses(whole))
    assert close(step_grad_norms(split), step_grad_norms(whole))
