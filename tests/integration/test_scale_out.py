"""Scale-out on CPU through the real CLI (`finetune train --accelerate-config ...`, subprocesses):

- DDP on 2 gloo processes (torchrun) gives the same losses, gradient norms and trained weights as one
  process with the same global batch (AdamW with clipping, and SGD without), and its checkpoints
  resume exactly with dropout on (each process's RNG state restored);
- DeepSpeed ZeRO-1, 2 and 3 (one process, DeepSpeed's CPU accelerator) train with dropout on to the
  same losses as without an engine, checkpoint, resume exactly and export a normal Hugging Face
  folder that gives the trained weights' logits (checked against DeepSpeed's own fp32
  reconstruction of the checkpoint).

The one-process runs they are compared with run in this process (tests/inprocess.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration._run import DEMO, cli_here, progress, run, short_run, step_grad_norms, step_losses

pytestmark = pytest.mark.slow

COMMON = short_run()


@pytest.fixture(scope="module")
def prepared(demo_prepared):
    """The session's prepared demo data (tests/conftest.py)."""
    return demo_prepared


def finetune_train(out: Path, prepared: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(DEMO), *COMMON, *args]  # args win
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    if "--accelerate-config" not in args:  # one plain process: in this process (tests/inprocess.py)
        result = cli_here(*cmd[3:])
    else:  # DeepSpeed picks its CPU accelerator itself; ACCELERATE_USE_CPU would turn the engine off.
        result = run(cmd, unset=("ACCELERATE_USE_CPU",) if "zero" in " ".join(args) else ())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def close(a: dict[int, float], b: dict[int, float], tol: float) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol * max(1.0, abs(a[k])) for k in a)


def trained_weights(out: Path) -> dict[str, torch.Tensor]:
    """The adapter (LoRA and the fully trained embed_tokens/lm_head) a run exported."""
    from safetensors.torch import load_file

    return load_file(out / "adapter_model.safetensors")


