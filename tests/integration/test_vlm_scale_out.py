"""Vision-language models beyond one plain process, on the tiny demo VLM (recipes/demo/tiny_vlm_cpu.yaml,
saved as a pretrained folder with its processor) and the demo's rows:

- FSDP2, 2 gloo processes against 1: the wrap units Accelerate's policy picks from
  finetune.model.vlm.block_classes (the vision tower's encoder layers and the decoder layers), LoRA on the
  language model with the tower frozen (frozen and trainable weights in every unit): the same losses and
  trained adapters. Accelerate's FSDP does not start on CPU, so tests/integration/_vlm_fsdp2_worker.py
  drives the same policy with torch's FSDP2; the CLI run under FSDP2 is test_gpu_vlm_fsdp2 (GPU only).
- DeepSpeed ZeRO-3 (one CPU process): full fine-tuning of the whole VLM (vision tower and projector
  too) trains, resumes exactly from a checkpoint, and saves gathered weights that load with
  AutoModelForImageTextToText and give the run's own final eval loss.
- QLoRA: the language model in 4-bit, the vision tower (with LoRA) and the projector (trained whole)
  unquantized; it trains and its adapter loads.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from finetune.data.batching.vision import collate_vlm
from finetune.losses.causal_lm import token_loss_sums
from finetune.model.inference import load_vlm_for_inference
from tests.integration._run import REPO, cli_here, env, progress, run, short_run, step_losses

pytestmark = pytest.mark.slow
RECIPE = REPO / "recipes" / "demo" / "tiny_vlm_cpu.yaml"
DEMO_DATA = REPO / "recipes" / "demo" / "data" / "vlm"
WORKER = REPO / "tests" / "integration" / "_vlm_fsdp2_worker.py"
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')",
)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The demo's tiny Idefics3 (random init, seeded) saved with its processor, as a pretrained folder."""
    folder = tmp_path_factory.mktemp("vlm-pretrained")
    settings = dict(yaml.safe_load(RECIPE.read_text())["model"]["config_path"])
    torch.manual_seed(0)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    AutoProcessor.from_pretrained(REPO / "recipes" / "demo" / "vlm_processor").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vlm-prepared")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """Overrides for the demo's first 64 training and 16 held-out rows (a copy of its images beside them)."""
    folder = tmp_path_factory.mktemp("vlm-data")
    shutil.copytree(DEMO_DATA / "images", folder / "images")  # images stay inside the data folder
    entries = []
    for name, count in (("train", 64), ("eval", 16)):
        rows = (DEMO_DATA / f"{name}.jsonl").read_text().splitlines()[:count]
        (folder / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
        entries.append(json.dumps([{"path": str(folder / f"{name}.jsonl"), "type": "chat_template"}]))
    return ["--data.datasets", entries[0], "--data.test_datasets", entries[1]]


def train(out: Path, prepared: Path, pretrained: Path, data: list[str], *args: str, zero: bool = False):
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(RECIPE), *data]
    cmd += ["--model.model_path", str(pretrained), "--model.config_path", "null"]
    cmd += ["--model.tokenizer_path", str(pretrained), *short_run("--train.max_steps", "4"), *args]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    # DeepSpeed picks its CPU accelerator itself; ACCELERATE_USE_CPU would turn the engine off. A ZeRO or
    # FSDP2 launch is a subprocess; one process (QLoRA) runs in this process (tests/inprocess.py).
    result = run(cmd, unset=("ACCELERATE_USE_CPU",)) if zero else cli_here(*cmd[3:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def eval_loss(model, processor, split) -> float:
    rows = [split[i] for i in range(len(split))]
    batch = collate_vlm(rows, pad_token_id=3, pad_to_multiple_of=8, processor=processor)
    with torch.no_grad():
        sums, counts = token_loss_sums(model.eval(), batch)
    return float(sums.sum() / counts.sum())


def test_qlora_quantizes_the_language_model_and_its_adapter_loads(tmp_path, pretrained, prepared, data):
    out = tmp_path / "qlora"
    vision = ["--model.train_vision_tower", "true", "--model.train_projector", "true"]
    train(
        out, prepared, pretrained, data, "--lora.enable_lora", "true", "--lora.enable_qlora", "true", *vision
    )
    losses = step_losses(progress(out))
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
    saved = load_file(out / "adapter_model.safetensors")
    # LoRA on the (unquantized) vision tower and the language model; the projector saved whole.
    assert any("vision_model" in k and "lora_A" in k for k in saved)
    assert any("text_model" in k and "lora_A" in k for k in saved)
    assert any(k.startswith("base_model.model.model.connector.") for k in saved)
    model, processor = load_vlm_for_inference(str(out))
    split = datasets.load_from_disk(next(prepared.glob("*/eval")))
    final = [r for r in progress(out) if r.get("event") == "eval"][-1]["eval_loss"]
    # The run computed its eval loss on 4-bit weights; the adapter loads on the full-precision base.
    assert eval_loss(model, processor, split) == pytest.approx(final, rel=0.05)


@needs_deepspeed
def test_zero3_full_fine_tuning_resumes_and_saves_whole_weights(tmp_path, pretrained, prepared, data):
    # Without the demo's generation set: training does not generate from a ZeRO-3-sharded model.
    args = ("--accelerate-config", "zero3", "--num-processes", "1", "--train.save_steps", "2",
            "--eval.generation_sets", "[]")  # fmt: skip
    out = tmp_path / "zero3"
    train(out, prepared, pretrained, data, *args, "--train.lr", "1e-3", zero=True)
    losses = step_losses(progress(out))
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
    resumed = tmp_path / "resumed"
    checkpoint = out / "checkpoints" / "step-2"
    train(resumed, prepared, pretrained, data, *args, "--train.lr", "1e-3", "--train.load_checkpoint_path",
          str(checkpoint), zero=True)  # fmt: skip
    again = step_losses(progress(resumed))
    assert sorted(again) == [3, 4]
    assert all(abs(again[k] - losses[k]) <= 1e-6 * abs(losses[k]) for k in again), (again, losses)
    # The saved model holds the gathered, trained weights (vision tower included): it loads as a whole
    # and gives the run's own final eval loss.
    model = AutoModelForImageTextToText.from_pretrained(out)
    base = AutoModelForImageTextToText.from_pretrained(pretrained)
    tower = "model.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(model.state_dict()[tower], base.state_dict()[tower])
    split = datasets.load_from_disk(next(prepared.glob("*/eval")))
    final = [r for r in progress(out) if r.get("event") == "eval"][-1]["eval_loss"]
    assert eval_loss(model, AutoProcessor.from_pretrained(out), split) == pytest.approx(final, rel=1e-4)


def torchrun(processes: int, pretrained: Path, split: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    cmd += [str(WORKER), str(pretrained), str(split), str(out)]  # --standalone: a free port
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return torch.load(out)


def test_fsdp2_two_processes_match_one(tmp_path, pretrained, prepared, data):
    if not any(prepared.glob("*/train")):
        result = cli_here("prepare-dataset", str(RECIPE), *data, "--model.tokenizer_path", str(pretrained),
                     "--data.dataset_prepared_path", str(prepared))  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    split = next(prepared.glob("*/train"))
    from tests.integration._vlm_fsdp2_worker import steps

    one = steps(str(pretrained), str(split))  # one process, unsharded
    two = torchrun(2, pretrained, split, tmp_path / "two.pt")
    assert two["wrapped"] == ["Idefics3EncoderLayer", "LlamaDecoderLayer"]
    # fp32 on CPU: the sharded run differs from one process by reduction order only.
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert one["losses"][1] < one["losses"][0]
    assert one["weights"].keys() == two["weights"].keys() and len(one["weights"]) > 0
    for name, weight in one["weights"].items():
        assert torch.allclose(weight, two["weights"][name], atol=1e-5), name


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Accelerate's FSDP does not start on CPU)"
)
def test_gpu_vlm_fsdp2(tmp_path, pretrained, prepared, data):
    """The CLI under accelerate_configs/fsdp2.yaml on one GPU: LoRA with the tower frozen trains, its
    sharded checkpoint resumes, and the adapter loads."""
    args = ("--accelerate-config", "fsdp2", "--num-processes", "1", "--train.save_steps", "2")
    args += ("--train.mixed_precision", "bf16", "--lora.enable_lora", "true")
    args += ("--eval.generation_sets", "[]")  # training does not generate from an FSDP-sharded model
    out = tmp_path / "fsdp2"
    train(out, prepared, pretrained, data, *args, zero=True)
    losses = step_losses(progress(out))
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
    resumed = tmp_path / "resumed"
    checkpoint = str(out / "checkpoints" / "step-2")
    train(resumed, prepared, pretrained, data, *args, "--train.load_checkpoint_path", checkpoint, zero=True)
    again = step_losses(progress(resumed))
    assert all(abs(again[k] - losses[k]) <= 1e-3 * abs(losses[k]) for k in (3, 4)), (again, losses)
    load_vlm_for_inference(str(out))
