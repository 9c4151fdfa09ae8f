"""`finetune chat` with a vision-language model: the tiny demo Idefics3 (random init, saved as a full
model and as a LoRA adapter) loads with its processor, the prompt is encoded as training encodes the
same conversation (image tokens and pixels included), images go with the message they were attached to,
and a missing or non-image file is a clear error."""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Config

from finetune.data.formats.images import SENTINEL
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import FinetuneError
from finetune.evaluation.chat import chat, open_image
from finetune.evaluation.command import run_chat
from finetune.generation.prompts import vlm_prompt_inputs
from finetune.generation.transformers_backend import TransformersBackend
from finetune.model.inference import is_vision_language, load_vlm_for_inference
from finetune.recipe import dataset_entry

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "recipes" / "demo"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(full model folder, adapter folder, a red and a blue image) of the demo's tiny Idefics3."""
    root = tmp_path_factory.mktemp("vlm-chat")
    config = yaml.safe_load((DEMO / "tiny_vlm_cpu.yaml").read_text())["model"]["config_path"]
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(Idefics3Config(**config))
    processor = AutoProcessor.from_pretrained(DEMO / "vlm_processor")
    net.save_pretrained(root / "full")
    processor.save_pretrained(root / "full")
    lora = get_peft_model(net, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(root / "adapter")
    processor.save_pretrained(root / "adapter")
    lora.peft_config["default"].base_model_name_or_path = str(root / "full")
    lora.peft_config["default"].save_pretrained(root / "adapter")
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        Image.new("RGB", (32, 32), colour).save(root / f"{name}.png")
    (root / "notes.png").write_text("not an image")
    return root


def test_the_prompt_is_encoded_as_training_encodes_the_conversation(saved):
    processor = AutoProcessor.from_pretrained(saved / "full")
    picture = open_image(str(saved / "red.png"))
    inputs = vlm_prompt_inputs(
        processor, [{"role": "user", "content": SENTINEL + "What colour is the shape?"}], [picture]
    )
    row = [{"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "What colour is the shape?"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]  # fmt: skip
    (saved / "data.jsonl").write_text("")  # where the row's relative image path starts
    entry = dataset_entry(path=str(saved / "data.jsonl"), type="chat_template")
    trained = tokenize_dataset(
        datasets.Dataset.from_list([{"messages": row}]), entry, processor.tokenizer, sequence_len=64,
        excess_length_strategy="drop", on_bad_row="raise", processor=processor,
    ).dataset[0]  # fmt: skip
    ids = inputs["input_ids"][0].tolist()
    first = trained["labels"].index(next(x for x in trained["labels"] if x != -100))
    assert ids == trained["input_ids"][:first]  # the prompt, image tokens included, then the answer
    assert ids.count(705) == 4 and inputs["pixel_values"].shape[-1] == 32


@pytest.mark.parametrize("folder", ["full", "adapter"])
def test_a_vlm_folder_chats_about_its_image(saved, folder):
    assert is_vision_language(saved / folder)
    model, processor = load_vlm_for_inference(str(saved / folder))
    assert (type(model).__name__ == "PeftModel") == (folder == "adapter")
    red, blue = (open_image(str(saved / f"{c}.png")) for c in ("red", "blue"))
    backend = TransformersBackend(model, processor.tokenizer, processor=processor)
    answers = []
    for pictures in ([red], [blue]):
        out = io.StringIO()
        assert chat(backend, prompt="Colour?", max_new_tokens=6, out=out, pictures=pictures) == 0
        answers.append(out.getvalue())
    # Greedy and deterministic: the same image gives the same answer; random weights answer
    # something else for another image (the pixels reach the model).
    again = io.StringIO()
    chat(backend, prompt="Colour?", max_new_tokens=6, out=again, pictures=[red])
    assert again.getvalue() == answers[0] and answers[0] != answers[1]


def test_images_attach_to_the_next_message_in_a_conversation(saved, monkeypatch):
    model, processor = load_vlm_for_inference(str(saved / "full"))
    seen = []
    import finetune.generation.prompts as prompts

    def fake_inputs(tokenizer, messages, *, processor, pictures):
        seen.append(([m["content"].count(SENTINEL) for m in messages], len(pictures)))
        return {}

    monkeypatch.setattr(prompts, "chat_inputs", fake_inputs)
    backend = TransformersBackend(model, processor.tokenizer, processor=processor)
    monkeypatch.setattr(backend, "stream", lambda inputs, params: iter(["ok"]))
    lines = iter(["/image " + str(saved / "red.png"), "/image " + str(saved / "nope.png"), "first", "second",
                  "/image " + str(saved / "blue.png"), "third", "/exit"])  # fmt: skip
    out = io.StringIO()
    chat(backend, read=lambda _: next(lines), out=out)
    assert "/image PATH attaches" in out.getvalue() and "nope.png" in out.getvalue()  # said, not fatal
    assert seen == [([1], 1), ([1, 0, 0], 1), ([1, 0, 0, 0, 1], 2)]


def test_bad_images_and_images_for_text_models_are_clear_errors(saved, tmp_path):
    with pytest.raises(FinetuneError, match=r"--image .*nope.png.*cannot be read"):
        open_image(str(saved / "nope.png"))
    with pytest.raises(FinetuneError, match=r"--image .*notes.png: not a readable image"):
        open_image(str(saved / "notes.png"))
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FinetuneError, match="is not a vision-language model"):
        run_chat(
            str(text), base=None, prompt="hi", system=None, max_new_tokens=2, images=[str(saved / "red.png")]
        )