def weight_gaps(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Absolute differences of every trained element of two runs' weights, flattened."""
    assert a.keys() == b.keys()
    return torch.cat([(a[name] - b[name]).abs().flatten() for name in a])


# ----------------------------------------------------------------------------------------------- DDP

DDP_STEPS = ["--train.max_steps", "6", "--train.gradient_accumulation_steps", "2", "--train.save_steps", "3"]
# AdamW with clipping (the demo's) and plain SGD without clipping: clipping and Adam's per-element
# normalisation both hide a gradient that is off by a constant factor (a wrong division by the
# process count), SGD's update is the gradient itself.
OPTIMIZERS = {
    "adamw_clipped": [],
    "sgd_unclipped": ["--train.optimizer", "sgd", "--train.max_grad_norm", "null", "--train.lr", "0.1"],
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_two_process_ddp_matches_one_process(tmp_path, prepared, optimizer):
    """The same global batches give the same losses, gradient norms (every step, before clipping)
    and trained weights on 2 gloo processes as on one, up to float summation order (measured on the
    2-core CPU machine: losses and gradient norms within 1.5e-7 relative; SGD's weights within
    1.5e-8)."""
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    args = [*DDP_STEPS, *OPTIMIZERS[optimizer]]
    # 2 processes x micro batch 2 x accumulation 2 == 1 process x micro batch 4 x accumulation 2.
    finetune_train(ddp, prepared, "--accelerate-config", "multi_cpu", *args, "--train.micro_batch_size", "2")
    finetune_train(single, prepared, *args, "--train.micro_batch_size", "4")
    ddp_log, single_log = progress(ddp), progress(single)
    ddp_losses, single_losses = step_losses(ddp_log), step_losses(single_log)
    assert sorted(ddp_losses) == list(range(1, 7)) and ddp_losses[6] < ddp_losses[1]
    assert close(ddp_losses, single_losses, 1e-6), (ddp_losses, single_losses)
    # The norm is of the synchronised gradient: a wrong cross-process normalisation shows here even
    # where clipping and Adam hide it in the losses.
    ddp_norms, single_norms = step_grad_norms(ddp_log), step_grad_norms(single_log)
    assert close(ddp_norms, single_norms, 1e-6), (ddp_norms, single_norms)
    gaps = weight_gaps(trained_weights(ddp), trained_weights(single))
    if optimizer == "sgd_unclipped":
        assert gaps.max() <= 1e-6, gaps.max()
    else:
        # AdamW divides each gradient element by its running RMS (+ eps 1e-8), so an element whose
        # gradient is near zero moves by up to lr (3e-3) whatever its size: there the rounding of the
        # two summation orders is amplified. Measured: 3 of 258,048 trained elements differ by more
        # than 1e-6 (the largest 1.2e-6), 12 by more than 1e-7, the rest less.
        assert gaps.max() <= 1e-5, gaps.max()
        assert int((gaps > 1e-6).sum()) <= 30, int((gaps > 1e-6).sum())


def test_two_process_ddp_resumes_exactly_with_dropout(tmp_path, prepared):
    """Resuming a 2-process run with dropout on from its step-3 checkpoint gives the same later losses,
    gradient norms and trained weights as the run never interrupted: each process gets its own RNG
    state back (the two differ, so restoring one process's state on both would fail this: measured,
    1e-4 relative loss differences)."""
    dropout = ["--lora.lora_dropout", "0.1", "--accelerate-config", "multi_cpu", *DDP_STEPS]
    dropout += ["--train.micro_batch_size", "2"]
    ddp = tmp_path / "ddp"
    finetune_train(ddp, prepared, *dropout)
    checkpoint = ddp / "checkpoints" / "step-3"
    from safetensors.torch import load_file

    states = [load_file(str(checkpoint / f"rng_state_{rank}.safetensors")) for rank in (0, 1)]
    assert not torch.equal(states[0]["torch"], states[1]["torch"])

    resumed = tmp_path / "resumed"
    finetune_train(resumed, prepared, *dropout, "--train.load_checkpoint_path", str(checkpoint))
    later = {k: v for k, v in step_losses(progress(ddp)).items() if k > 3}
    again = step_losses(progress(resumed))
    assert sorted(again) == [4, 5, 6] and close(again, later, 1e-6), (again, later)
    norms = {k: v for k, v in step_grad_norms(progress(ddp)).items() if k > 3}
    assert close(step_grad_norms(progress(resumed)), norms, 1e-6)
    assert weight_gaps(trained_weights(resumed), trained_weights(ddp)).max() <= 1e-6


# --------------------------------------------------------------------------------------- DeepSpeed

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')",
)


def _fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trained weights from a DeepSpeed checkpoint, by DeepSpeed's own zero_to_fp32 code."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")


def _ids() -> torch.Tensor:
    return torch.randint(4, 704, (2, 48), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=_ids()).logits


def _trained_logits(out: Path, checkpoint: Path, base_dir: Path, *, lora: bool) -> torch.Tensor:
    """Logits of the weights DeepSpeed holds in the checkpoint, loaded into a model built from the base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.adapters import apply_lora
    from finetune.recipe import load_recipe

    state = _fp32_state_dict(checkpoint)
    if lora:  # the architecture the run trained (weights replaced below)
        recipe = load_recipe(str(out / "recipe.resolved.yaml"), [])
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        model = apply_lora(base, recipe.lora, gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected[:5]
    assert not [k for k in missing if "lora_" in k or not lora], missing[:5]
    return _logits(model)


ZERO_STEPS = ["--train.max_steps", "4", "--train.save_steps", "2", "--train.micro_batch_size", "2"]
ZERO_STEPS += ["--train.gradient_accumulation_steps", "2"]
FULL = ["--lora.enable_lora", "false", "--lora.modules_to_save", "[]", "--train.lr", "1e-3"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The demo model saved as a pretrained checkpoint. Runs start from these weights: a random init
    would differ under ZeRO-3, which initialises each partition on its own (deepspeed.zero.Init).
    Its attention dropout is on, so every run from it (LoRA or full) draws dropout masks and an exact
    resume needs the RNG state back."""
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(yaml.safe_load(DEMO.read_text())["model"]["config_path"], attention_dropout=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    folder = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(folder)
    return folder


def _from(pretrained: Path) -> list[str]:
    return ["--model.model_path", str(pretrained), "--model.config_path", "null"]


@pytest.fixture(scope="module")
def no_engine_losses(tmp_path_factory, prepared, pretrained):
    """Loss curves of the same runs without an engine (one process), computed once per kind."""
    cache: dict[str, dict[int, float]] = {}

    def losses(kind: str) -> dict[int, float]:
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"no-engine-{kind}")
            extra = FULL if kind == "full" else []
            finetune_train(out, prepared, *ZERO_STEPS, *_from(pretrained), *extra)
            cache[kind] = step_losses(progress(out))
        return cache[kind]

    return losses


@needs_deepspeed
@pytest.mark.parametrize(
    "config,mode",
    [("zero1", "lora"), ("zero2", "merged"), ("zero3", "full")],
)
def test_zero_trains_checkpoints_resumes_and_exports(
    tmp_path, prepared, pretrained, no_engine_losses, config, mode
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = ["--accelerate-config", config, "--num-processes", "1", *ZERO_STEPS, *_from(pretrained)]
    if mode == "full":
        args += FULL
    if mode == "merged":
        args += ["--lora.save_lora_only", "false"]
    out = tmp_path / "run"
    finetune_train(out, prepared, *args)
    losses = step_losses(progress(out))
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    # ZeRO changes where the states live, not the math: the same curve as without an engine (fp32),
    # dropout masks included (measured: equal to the last bit on one process).
    reference = no_engine_losses("full" if mode == "full" else "lora")
    assert close(losses, reference, 1e-6), (losses, reference)
    final = out / "checkpoints" / "step-4"
    assert (final / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint format

    # Resume from step 2 into a new folder: the same losses for steps 3 and 4 (the RNG state restored:
    # attention dropout is on).
    resumed = tmp_path / "resumed"
    finetune_train(
        resumed, prepared, *args, "--train.load_checkpoint_path", str(out / "checkpoints" / "step-2")
    )
    again = step_losses(progress(resumed))
    assert sorted(again) == [3, 4] and close(again, {3: losses[3], 4: losses[4]}, 1e-6), (again, losses)

    # The export is a normal Hugging Face folder with the trained weights.
    trained = _trained_logits(out, final, pretrained, lora=mode != "full")
    if mode == "lora":
        assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
        exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), out)
    else:
        assert (out / "model.safetensors").is_file() and not (out / "adapter_model.safetensors").exists()
        exported = AutoModelForCausalLM.from_pretrained(out)
    assert torch.allclose(_logits(exported), trained, atol=1e-4), (_logits(exported) - trained).abs().max()
    base = _logits(AutoModelForCausalLM.from_pretrained(pretrained)) if mode != "full" else None
    if base is not None:
        assert not torch.allclose(base, trained, atol=1e-3)  # training changed something


@needs_deepspeed
def test_qlora_with_zero2_offload(tmp_path, prepared, pretrained):
    """QLoRA under DeepSpeed with the optimizer offloaded (DeepSpeed's CPU Adam, built on first use)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (pip install -e '.[qlora]')")
    out = tmp_path / "qlora"
    args = ["--accelerate-config", "zero2_offload", "--num-processes", "1", "--train.max_steps", "3"]
    args += [*_from(pretrained), "--model.torch_dtype", "auto", "--lora.enable_qlora", "true"]
    finetune_train(out, prepared, *args, "--train.mixed_precision", "bf16")
    losses = step_losses(progress(out))
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
    assert (out / "adapter_model.safetensors").is_file()


@needs_deepspeed
def test_zero3_random_init_saves_a_whole_base_model(tmp_path, prepared):
    """A random-init model built under ZeRO-3 (partitioned by deepspeed.zero.Init) is gathered before
    base_model/ is written, so the adapter loads onto complete weights; counts use the full sizes."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = ["--accelerate-config", "zero3", "--num-processes", "1", *ZERO_STEPS]
    result = finetune_train(out, prepared, *args)
    # The same counts as without an engine (LoRA + embed/lm_head of the demo model).
    assert "parameters: 258,048 trainable / 832,128 total" in result.stdout + result.stderr
    weights = load_file(out / "base_model" / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (704, 128)
    assert all(t.numel() > 0 for t in weights.values())
    trained = _trained_logits(out, out / "checkpoints" / "step-4", out / "base_model", lora=True)
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base_model"), out)
    assert torch.allclose(_logits(exported), trained, atol=1e-4)
