"""Kto examples with images (type kto, model.kind vlm): the prompt's images get the processor's image tokens,
only the completion is trained, bad images are bad rows, and each example's KL row is its own prompt (its
own images) with the previous example's completion, collated beside it with the same pixels.

Checked with the processors and real chat templates of Qwen2.5-VL, SmolVLM (Idefics3) and Gemma 3 built
offline (tests/unit/data/formats/test_vlm_masking.py makes them).
"""

from __future__ import annotations

import datasets
import pytest
import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.pairs import pack_examples
from finetune.data.batching.vision import collate_vlm, collate_vlm_kto, kl_rows, with_kl_rows
from finetune.data.formats.encode import image_token_ids
from finetune.errors import DataError
from tests.vlm_processors import PROCESSORS, png, tokenize_rows

QUESTION = "What colour is it?"


@pytest.fixture(scope="module", params=list(PROCESSORS))
def processor(request):
    made, _ = PROCESSORS[request.param]()
    made.tokenizer.chat_template = made.chat_template
    return request.param, made


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    (root / "images").mkdir()
    for name, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220)), ("green", (20, 200, 20))):
        (root / "images" / f"{name}.png").write_bytes(png(colour))
    (root / "images" / "notes.png").write_text("not an image")
    (root / "kto.jsonl").write_text("")  # where relative image paths start
    return root


def parts_row(image: str, completion: str = "It is red.", label: bool = True) -> dict:
    user = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
    return {
        "prompt": [{"role": "user", "content": user}],
        "completion": [{"role": "assistant", "content": completion}],
        "label": label,
    }


def tokenize(rows, root, proc, *, on_bad_row="raise", ds=None):
    ds = ds if ds is not None else datasets.Dataset.from_list(rows)
    return tokenize_rows(ds, data_type="kto", path=root / "kto.jsonl", proc=proc, on_bad_row=on_bad_row)


def test_the_prompt_images_get_their_tokens_and_only_the_completion_trains(processor, root):
    name, proc = processor
    row = tokenize([parts_row("images/red.png", label=False)], root, proc).dataset[0]
    assert len(row["images"]) == 1 and row["desirable"] is False
    ids, labels, prompt_len = row["input_ids"], row["labels"], row["prompt_len"]
    image_ids = image_token_ids(proc)
    assert any(t in image_ids for t in ids[:prompt_len]), name
    assert all(x == IGNORE_INDEX for x in labels[:prompt_len]) and labels[prompt_len] != IGNORE_INDEX
    assert all(x == IGNORE_INDEX for t, x in zip(ids, labels, strict=True) if t in image_ids)
    trained = proc.tokenizer.decode([t for t, x in zip(ids, labels, strict=True) if x != IGNORE_INDEX])
    assert "".join(trained.split()).startswith("Itisred."), (name, trained)  # then the end of turn
    # LLaVA style (an images column of bytes, an <image> placeholder): the same row.
    llava = {"prompt": f"<image>{QUESTION}", "completion": "It is red.", "label": False}
    data = (root / "images" / "red.png").read_bytes()
    same = tokenize([{**llava, "images": [data]}], root, proc).dataset[0]
    assert (same["input_ids"], same["labels"], same["prompt_len"]) == (ids, labels, prompt_len)
    assert same["images"] == row["images"]


def prepared(ds: datasets.Dataset) -> datasets.Dataset:
    rows = pack_examples(ds, None, "kto", pad_to_multiple_of=None, pad_token_id=0)
    rows = datasets.concatenate_datasets([rows, ds.select_columns(["images"])], axis=1)
    return with_kl_rows(rows.add_column("row_index", list(range(len(rows)))), max_len=512)


