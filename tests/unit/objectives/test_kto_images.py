"""KTO on image-text examples (model.kind vlm), on the demo's tiny Idefics3 and processor:

* per-example losses, rewards, the reference point z0 and the gradients of a batch equal TRL 1.16's
  KTOTrainer on the same tokens and images (its vision collator, which rotates completions within the
  batch, and compute_loss), as the text KTO is tested in tests/unit/losses/test_preference_losses.py;
* the image-conditioned log-prob sums of the examples and of their KL rows equal a direct forward of
  each sequence alone with the processor's pixel_values;
* the three references (LoRA adapters disabled, a frozen copy, precomputed log-probs) give the same
  loss as the pure KTO loss of directly computed sums.
"""

from __future__ import annotations

import copy
import io

import datasets
import pytest
import torch
from PIL import Image

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.pairs import pack_examples
from finetune.data.batching.vision import collate_vlm_kto, with_kl_rows
from finetune.losses import preference as pref
from finetune.objectives.preference import PreferenceObjective
from finetune.objectives.preference_scores import completion_logps, policy_logps
from finetune.recipe import validate_recipe
from tests.fakes import cpu_accelerator
from tests.preference_checks import assert_grads_close, objective_loss_and_grads
from tests.unit.objectives.test_preference_images import (
    COLOURS,
    GRAD_TOL,
    LOSS_TOL,
    PROCESSOR_DIR,
    direct_logps,
    loss_and_grads,
    nudged,
    png,
    tiny_vlm,
    with_lora,
)
from tests.vlm_processors import tokenize_rows

# (the picture's colour, the completion, desirable): right colour desirable, a wrong one not.
EXAMPLES = [("red", "red", True), ("blue", "green", False), ("green", "green", True), ("red", "blue", False)]


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(PROCESSOR_DIR)


def objective(*, lora: bool, **settings) -> PreferenceObjective:
    recipe = validate_recipe(
        {
            "model": {"kind": "vlm", "model_path": "org/base"},
            "data": {"datasets": [{"path": "k.jsonl", "type": "kto"}]},
            "train": {"output_dir": "out", "objective": "kto"},
            "preference": settings,
            "lora": {"enable_lora": lora},
        }
    )
    obj = PreferenceObjective(recipe)
    obj.accelerator = cpu_accelerator()
    return obj


def prepared(examples: list[tuple[list[int], list[int], int, bool, bytes]]) -> datasets.Dataset:
    """Prepared kto rows (one example a row, as prepare writes them for images) with their KL rows, from
    (ids, labels, prompt_len, desirable, image bytes)."""
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [e[0] for e in examples],
            "labels": [e[1] for e in examples],
            "prompt_len": [e[2] for e in examples],
            "desirable": [e[3] for e in examples],
        }
    )
    rows = pack_examples(ds, None, "kto", pad_to_multiple_of=None, pad_token_id=3)
    rows = rows.add_column("images", [[e[4]] for e in examples]).add_column(
        "row_index", list(range(len(examples)))
    )
    return with_kl_rows(rows, max_len=256)


def collate(rows, processor, pad_to_multiple_of: int = 1) -> dict:
    return collate_vlm_kto(
        list(rows), pad_token_id=3, pad_to_multiple_of=pad_to_multiple_of, processor=processor
    )


# ------------------------------------------------------------------------------------- against TRL


def trl_dataset() -> datasets.Dataset:
    question = [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]
    return datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": question}],
                "completion": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                "label": label,
                "images": [Image.open(io.BytesIO(png(COLOURS[colour])))],
            }
            for colour, answer, label in EXAMPLES
        ]
    )


def rows_from_trl(batch: dict) -> list[tuple]:
    """TRL's collated examples as ours (left-flushed rows, its completion_mask marks what is scored)."""
    out = []
    for k, (colour, _, label) in enumerate(EXAMPLES):
        real = batch["attention_mask"][k].bool()
        ids = batch["input_ids"][k][real].tolist()
        scored = batch["completion_mask"][k][real].bool().tolist()
        labels = [t if s else IGNORE_INDEX for t, s in zip(ids, scored, strict=True)]
        out.append((ids, labels, scored.index(True), label, png(COLOURS[colour])))
    return out


