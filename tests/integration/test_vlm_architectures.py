"""Qwen2-VL and Gemma 3 train through the CLI: a tiny random model of each (its config inline in a recipe
the test writes), its processor built offline as tests/unit/data/formats/test_vlm_masking.py builds it (the demo
tokenizer with the model's image tokens, the real chat template, transformers' PIL image processor), and
the demo's first rows. LoRA trains with a finite, falling loss; the saved adapter loads on its base, and
answers a question about a picture (`finetune chat --image` for Gemma 3; for Qwen2-VL the same
generation path in-process, see `qwen_folder`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from finetune.data.formats.images import SENTINEL
from finetune.generation.prompts import vlm_prompt_inputs
from finetune.model.inference import load_vlm_for_inference
from tests.integration._run import REPO, cli_here, progress, step_losses
from tests.unit.data.formats.test_vlm_masking import tiny_config
from tests.vlm_processors import PROCESSORS

pytestmark = pytest.mark.slow  # long: two VLM architectures trained (in this process: tests/inprocess.py)
DEMO_DATA = REPO / "recipes" / "demo" / "data" / "vlm"
STEPS = 6

# Qwen2-VL's AutoProcessor also loads a video processor, and transformers' video processors need
# torchvision, which has no CPU build beside this torch here (the wheels at hand are CUDA builds whose
# operators do not load): the processor folder names test_vlm_masking's image-only subclass as remote
# code (auto_map), which model.trust_remote_code lets AutoProcessor load. Training runs the real
# Qwen2-VL model and image processor; with torchvision installed the stock processor loads instead.
IMAGE_ONLY_QWEN = """
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
"""


def processor_folder(name: str, folder: Path):
    """The processor of `name` saved to `folder` (Qwen2-VL's with its image-only class as remote code)."""
    processor, _ = PROCESSORS[name]()
    processor.tokenizer.chat_template = processor.chat_template
    processor.save_pretrained(folder)
    if name == "qwen2.5-vl":
        (folder / "processing_image_only.py").write_text(IMAGE_ONLY_QWEN)
        settings = json.loads((folder / "processor_config.json").read_text())
        settings["auto_map"] = {"AutoProcessor": "processing_image_only.ImageOnlyQwen2VLProcessor"}
        (folder / "processor_config.json").write_text(json.dumps(settings, indent=2))
    return processor


def write_recipe(root: Path, name: str) -> Path:
    """A LoRA recipe for the tiny `name` model on the demo's first 48 rows (images by their paths)."""
    processor = processor_folder(name, root / "processor")
    config = tiny_config(name, processor).to_dict()
    data = root / "data"
    data.mkdir()
    shutil.copytree(DEMO_DATA / "images", data / "images")  # images stay inside the data folder
    rows = (DEMO_DATA / "train.jsonl").read_text().splitlines()[:48]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    recipe = {
        "model": {
            "kind": "vlm",
            "config_path": config,
            "tokenizer_path": str(root / "processor"),
            "torch_dtype": "fp32",
            "attn_implementation": "sdpa",
            "trust_remote_code": name == "qwen2.5-vl",
        },
        "lora": {"enable_lora": True, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0},
        "data": {
            "datasets": [{"path": str(data / "train.jsonl"), "type": "chat_template"}],
            "dataset_prepared_path": str(root / "prepared"),
            "dataset_num_proc": 1,
            "sequence_len": 128,
            "dataloader_num_workers": 0,
            "dataloader_prefetch_factor": None,
        },
        "train": {
            "output_dir": str(root / "out"),
            "seed": 0,
            "micro_batch_size": 8,
            # the frozen tower's checkpointing hook removed (finetune.model.vlm.release_frozen_towers)
            "gradient_checkpointing": True,
            "max_steps": STEPS,
            "mixed_precision": "no",
            "lr": 1.0e-2,
            "lr_warmup_ratio": 0.0,
            "log_steps": 1,
            "eval_steps": None,
            "save_epochs": 0,
        },
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture(scope="module", params=["qwen2.5-vl", "gemma3"])
def trained(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param.replace(".", "-"))
    recipe = write_recipe(root, request.param)
    result = cli_here("train", str(recipe))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return request.param, root


def test_lora_trains_with_a_falling_loss(trained):
    _, root = trained
    losses = step_losses(progress(root / "out"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[STEPS] < losses[1], losses


def test_the_adapter_loads_and_answers_about_a_picture(trained):
    name, root = trained
    out = root / "out"
    assert (out / "adapter_model.safetensors").is_file()
    picture = DEMO_DATA / "images" / "00001.png"
    if name == "gemma3":
        result = cli_here("chat", str(out), "--image", str(picture), "--prompt", "What colour is the shape?",
                     "--max-new-tokens", "4")  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip(), result.stdout
        return
    # Qwen2-VL: the adapter through finetune's loader; the processor (remote code, see IMAGE_ONLY_QWEN)
    # as training built it, and the prompt as `finetune chat` renders it.
    net, _ = _load_qwen(out)
    processor, _ = PROCESSORS[name]()
    processor.tokenizer.chat_template = processor.chat_template
    messages = [{"role": "user", "content": SENTINEL + "What colour is the shape?"}]
    inputs = vlm_prompt_inputs(processor, messages, [Image.open(picture).convert("RGB")])
    with torch.no_grad():
        ids = net.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert ids.shape[1] > inputs["input_ids"].shape[1]


def _load_qwen(out: Path):
    """load_vlm_for_inference on the adapter folder; its processor's remote code is not trusted there,
    which is the one refusal expected (the model and adapter load before it)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from finetune.errors import FinetuneError

    try:
        return load_vlm_for_inference(str(out))
    except FinetuneError as exc:
        assert "processor" in str(exc), exc
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    net = AutoModelForImageTextToText.from_pretrained(base)
    return PeftModel.from_pretrained(net, out).eval(), None


def test_the_run_used_the_architecture(trained):
    name, root = trained
    config = json.loads((root / "out" / "base_model" / "config.json").read_text())
    assert config["model_type"] == {"qwen2.5-vl": "qwen2_vl", "gemma3": "gemma3"}[name]