def test_kl_rows_pair_each_prompt_and_its_images_with_the_previous_completion(processor, root):
    """The collated KL rows are what collating each KL sequence with its own example's images gives; the
    examples' rows are what collating the examples does (Qwen2-VL's image-token types included)."""
    name, proc = processor
    examples = [
        parts_row("images/red.png"),
        parts_row("images/blue.png", "Blue, I think.", False),
        parts_row("images/green.png", "Green!", True),
    ]
    ds = tokenize(examples, root, proc).dataset
    rows = prepared(ds)
    for k in range(3):
        prev = ds[k - 1]
        own = ds[k]
        borrowed = prev["input_ids"][prev["prompt_len"] :]
        assert rows[k]["kl_input_ids"] == [*own["input_ids"][: own["prompt_len"]], *borrowed], (name, k)
        assert (
            rows[k]["kl_labels"] == [IGNORE_INDEX] * own["prompt_len"] + prev["labels"][prev["prompt_len"] :]
        )
    batch = collate_vlm_kto(list(rows), pad_token_id=0, pad_to_multiple_of=8, processor=proc)
    plain = collate_vlm(
        [{"input_ids": r["input_ids"], "labels": r["labels"], "images": r["images"]} for r in ds],
        pad_token_id=0,
        pad_to_multiple_of=8,
        processor=proc,
    )
    kl = collate_vlm(
        [{"input_ids": r["kl_input_ids"], "labels": r["kl_labels"], "images": r["images"]} for r in rows],
        pad_token_id=0,
        pad_to_multiple_of=8,
        processor=proc,
    )
    expected = plain | {f"kl_{k}": v for k, v in kl.items()}
    assert set(batch) == set(expected) | {"num_units", "row_index", "desirable"}, name
    for key, value in expected.items():
        assert torch.equal(batch[key], value), (name, key)
    assert batch["desirable"].tolist() == [True, False, True] and batch["num_units"].tolist() == [1, 1, 1]


def test_a_kl_row_is_cut_from_the_end_of_its_borrowed_completion():
    ids, labels = kl_rows(
        [[1, 5, 6, 7], [1, 8, 9, 10, 11]], [[-100, -100, 6, 7], [-100, -100, 9, 10, 11]], [2, 2], max_len=4
    )
    assert ids == [[1, 5, 9, 10], [1, 8, 6, 7]] and labels == [[-100, -100, 9, 10], [-100, -100, 6, 7]]
    alone = kl_rows([[1, 5, 6]], [[-100, -100, 6]], [2])  # a split of one: its own completion back
    assert alone == ([[1, 5, 6]], [[-100, -100, 6]])


def test_bad_images_are_bad_rows_counted_or_raised(root):
    proc, _ = PROCESSORS["smolvlm"]()
    proc.tokenizer.chat_template = proc.chat_template
    rows = [parts_row("images/missing.png"), parts_row("images/notes.png"), parts_row("images/red.png")]
    result = tokenize(rows, root, proc, on_bad_row="skip")
    assert len(result.dataset) == 1
    assert result.dropped == {"bad_row:image_missing": 1, "bad_row:image_unreadable": 1}
    with pytest.raises(DataError, match=r"row 0.*images/missing.png"):
        tokenize(rows[:1], root, proc)
    completion_image = parts_row("images/red.png")
    completion_image["completion"] = [
        {
            "role": "assistant",
            "content": [{"type": "image", "image": "images/blue.png"}, {"type": "text", "text": "x"}],
        }
    ]
    result = tokenize([completion_image], root, proc, on_bad_row="skip")
    assert len(result.dataset) == 0 and result.dropped == {"bad_row:image_in_completion": 1}
    with pytest.raises(DataError, match=r"row 0.*kto example's completion.*put the images in the prompt"):
        tokenize([completion_image], root, proc)


def test_a_datasets_image_column_reads_as_the_same_images(root):
    """An `images` column of datasets' Image feature (as a Parquet or Hub dataset holds it)."""
    proc, _ = PROCESSORS["smolvlm"]()
    proc.tokenizer.chat_template = proc.chat_template
    data = (root / "images" / "red.png").read_bytes()
    row = {"prompt": f"<image>{QUESTION}", "completion": "It is red."}
    plain = tokenize([{**row, "label": True, "images": [data]}], root, proc).dataset[0]
    features = datasets.Features(
        {
            **{k: datasets.Value("string") for k in row},
            "label": datasets.Value("bool"),
            "images": datasets.List(datasets.Image()),
        }
    )
    ds = datasets.Dataset.from_dict(
        {**{k: [v] for k, v in row.items()}, "label": [True], "images": [[{"bytes": data, "path": None}]]},
        features=features,
    )
    imaged = tokenize(None, root, proc, ds=ds).dataset[0]
    assert (imaged["input_ids"], imaged["labels"], imaged["images"]) == (
        plain["input_ids"],
        plain["labels"],
        plain["images"],
    )