def test_kto_on_images_matches_trl_kto_trainer(tmp_path, processor):
    trl = pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")
    reference = tiny_vlm()
    policy = nudged(copy.deepcopy(reference))
    beta, w_d, w_u = 0.5, 1.0, 1.4
    args = trl.KTOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        seed=0,
        beta=beta,
        desirable_weight=w_d,
        undesirable_weight=w_u,
        per_device_train_batch_size=len(EXAMPLES),
    )
    trainer = trl.KTOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=trl_dataset(), processing_class=processor
    )
    theirs = trainer.data_collator(list(trainer.train_dataset))
    trl_loss, trl_grads = loss_and_grads(policy, lambda: trainer.compute_loss(policy, theirs))
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train" if policy.training else "eval"].items()}

    obj = objective(lora=False, beta=beta, kto_desirable_weight=w_d, kto_undesirable_weight=w_u)
    obj.reference.copy = reference  # full fine-tuning: the frozen copy of the initial model
    rows = prepared(rows_from_trl(theirs))
    batch = collate(rows, processor)
    # TRL's KL sequences are ours: each prompt with the previous example's completion (one batch = the split).
    for k in range(len(EXAMPLES)):
        real = theirs["KL_attention_mask"][k].bool()
        assert rows[k]["kl_input_ids"] == theirs["KL_input_ids"][k][real].tolist()
        scored = theirs["KL_completion_mask"][k][real].bool()
        expected = theirs["KL_input_ids"][k][real].masked_fill(~scored, IGNORE_INDEX).tolist()
        assert rows[k]["kl_labels"] == expected
    torch.testing.assert_close(batch["pixel_values"], theirs["pixel_values"])
    torch.testing.assert_close(batch["kl_pixel_values"], theirs["pixel_values"])
    loss, grads, metrics = objective_loss_and_grads(obj, policy, batch)
    torch.testing.assert_close(loss, trl_loss, **LOSS_TOL)
    assert_grads_close(grads, trl_grads, **GRAD_TOL)
    assert metrics["kl"].item() / len(EXAMPLES) == pytest.approx(trl_metrics["kl"], rel=1e-4, abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        mean = metrics[key].item() / metrics[f"count:{key}"].item()
        assert mean == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------ log-probs = a direct forward


@pytest.fixture(scope="module")
def examples_from_files(tmp_path_factory, processor):
    """Our own preparation (tokenize_dataset with the processor) of kto examples whose images are files,
    in both shapes: image parts in the prompt's messages, and an images column with <image> placeholders."""
    root = tmp_path_factory.mktemp("kto")
    (root / "kto.jsonl").write_text("")  # where relative image paths start
    for colour, rgb in COLOURS.items():
        (root / f"{colour}.png").write_bytes(png(rgb))
    question = {"type": "text", "text": "What colour is the shape?"}
    shapes: dict[bool, list[dict]] = {False: [], True: []}  # LLaVA style (odd rows) or image parts
    for k, (colour, answer, label) in enumerate(EXAMPLES):
        if k % 2:
            row = {
                "prompt": [{"role": "user", "content": "<image>What colour is the shape?"}],
                "images": [f"{colour}.png"],
            }
        else:
            image = {"type": "image", "image": f"{colour}.png"}
            row = {"prompt": [{"role": "user", "content": [image, question]}]}
        shapes[bool(k % 2)].append(
            row | {"completion": [{"role": "assistant", "content": answer}], "label": label}
        )
    prepared_shapes = {
        llava: iter(
            tokenize_rows(
                datasets.Dataset.from_list(rows),
                data_type="kto",
                path=root / "kto.jsonl",
                proc=processor,
                sequence_len=256,
            ).dataset
        )
        for llava, rows in shapes.items()
    }
    result = [next(prepared_shapes[bool(k % 2)]) for k in range(len(EXAMPLES))]
    return [(r["input_ids"], r["labels"], r["prompt_len"], r["desirable"], r["images"][0]) for r in result]


def test_image_conditioned_log_probs_of_examples_and_kl_rows_equal_a_direct_forward(
    processor, examples_from_files
):
    model = nudged(tiny_vlm())
    rows = prepared(examples_from_files)
    batch = collate(rows, processor, pad_to_multiple_of=8)
    with torch.no_grad():
        sums, counts, _ = policy_logps(model, batch, name="kto", settings=None)
        kl = completion_logps(model, batch, paired=False, kl=True)
        expected = [
            direct_logps(model, processor, ids, labels, image)
            for ids, labels, *_, image in examples_from_files
        ]
        expected_kl = [
            direct_logps(model, processor, r["kl_input_ids"], r["kl_labels"], r["images"][0]) for r in rows
        ]
    torch.testing.assert_close(sums, torch.stack(expected), **LOSS_TOL)
    torch.testing.assert_close(kl, torch.stack(expected_kl), **LOSS_TOL)
    assert counts.tolist() == [sum(x != IGNORE_INDEX for x in e[1][1:]) for e in examples_from_files]
    # The KL row of example k: its own prompt (image tokens included), the completion of example k - 1.
    for k, (ids, _, prompt_len, _, _) in enumerate(examples_from_files):
        prev_ids, _, prev_prompt, _, _ = examples_from_files[k - 1]
        assert rows[k]["kl_input_ids"] == [*ids[:prompt_len], *prev_ids[prev_prompt:]]
        assert rows[k]["kl_labels"][:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert [e[3] for e in examples_from_files] == [label for *_, label in EXAMPLES]


# --------------------------------------------------------------------------- the three references


@pytest.mark.parametrize("source", ["adapter", "copy", "precomputed"])
def test_kto_loss_is_the_pure_loss_of_image_conditioned_sums(
    tmp_path, processor, examples_from_files, source
):
    """LoRA (adapters disabled), a frozen copy (full fine-tuning) and precomputed log-probs: the loss is
    kto_loss of directly computed sums, z0 from the KL rows' sums."""
    from finetune.objectives.reference import cache_path, load_or_compute

    lora = source != "copy"
    policy = with_lora(tiny_vlm()) if lora else nudged(tiny_vlm())
    base = copy.deepcopy(policy).unload() if lora else tiny_vlm()
    obj = objective(lora=lora, beta=0.3, precompute_ref_log_probs=source == "precomputed")
    if source == "copy":
        obj.reference.copy = base
    rows = prepared(examples_from_files)

    def make_batches(subset):
        return (
            collate(subset.select(range(i, min(i + 2, len(subset)))), processor)
            for i in range(0, len(subset), 2)
        )

    if source == "precomputed":
        live = objective(lora=True)

        def compute(batch):
            heads, tails = live._reference_logps(policy, batch), live._reference_logps(policy, batch, kl=True)
            return [torch.cat([h, t]) for h, t in zip(heads.split(1), tails.split(1), strict=True)]

        path = cache_path(tmp_path, "data", "ref")
        obj.reference.tables = load_or_compute(
            obj.accelerator, path, {"train": rows}, compute, make_batches, kto=True
        )

    def direct(model):
        return (
            torch.stack(
                [direct_logps(model, processor, r["input_ids"], r["labels"], r["images"][0]) for r in rows]
            ),
            torch.stack(
                [
                    direct_logps(model, processor, r["kl_input_ids"], r["kl_labels"], r["images"][0])
                    for r in rows
                ]
            ),
        )

    with torch.no_grad():
        ref, ref_kl = direct(base)
        policy_kl = direct(policy)[1]
    desirable = torch.tensor([r["desirable"][0] for r in rows])
    for start, batch in zip((0, 2), make_batches(rows), strict=True):
        part = slice(start, start + 2)
        loss, metrics = obj.loss(policy, batch, obj.units(batch))
        sums = torch.stack(
            [
                direct_logps(policy, processor, r["input_ids"], r["labels"], r["images"][0])
                for r in rows.select(range(start, start + 2))
            ]
        )
        z0 = pref.kto_reference_point(policy_kl[part], ref_kl[part])
        expected = pref.kto_loss(sums, ref[part], desirable[part], z0, beta=0.3)
        torch.testing.assert_close(loss, expected.losses.mean().detach(), **LOSS_TOL)
        torch.testing.assert_close(metrics["kl"] / 2, z0, **LOSS_TOL)
        assert z0.item() >= 0 and not z0.requires_grad
        with torch.no_grad():  # per example: losses, and the rewards of the desirable and undesirable ones
            out, batch_z0 = obj._losses(policy, batch, split="train")
        torch.testing.assert_close(out.losses, expected.losses.detach(), **LOSS_TOL)
        torch.testing.assert_close(out.chosen_rewards, expected.chosen_rewards.detach(), **LOSS_TOL)
        torch.testing.assert_close(out.rejected_rewards, expected.rejected_rewards.detach(), **LOSS_TOL)
        torch.testing.assert_close(batch_z0, z0, **LOSS_TOL)
