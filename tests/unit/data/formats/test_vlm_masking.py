"""Vision-language chat masking: with images, the tokens with labels are still exactly the assistant turns
plus their end-of-turn tokens, every image is expanded into the tokens its processor gives it, and no
image token is trained.

Checked against the real chat templates of Qwen2.5-VL, SmolVLM (Idefics3) and Gemma 3
(tests/unit/data/templates, sources in its README) with their processors built offline: the demo BPE
tokenizer plus each model's image tokens, and transformers' PIL image processors with small sizes.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import datasets
import pytest
from PIL import Image
from transformers import AutoTokenizer

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.vision import collate_vlm
from finetune.data.formats.encode import image_token_ids
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import DataError
from finetune.model.vlm import parts
from finetune.recipe import dataset_entry
from tests.vlm_processors import (
    DEMO_TOKENIZER,
    PROCESSORS,
    REPO,
    image_folder,
    png,
    ready,
    smolvlm,
    tokenize_image_feature,
)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = image_folder(tmp_path_factory.mktemp("vlm"), "data.jsonl")
    (root / "images" / "cut.png").write_bytes(png((0, 200, 0), size=(64, 64))[:60])  # truncated
    return root


def image(path):
    return {"type": "image", "image": path}


def text(value):
    return {"type": "text", "text": value}


CONVERSATIONS = [
    [
        {"role": "user", "content": [image("images/red.png"), text("What colour is it?")]},
        {"role": "assistant", "content": [text("It is red.")]},
    ],
    [  # two turns, an image in each user turn, text around an image
        {"role": "user", "content": [text("Look:"), image("images/blue.png"), text("Colour?")]},
        {"role": "assistant", "content": [text("Blue.")]},
        {"role": "user", "content": [image("images/red.png"), text("And this one?")]},
        {"role": "assistant", "content": [text("Red, like a tomato.")]},
    ],
]
ANSWERS = [["It is red."], ["Blue.", "Red, like a tomato."]]


def tokenize(
    rows, root, proc, *, on_bad_row="raise", strategy="drop", sequence_len=512, outside=False, **entry_fields
):
    data_file = root / "data.jsonl"
    entry = dataset_entry(path=str(data_file), type="chat_template", **entry_fields)
    return tokenize_dataset(
        datasets.Dataset.from_list(rows),
        entry,
        proc.tokenizer,
        sequence_len=sequence_len,
        excess_length_strategy=strategy,
        on_bad_row=on_bad_row,
        processor=proc,
        allow_image_paths_outside=outside,
    )


def trained_runs(tokenizer, ids, labels) -> list[str]:
    """Each run of consecutive trained tokens, decoded, compared exactly (a newline trained after an
    end-of-turn fails the test). One allowance: a leading space, which SmolVLM's template puts between
    "Assistant:" and the answer and its tokenizer merges into the answer's first token (" It")."""
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run).removeprefix(" ") for run in runs]


def test_trained_tokens_are_the_assistant_turns_and_images_are_expanded(processor, image_dir):
    name, proc, end_of_turn = processor
    # One conversation per dataset: the message structs of the two would unify into one Arrow type.
    for conv, answers in zip(CONVERSATIONS, ANSWERS, strict=True):
        result = tokenize([{"messages": conv}], image_dir, proc)
        row = result.dataset[0]
        ids, labels = row["input_ids"], row["labels"]
        assert trained_runs(proc.tokenizer, ids, labels) == [a + end_of_turn for a in answers], name
        assert len(row["images"]) == sum(p["type"] == "image" for m in conv for p in m["content"])
        # The ids are the processor's own for the rendered text and the images: every image expanded.
        rendered = proc.tokenizer.apply_chat_template(conv, tokenize=False)
        pil = [Image.open(io.BytesIO(b)) for b in row["images"]]
        expected = proc(text=[rendered], images=[pil], add_special_tokens=False)["input_ids"][0]
        assert ids[-len(expected) :] == list(expected)
        image_ids = image_token_ids(proc)
        assert sum(t in image_ids for t in ids) >= 4 * len(
            row["images"]
        )  # expanded: 4+ tokens per image here
        assert not any(label != IGNORE_INDEX and t in image_ids for t, label in zip(ids, labels, strict=True))


