"""Preference pairs with images (type preference, model.kind vlm): chosen and rejected share the prompt's
images, each sequence gets the image tokens the processor gives them, only the completion is trained, and
the collated batch gives each sequence its own row with the pair's pixels.

Checked with the processors and real chat templates of Qwen2.5-VL, SmolVLM (Idefics3) and Gemma 3 built
offline (tests/unit/data/formats/test_vlm_masking.py makes them).
"""

from __future__ import annotations

import datasets
import pytest
import torch

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.pairs import pack_examples
from finetune.data.batching.vision import collate_vlm, collate_vlm_pairs
from finetune.data.formats.encode import image_token_ids
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import DataError
from finetune.recipe import dataset_entry
from tests.vlm_processors import image_folder, png, ready, tokenize_image_feature, tokenize_rows


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("pairs"), "pairs.jsonl")


def parts_row(image: str, chosen: str = "It is red.", rejected: str = "It is blue.") -> dict:
    user = [{"type": "image", "image": image}, {"type": "text", "text": "What colour is it?"}]
    return {
        "prompt": [{"role": "user", "content": user}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def tokenize(rows, root, proc, *, on_bad_row="raise"):
    ds = datasets.Dataset.from_list(rows)
    return tokenize_rows(
        ds, data_type="preference", path=root / "pairs.jsonl", proc=proc, on_bad_row=on_bad_row
    )


def sequences(row) -> list[tuple[list[int], list[int]]]:
    n = row["chosen_len"]
    return [(row["input_ids"][:n], row["labels"][:n]), (row["input_ids"][n:], row["labels"][n:])]


def trained_text(proc, ids, labels) -> str:
    return "".join(
        proc.tokenizer.decode([t for t, x in zip(ids, labels, strict=True) if x != IGNORE_INDEX]).split()
    )


def test_both_sequences_get_the_prompt_images_and_train_only_their_completion(processor, root):
    name, proc, end_of_turn = processor
    row = tokenize([parts_row("images/red.png")], root, proc).dataset[0]
    assert len(row["images"]) == 1
    image_ids = image_token_ids(proc)
    (chosen, chosen_labels), (rejected, rejected_labels) = sequences(row)
    assert trained_text(proc, chosen, chosen_labels) == "".join(("It is red." + end_of_turn).split()), name
    assert trained_text(proc, rejected, rejected_labels) == "".join(("It is blue." + end_of_turn).split()), (
        name
    )
    for ids in (chosen, rejected):
        assert sum(t in image_ids for t in ids) >= 4  # the image expanded in each sequence
    # The shared prompt, image tokens included, is the same in both; nothing of it is trained.
    start = next(i for i, x in enumerate(chosen_labels) if x != IGNORE_INDEX)
    assert chosen[:start] == rejected[:start]
    assert all(x == IGNORE_INDEX for x in chosen_labels[:start] + rejected_labels[:start])


def test_llava_style_images_column_gives_the_same_rows_as_image_parts(processor, root):
    _, proc, _ = processor
    parts = tokenize([parts_row("images/red.png")], root, proc).dataset[0]
    llava = {
        "prompt": "<image>What colour is it?",
        "chosen": "It is red.",
        "rejected": "It is blue.",
        "images": [(root / "images" / "red.png").read_bytes()],
    }
    row = tokenize([llava], root, proc).dataset[0]
    assert (row["input_ids"], row["labels"], row["chosen_len"]) == (
        parts["input_ids"],
        parts["labels"],
        parts["chosen_len"],
    )
    assert row["images"] == parts["images"]


def test_bad_images_are_bad_rows_counted_or_raised(root):
    proc, _ = ready("smolvlm")
    completion_image = parts_row("images/red.png")
    completion_image["chosen"] = [
        {
            "role": "assistant",
            "content": [{"type": "image", "image": "images/blue.png"}, {"type": "text", "text": "x"}],
        }
    ]
    rows = [parts_row("images/missing.png"), parts_row("images/notes.png"), parts_row("images/red.png")]
    result = tokenize(rows, root, proc, on_bad_row="skip")
    assert len(result.dataset) == 1
    assert result.dropped == {"bad_row:image_missing": 1, "bad_row:image_unreadable": 1}
    # (A dataset of its own: list and string contents do not mix in one Arrow column.)
    result = tokenize([completion_image], root, proc, on_bad_row="skip")
    assert len(result.dataset) == 0 and result.dropped == {"bad_row:image_in_completion": 1}
    with pytest.raises(DataError, match=r"row 0.*images/missing.png"):
        tokenize(rows[:1], root, proc)
    llava = {"prompt": "<image><image>Two?", "chosen": "a", "rejected": "b", "images": [png((1, 2, 3))]}
    with pytest.raises(DataError, match="2 <image> placeholder"):
        tokenize([llava], root, proc)


def test_a_text_model_refuses_pairs_with_images(root):
    from transformers import AutoTokenizer

    from tests.vlm_processors import DEMO_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    entry = dataset_entry(path=str(root / "pairs.jsonl"), type="preference")
    with pytest.raises(DataError, match=r"model\.kind: vlm"):
        tokenize_dataset(
            datasets.Dataset.from_list([parts_row("images/red.png")]),
            entry,
            tokenizer,
            sequence_len=512,
            excess_length_strategy="drop",
            on_bad_row="skip",  # raised whatever on_bad_row says: the images would be lost
            chat_template="chatml",
        )


def prepared_rows(ds: datasets.Dataset) -> list[dict]:
    rows = pack_examples(ds, None, "preference", pad_to_multiple_of=None, pad_token_id=0)
    rows = datasets.concatenate_datasets([rows, ds.select_columns(["images"])], axis=1)
    return list(rows.add_column("row_index", list(range(len(rows)))))


def test_collated_pairs_are_one_row_per_sequence_with_the_pairs_pixels(processor, root):
    """Chosen and rejected rows, interleaved, each with the pair's pixels: the same tensors as collating
    the sequences one per row with their images (images processed once per pair where that is possible)."""
    name, proc, _ = processor
    rows = [parts_row("images/red.png"), parts_row("images/blue.png", "Blue it is.", "Red, no.")]
    ds = datasets.concatenate_datasets([tokenize([r], root, proc).dataset for r in rows])
    prepared = prepared_rows(ds)
    batch = collate_vlm_pairs(prepared, pad_token_id=0, pad_to_multiple_of=8, processor=proc)
    one_by_one = [
        {"input_ids": ids, "labels": labels, "images": row["images"]}
        for row in ds
        for ids, labels in sequences(row)
    ]
    expected = collate_vlm(one_by_one, pad_token_id=0, pad_to_multiple_of=8, processor=proc)
    assert set(batch) == set(expected) | {"num_units", "row_index"}, name
    for key, value in expected.items():
        assert torch.equal(batch[key], value), (name, key)
    assert batch["num_units"].tolist() == [1, 1] and batch["row_index"].tolist() == [0, 1]
    assert batch["input_ids"].shape[0] == 4


def test_a_pairs_images_are_processed_once(processor, root, monkeypatch):
    """One image-processor call a batch, for every layout (Qwen2-VL's flat patches too): chosen and
    rejected reuse the pair's tensors instead of processing its images again."""
    name, proc, _ = processor
    rows = [parts_row("images/red.png"), parts_row("images/blue.png", "Blue it is.", "Red, no.")]
    prepared = prepared_rows(datasets.concatenate_datasets([tokenize([r], root, proc).dataset for r in rows]))
    calls = []
    real = proc.image_processor.__call__
    monkeypatch.setattr(
        type(proc.image_processor), "__call__", lambda self, *a, **k: calls.append(1) or real(*a, **k)
    )
    collate_vlm_pairs(prepared, pad_token_id=0, pad_to_multiple_of=8, processor=proc)
    assert len(calls) == 1, name


def test_a_datasets_image_column_reads_as_the_same_images(root):
    """An `images` column of datasets' Image feature (as a Parquet or Hub dataset holds it)."""
    proc, _ = ready("smolvlm")
    data = (root / "images" / "red.png").read_bytes()
    row = {"prompt": "<image>What colour is it?", "chosen": "It is red.", "rejected": "It is blue."}
    plain = tokenize([{**row, "images": [data]}], root, proc).dataset[0]
    rows = {**{k: [v] for k, v in row.items()}, "images": [[{"bytes": data, "path": None}]]}
    result = tokenize_image_feature(
        {k: datasets.Value("string") for k in row},
        rows,
        data_type="preference",
        path=root / "pairs.jsonl",
        proc=proc,
    )
    got = result.dataset[0]
    assert (got["input_ids"], got["labels"], got["chosen_len"]) == (
        plain["input_ids"],
        plain["labels"],
        plain["chosen_len"],
    )
    assert len(got["images"]) == 1
