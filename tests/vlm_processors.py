"""Processors of real vision-language models built offline for tests: the demo tokenizer with each model's
special tokens, its real image processor (small images) and its real chat template (tests/unit/data/templates),
and helpers that tokenize rows with images through finetune.data.formats.tokenize."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import torch
from PIL import Image
from transformers import AutoTokenizer, Gemma3Processor, Idefics3Processor, Qwen2VLProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from finetune.data.formats.tokenize import tokenize_dataset
from finetune.recipe import dataset_entry

REPO = Path(__file__).resolve().parents[1]
# The real chat templates of the models, as their Hub repositories ship them.
TEMPLATES = REPO / "tests" / "unit" / "data" / "templates"
DEMO_TOKENIZER = REPO / "recipes" / "demo" / "tokenizer"


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor: transformers' video processors need torchvision,
    which cannot be installed beside this torch. Images go through the real __call__ and image processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def _tokenizer(additional=(), **kwargs):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER, **kwargs)
    if additional:
        tokenizer.add_special_tokens({"additional_special_tokens": list(additional)})
    return tokenizer


def qwen():
    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    template = (TEMPLATES / "Qwen-Qwen2.5-VL-3B-Instruct.jinja").read_text()
    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=template), "<|im_end|>"


def smolvlm():
    tokenizer = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
    )
    template = (TEMPLATES / "HuggingFaceTB-SmolVLM-Instruct.jinja").read_text()
    return Idefics3Processor(
        image_processor, tokenizer, image_seq_len=4, chat_template=template
    ), "<end_of_utterance>"


def gemma3():
    special = {
        "image_token": "<image_soft_token>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
    }
    tokenizer = _tokenizer(extra_special_tokens=special)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    template = (TEMPLATES / "google-gemma-3-4b-it.jinja").read_text()
    return Gemma3Processor(
        image_processor, tokenizer, chat_template=template, image_seq_length=4
    ), "<end_of_turn>"


PROCESSORS = {"qwen2.5-vl": qwen, "smolvlm": smolvlm, "gemma3": gemma3}


def ready(name: str):
    """PROCESSORS[name] with its chat template on its tokenizer too (where tokenization reads it), and the
    template's end-of-turn marker."""
    made, end_of_turn = PROCESSORS[name]()
    made.tokenizer.chat_template = made.chat_template
    return made, end_of_turn


def png(colour, size=(40, 30)) -> bytes:
    """A PNG file's bytes: one colour."""
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def image_folder(root: Path, data_file: str) -> Path:
    """`root` holding images/red.png, images/blue.png, images/notes.png (not an image) and an empty
    `data_file` (where relative image paths start)."""
    (root / "images").mkdir()
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        (root / "images" / f"{name}.png").write_bytes(png(colour))
    (root / "images" / "notes.png").write_text("not an image")
    (root / data_file).write_text("")
    return root


def tokenize_rows(
    ds: datasets.Dataset, *, data_type: str, path, proc, on_bad_row: str = "raise", sequence_len: int = 512
):
    """tokenize_dataset of `ds` for an entry of type `data_type` naming the data file `path` (where relative
    image paths start), with the VLM processor `proc`, at `sequence_len` (long rows dropped)."""
    return tokenize_dataset(
        ds,
        dataset_entry(path=str(path), type=data_type),
        proc.tokenizer,
        sequence_len=sequence_len,
        excess_length_strategy="drop",
        on_bad_row=on_bad_row,
        processor=proc,
    )


def tokenize_image_feature(columns: dict[str, datasets.FeatureType], rows: dict[str, list], *, data_type: str, path,
                           proc):  # fmt: skip
    """`tokenize_rows` (on_bad_row raise) on a dataset whose `images` column has datasets' Image feature, as
    a Parquet or Hub dataset holds it: `columns` are the other columns' features, `rows` the values by
    column, `path` the data file an entry of type `data_type` names."""
    features = datasets.Features({**columns, "images": datasets.List(datasets.Image())})
    return tokenize_rows(
        datasets.Dataset.from_dict(rows, features=features), data_type=data_type, path=path, proc=proc
    )


def demo_generator():
    """recipes/demo/make_vlm_data.py loaded as a module (it is a script, not a package module)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "recipes" / "demo" / "make_vlm_data.py"
    spec = importlib.util.spec_from_file_location("make_vlm_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shuffled_images(rows: list[dict]) -> list[dict]:
    """`rows` with their `images` shuffled across the rows (a fixed permutation): the pictures no longer
    match the text, for tests that show a trained model reads the pixels."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    return [{**row, "images": rows[k]["images"]} for row, k in zip(rows, order, strict=True)]