def test_llava_style_placeholders_and_bytes(processor, image_dir):
    _, proc, end_of_turn = processor
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<image>\nWhat colour is it?"},
                {"role": "assistant", "content": "Blue."},
            ],
            "images": [png((20, 20, 220))],
        }
    ]
    row = tokenize(rows, image_dir, proc).dataset[0]
    assert trained_runs(proc.tokenizer, row["input_ids"], row["labels"]) == ["Blue." + end_of_turn]
    assert row["images"] == [png((20, 20, 220))]


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("images/missing.png", "image_missing"),
        ("images/cut.png", "image_unreadable"),
        ("images/notes.png", "image_unreadable"),
    ],
)
def test_bad_images_are_errors_or_counted_drops(image_dir, path, reason):
    proc, _ = ready("smolvlm")
    rows = [
        {
            "messages": [
                {"role": "user", "content": [image(path), text("Colour?")]},
                {"role": "assistant", "content": [text("Red.")]},
            ]
        },
        {"messages": CONVERSATIONS[0]},
    ]
    with pytest.raises(
        Exception, match=f"row 0: field 'messages\\[0\\].content \\(image 0\\)'.*{Path(path).name}"
    ):
        tokenize(rows, image_dir, proc)
    result = tokenize(rows, image_dir, proc, on_bad_row="skip")
    assert result.dropped == {f"bad_row:{reason}": 1} and len(result.dataset) == 1


def test_image_paths_outside_the_data_folder_are_counted_drops_never_read(image_dir, tmp_path):
    """A row's image path must resolve inside its data file's folder (symlinks followed): `../`, an
    absolute path, a symlink leading out and a system file are counted drops (image_outside_data_folder),
    refused before the file is opened; data.allow_image_paths_outside lets a trusted dataset reach out."""
    proc, _ = ready("smolvlm")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png((1, 2, 3)))
    link = image_dir / "images" / "link.png"
    if not link.exists():
        link.symlink_to(outside / "secret.png")
    climb = os.path.relpath(outside / "secret.png", image_dir)  # ../../.../elsewhere/secret.png
    paths = [climb, str(outside / "secret.png"), "images/link.png", "/etc/hostname", "../../../etc/passwd"]
    rows = [
        {
            "messages": [
                {"role": "user", "content": [image(path), text("Colour?")]},
                {"role": "assistant", "content": [text("Red.")]},
            ]
        }
        for path in paths
    ] + [{"messages": CONVERSATIONS[0]}]
    with pytest.raises(Exception, match=r"resolves to .*outside the data file's folder"):
        tokenize(rows, image_dir, proc)
    result = tokenize(rows, image_dir, proc, on_bad_row="skip")
    assert result.dropped == {"bad_row:image_outside_data_folder": len(paths)} and len(result.dataset) == 1
    trusted = tokenize(rows[:3], image_dir, proc, outside=True)
    assert len(trusted.dataset) == 3 and trusted.dataset[0]["images"] == [png((1, 2, 3))]


def test_placeholder_count_and_long_rows(image_dir):
    proc, _ = ready("smolvlm")
    mismatch = [
        {
            "messages": [
                {"role": "user", "content": "<image> and <image>?"},
                {"role": "assistant", "content": "A."},
            ],
            "images": [png((1, 2, 3))],
        }
    ]
    assert tokenize(mismatch, image_dir, proc, on_bad_row="skip").dropped == {
        "bad_row:image_count_mismatch": 1
    }
    # Too long: dropped (counted), even with truncate, which would cut the image's tokens.
    result = tokenize([{"messages": CONVERSATIONS[0]}], image_dir, proc, strategy="truncate", sequence_len=12)
    assert result.dropped == {"too_long_image_row": 1}


