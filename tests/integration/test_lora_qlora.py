"""LoRA and QLoRA end to end through finetune/train.py's main, then `finetune merge-lora` on the trained
adapter, in this process (tests/inprocess.py), checked by loading the results with transformers/PEFT.
The LoRA run is the session's demo_adapter (tests/conftest.py), shared with the eval and chat tests."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from tests.integration._run import DEMO, cli_here, demo_overrides, progress, step_losses, train_here


def _split(text: str) -> list[str]:
    """Overrides written as one string (no value holds a space)."""
    return text.split()


COMMON = _split(
    "--train.log_format structured --train.log_steps 1 --train.save_epochs 0 --train.eval_steps null"
)


@pytest.fixture(scope="module")
def prepared(demo_prepared):
    """The session's prepared demo data (tests/conftest.py)."""
    return demo_prepared


def _overrides(tmp_path, prepared, *extra):
    return [*demo_overrides(tmp_path, *COMMON, *extra), "--data.dataset_prepared_path", str(prepared)]


def _ids(vocab: int = 704) -> torch.Tensor:
    return torch.randint(4, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _adapter_keys(folder) -> set[str]:
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        return set(f.keys())


def test_lora_trains_saves_and_merge_lora_cli_matches(tmp_path, demo_adapter):
    # The demo, 6 steps of LoRA on q_proj and v_proj with gradient checkpointing (DEMO_ADAPTER_RUN).
    result = demo_adapter["result"]
    assert result.returncode == 0, result.stderr[-4000:]
    out = demo_adapter["out"]
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, 7))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[6] < losses[1] - 0.5, losses

    config = json.loads((out / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_proj", "v_proj"}
    assert set(config["modules_to_save"]) == {"embed_tokens", "lm_head"}
    keys = _adapter_keys(out)
    lora_modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in keys if ".lora_" in k}
    assert lora_modules == {"q_proj", "v_proj"}
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= keys

    base_dir = out / "base_model"
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    ids = _ids()
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(base_dir), ids)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out)
    want = _logits(adapted, ids)
    assert (want - base_logits).abs().max() > 0.1  # training changed the model

    merged_dir = tmp_path / "merged"
    merge = cli_here("merge-lora", str(out), "--output", str(merged_dir))
    assert merge.returncode == 0, merge.stderr[-4000:]
    assert f"merged model written to {merged_dir}" in merge.stdout
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert merged.num_parameters() == AutoModelForCausalLM.from_pretrained(base_dir).num_parameters()
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-4, atol=1e-5)

    bad = cli_here("merge-lora", str(tmp_path), "--output", str(tmp_path / "x"))
    assert bad.returncode == 2 and "no adapter_config.json" in bad.stderr and "Traceback" not in bad.stderr


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    """The demo's tiny Llama, randomly initialised and saved with save_pretrained (a 'pretrained' model).

    intermediate_size is a multiple of 64: bitsandbytes' CPU inference path (used in eval) repacks
    4-bit weights in blocks of 64 input features and fails on other sizes (352 in the demo config).
    """
    folder = tmp_path_factory.mktemp("pretrained")
    config = dict(yaml.safe_load(DEMO.read_text())["model"]["config_path"], intermediate_size=384)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config)
    ).save_pretrained(folder)
    return folder


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="QLoRA needs bitsandbytes")
def _qlora(pretrained_dir) -> list[str]:
    """QLoRA (nf4, double quant, bf16) of the saved demo model, 6 steps, checkpoints at 3 and 6."""
    return [
        "--train.max_steps",
        "6",
        "--model.model_path",
        str(pretrained_dir),
        *_split(
            "--model.config_path null --model.torch_dtype auto --train.mixed_precision bf16 "
            "--lora.enable_qlora true --lora.quant_type nf4 --lora.double_quant true "
            "--train.save_steps 3 --train.eval_steps 3 --train.save_total_limit null"
        ),
    ]


def test_qlora_nf4_double_quant_bf16_end_to_end(tmp_path, prepared, pretrained_dir):
    result = train_here(DEMO, *_overrides(tmp_path, prepared, *_qlora(pretrained_dir)))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    records = progress(out)
    losses = step_losses(records)
    assert sorted(losses) == list(range(1, 7))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[6] < losses[1], losses
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all(math.isfinite(r["eval_loss"]) for r in evals)

    # Checkpoints hold the trained LoRA tensors only, not the frozen (4-bit) base.
    step3 = out / "checkpoints" / "step-3"
    assert not (step3 / "model.safetensors").exists()
    with safe_open(step3 / "trainable_0.safetensors", "pt") as f:
        ckpt_keys = set(f.keys())
    assert ckpt_keys and all(
        "lora_" in k or "modules_to_save" in k for k in ckpt_keys
    )  # the demo trains both

    # A QLoRA checkpoint resumes: the base is quantized again from the recipe, the adapters restored.
    resumed = train_here(
        DEMO,
        *_overrides(
            tmp_path / "resumed",
            prepared,
            *_qlora(pretrained_dir),
            "--train.load_checkpoint_path",
            str(step3),
        ),
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    again = step_losses(progress(tmp_path / "resumed" / "out"))
    assert sorted(again) == [4, 5, 6]
    for step in again:
        assert again[step] == pytest.approx(losses[step], rel=1e-4), (step, again, losses)

    # The adapter loads with PEFT on the plain (not quantized) base.
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(pretrained_dir)
    ids = _ids()
    base = AutoModelForCausalLM.from_pretrained(pretrained_dir)
    base_logits = _logits(base, ids)
    adapted = PeftModel.from_pretrained(base, out)
    logits = _logits(adapted, ids)
    assert torch.isfinite(logits).all()
    assert (logits - base_logits).abs().max() > 0.1
    card = (out / "README.md").read_text()
    assert "- qlora" in card
    assert str(pretrained_dir) not in card.split("---")[1]  # a local path is no Hub `base_model`