def test_images_for_a_text_model_are_an_error_whatever_on_bad_row(image_dir):
    proc, _ = smolvlm()
    entry = dataset_entry(path=str(image_dir / "data.jsonl"), type="chat_template")
    ds = datasets.Dataset.from_list([{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match=r"model\.kind: vlm"):
        tokenize_dataset(
            ds,
            entry,
            proc.tokenizer,
            sequence_len=512,
            excess_length_strategy="drop",
            on_bad_row="skip",
            chat_template=proc.chat_template,
        )


def test_datasets_image_feature(image_dir):
    proc, end_of_turn = ready("smolvlm")
    turn = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    conversation = [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}]
    rows = {"messages": [conversation], "images": [[Image.new("RGB", (20, 20), (200, 0, 0))]]}
    result = tokenize_image_feature(
        {"messages": datasets.List(turn)},
        rows,
        data_type="chat_template",
        path=image_dir / "data.jsonl",
        proc=proc,
    )
    row = result.dataset[0]
    assert Image.open(io.BytesIO(row["images"][0])).getpixel((5, 5)) == (200, 0, 0)
    assert trained_runs(proc.tokenizer, row["input_ids"], row["labels"]) == ["Red." + end_of_turn]


def test_fingerprint_covers_images_and_processor_settings(tmp_path):
    from finetune.data.prepare.cache import compute_fingerprint
    from finetune.data.prepare.fingerprint import fingerprint_inputs
    from finetune.recipe import validate_recipe

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(png((1, 2, 3)))
    (tmp_path / "train.jsonl").write_text('{"messages": []}\n')

    def fingerprint(**data):
        recipe = {
            "model": {
                "kind": "vlm",
                "config_path": {"model_type": "idefics3"},
                "tokenizer_path": str(REPO / "recipes/demo/vlm_processor"),
            },
            "data": {"datasets": [{"path": str(tmp_path / "train.jsonl"), "type": "chat_template"}], **data},
            "train": {"output_dir": str(tmp_path / "out")},
        }
        return compute_fingerprint(fingerprint_inputs(validate_recipe(recipe)))

    before = fingerprint()
    assert fingerprint() == before
    assert fingerprint(image_max_pixels=256) != before
    (tmp_path / "images" / "a.png").write_bytes(png((1, 2, 4)))  # same size and name, other pixels
    assert fingerprint() != before


def test_collated_batches_hold_what_each_model_reads(processor, image_dir):
    name, proc, _ = processor
    rows = [dict(r) for r in tokenize([{"messages": CONVERSATIONS[1]}], image_dir, proc).dataset]
    rows.append({"input_ids": [1, 7, 8], "labels": [-100, 7, 8], "images": []})  # a row without images
    batch = collate_vlm(rows, pad_token_id=3, processor=proc)
    assert "position_ids" not in batch and batch["pixel_values"].shape[0] >= 1
    expected = {
        "qwen2.5-vl": {"image_grid_thw", "mm_token_type_ids"},
        "smolvlm": {"pixel_attention_mask"},
        "gemma3": {"token_type_ids"},
    }[name]
    assert expected <= set(batch)
    types = batch.get("mm_token_type_ids", batch.get("token_type_ids"))
    if types is not None:  # image tokens marked, text tokens and padding not
        assert 0 < int(types[0].sum()) < int(batch["attention_mask"][0].sum()) and int(types[1].sum()) == 0


def tiny_config(name, proc):
    """A tiny random config of the processor's model: its image tokens, 4 tokens per 32px image (Gemma 3)."""
    from transformers import Gemma3Config, Qwen2VLConfig

    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
    text |= {"num_key_value_heads": 2, "vocab_size": 720, "bos_token_id": 1, "eos_token_id": 2}
    if name == "qwen2.5-vl":
        vision = {
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
        }
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        ids = {"image_token_id": proc.image_token_id, "video_token_id": proc.video_token_id}
        return Qwen2VLConfig(vision_config=vision, text_config=text, **ids)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 32, "patch_size": 8}
    text |= {"head_dim": 16, "sliding_window": 64}
    tok = proc.tokenizer
    ids = {
        "image_token_index": tok.image_token_id,
        "boi_token_index": tok.boi_token_id,
        "eoi_token_index": tok.eoi_token_id,
    }
    return Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, **ids)


@pytest.mark.parametrize("name", ["qwen2.5-vl", "gemma3"])
def test_a_tiny_model_trains_on_a_collated_batch(name, image_dir):
    """The collated batch is what the model's forward needs (Qwen2-VL: pixel patches, grid and the token
    types of its multimodal RoPE; Gemma 3: token types for attention within an image): a tiny random model
    built from a config computes a loss and gradients that reach its image side."""
    import torch
    from transformers import AutoModelForImageTextToText

    proc, _ = PROCESSORS[name]()
    proc.tokenizer.chat_template = proc.chat_template
    rows = [dict(r) for r in tokenize([{"messages": CONVERSATIONS[1]}], image_dir, proc).dataset]
    text_only = {"input_ids": [1, 7, 8], "labels": [-100, 7, 8], "images": []}
    batch = collate_vlm([*rows, text_only], pad_token_id=3, processor=proc)
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(tiny_config(name, proc)).train()
    loss = net(**batch).loss
    loss.backward()
    towers, projectors = parts(net)  # the image features reach the loss: the projector gets gradients
    image_side = [p for n, p in net.named_parameters() if n.startswith(tuple(towers + projectors))]
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0 for p in image_side)


def test_text_parts_train_like_strings_for_a_text_model(image_dir):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    entry = dataset_entry(path=str(image_dir / "data.jsonl"), type="chat_template")
    as_parts = [
        {"role": "user", "content": [text("Hi "), text("there")]},
        {"role": "assistant", "content": [text("Hello.")]},
    ]
    as_strings = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}]
    rows = [
        tokenize_dataset(
            datasets.Dataset.from_list([{"messages": conv}]), entry, tokenizer, sequence_len=512,
            excess_length_strategy="drop", on_bad_row="raise",
        ).dataset[0]
        for conv in (as_parts, as_strings)
    ]  # fmt: skip
    assert rows[0]["input_ids"] == rows[1]["input_ids"] and rows[0]["labels"] == rows[1]["labels"]
    assert "images" not in rows[0]
