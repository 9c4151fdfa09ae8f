"""Preference objectives on image-text pairs (model.kind vlm), on the demo's tiny Idefics3 and processor:

* the loss, gradients and rewards of a batch equal TRL 1.16's DPOTrainer on the same tokens and images
  (its own vision collator and compute_loss), as the text losses are tested in
  tests/unit/losses/test_preference_losses.py;
* the image-conditioned log-prob sums the objective scores equal a direct forward of each sequence alone
  with the processor's pixel_values (and change with the picture: the model reads it);
* dpo, ipo, simpo and orpo with LoRA: the objective's loss is the pure loss of those sums, the reference
  being the base with the adapters disabled.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, Idefics3Config

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.pairs import pack_examples
from finetune.data.batching.vision import collate_vlm_pairs
from finetune.losses import preference as pref
from finetune.objectives.preference import PreferenceObjective
from finetune.objectives.preference_scores import policy_logps
from finetune.recipe import validate_recipe
from tests.fakes import cpu_accelerator
from tests.preference_checks import (
    assert_grads_close,
    assert_metrics_match,
    loss_and_grads,
    objective_loss_and_grads,
    trl_metrics,
)
from tests.vlm_processors import tokenize_rows

REPO = Path(__file__).resolve().parents[3]
PROCESSOR_DIR = REPO / "recipes" / "demo" / "vlm_processor"
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 40)}
PAIRS = [("red", "blue"), ("blue", "green"), ("green", "red")]  # (chosen = the picture's colour, rejected)


def tiny_vlm() -> torch.nn.Module:
    """The demo recipe's random-init Idefics3, nudged away from its init (the policy of the tests)."""
    config = yaml.safe_load((REPO / "recipes/demo/tiny_vlm_dpo_cpu.yaml").read_text())["model"]["config_path"]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        Idefics3Config(**{k: v for k, v in config.items() if k != "model_type"})
    )
    return model.eval()


def nudged(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(PROCESSOR_DIR)


def objective(name: str, *, lora: bool, **settings) -> PreferenceObjective:
    recipe = validate_recipe(
        {
            "model": {"kind": "vlm", "model_path": "org/base"},
            "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}]},
            "train": {"output_dir": "out", "objective": name},
            "preference": settings,
            "lora": {"enable_lora": lora},
        }
    )
    obj = PreferenceObjective(recipe)
    obj.accelerator = cpu_accelerator()
    return obj


def prepared(pairs: list[tuple[list[int], list[int], list[int], list[int], bytes]]) -> list[dict]:
    """Prepared preference rows (one pair a row, as prepare writes them for images) from (chosen ids,
    chosen labels, rejected ids, rejected labels, image bytes)."""
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [c + r for c, _, r, _, _ in pairs],
            "labels": [cl + rl for _, cl, _, rl, _ in pairs],
            "chosen_len": [len(c) for c, _, _, _, _ in pairs],
        }
    )
    rows = list(pack_examples(ds, None, "preference", pad_to_multiple_of=None, pad_token_id=3))
    return [
        {**row, "images": [image], "row_index": k}
        for k, (row, (*_, image)) in enumerate(zip(rows, pairs, strict=True))
    ]


# ------------------------------------------------------------------------------------- against TRL


def trl_dataset() -> datasets.Dataset:
    def turn(role, parts):
        return [{"role": role, "content": parts}]

    question = [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]
    return datasets.Dataset.from_list(
        [
            {
                "prompt": turn("user", question),
                "chosen": turn("assistant", [{"type": "text", "text": chosen}]),
                "rejected": turn("assistant", [{"type": "text", "text": rejected}]),
                "images": [Image.open(io.BytesIO(png(COLOURS[chosen])))],
            }
            for chosen, rejected in PAIRS
        ]
    )


def rows_from_trl(batch: dict) -> list[tuple]:
    """TRL's collated tokens as our pairs: its rows are [chosen..., rejected...], left-flushed; its
    completion_mask marks what is scored."""
    n = len(PAIRS)
    out = []
    for k in range(n):
        sequences = []
        for row in (k, n + k):
            real = batch["attention_mask"][row].bool()
            ids = batch["input_ids"][row][real].tolist()
            scored = batch["completion_mask"][row][real].bool().tolist()
            sequences += [ids, [t if s else IGNORE_INDEX for t, s in zip(ids, scored, strict=True)]]
        out.append((*sequences, png(COLOURS[PAIRS[k][0]])))
    return out


@pytest.mark.parametrize("loss_type, options", [("sigmoid", {"beta": 0.1}), ("ipo", {"beta": 0.3})])
def test_dpo_on_images_matches_trl_dpo_trainer(tmp_path, processor, loss_type, options):
    trl = pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")
    reference = tiny_vlm()
    policy = nudged(copy.deepcopy(reference))
    args = trl.DPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, seed=0, loss_type=[loss_type], **options
    )
    trainer = trl.DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=trl_dataset(), processing_class=processor
    )
    theirs = trainer.data_collator(list(trainer.train_dataset))
    trl_loss, trl_grads = loss_and_grads(policy, lambda: trainer.compute_loss(policy, theirs))
    logged = trl_metrics(trainer, policy)

    obj = objective("dpo" if loss_type == "sigmoid" else "ipo", lora=False, **options)
    obj.reference.copy = reference  # full fine-tuning: the frozen copy of the initial model
    batch = collate_vlm_pairs(prepared(rows_from_trl(theirs)), pad_token_id=3, processor=processor)
    # The same pixels as TRL's processor gives the PIL images (PNG bytes are lossless), in our row order.
    n = len(PAIRS)
    torch.testing.assert_close(batch["pixel_values"][0::2], theirs["pixel_values"][:n])
    torch.testing.assert_close(batch["pixel_values"][1::2], theirs["pixel_values"][n:])
    loss, grads, metrics = objective_loss_and_grads(obj, policy, batch)
    torch.testing.assert_close(loss, trl_loss, **LOSS_TOL)
    assert_grads_close(grads, trl_grads, **GRAD_TOL)
    assert_metrics_match({k: v.item() / n for k, v in metrics.items()}, logged)


# ------------------------------------------------------------------ log-probs = a direct forward


@pytest.fixture(scope="module")
def pairs_from_files(tmp_path_factory, processor):
    """Our own preparation (tokenize_dataset with the processor) of pairs whose images are files."""
    root = tmp_path_factory.mktemp("pairs")
    (root / "pairs.jsonl").write_text("")  # where relative image paths start
    for colour, rgb in COLOURS.items():
        (root / f"{colour}.png").write_bytes(png(rgb))
    question = {"type": "text", "text": "What colour is the shape?"}
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image", "image": f"{chosen}.png"}, question]}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }
        for chosen, rejected in PAIRS
    ]
    result = tokenize_rows(
        datasets.Dataset.from_list(rows), data_type="preference", path=root / "pairs.jsonl", proc=processor,
        sequence_len=256,
    )  # fmt: skip
    out = []
    for row in result.dataset:
        n = row["chosen_len"]
        ids, labels = row["input_ids"], row["labels"]
        out.append((ids[:n], labels[:n], ids[n:], labels[n:], row["images"][0]))
    return out


def direct_logps(model, processor, ids: list[int], labels: list[int], image: bytes) -> torch.Tensor:
    """One sequence alone: the model's forward with the processor's pixel_values for its image."""
    pixels = processor.image_processor(
        images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt"
    )
    logits = model(
        input_ids=torch.tensor([ids]),
        pixel_values=pixels["pixel_values"],
        pixel_attention_mask=pixels["pixel_attention_mask"],
    ).logits[0, :-1]
    token_logps = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return token_logps[torch.tensor(labels[1:]) != IGNORE_INDEX].sum()


def test_image_conditioned_log_probs_equal_a_direct_forward(processor, pairs_from_files):
    model = nudged(tiny_vlm())
    batch = collate_vlm_pairs(
        prepared(pairs_from_files), pad_token_id=3, pad_to_multiple_of=8, processor=processor
    )
    with torch.no_grad():
        sums, counts, _ = policy_logps(model, batch, name="dpo", settings=None)
        expected = torch.stack(
            [
                direct_logps(model, processor, ids, labels, image)
                for chosen_ids, chosen_labels, rejected_ids, rejected_labels, image in pairs_from_files
                for ids, labels in ((chosen_ids, chosen_labels), (rejected_ids, rejected_labels))
            ]
        )
        torch.testing.assert_close(sums, expected, **LOSS_TOL)
        assert counts.tolist() == [
            sum(x != IGNORE_INDEX for x in labels[1:])
            for c_ids, c_labels, r_ids, r_labels, _ in pairs_from_files
            for labels in (c_labels, r_labels)
        ]
        # Another picture, the same tokens: other log-probs (the pixels reach the language model).
        swapped = [(*row[:4], pairs_from_files[(k + 1) % 3][4]) for k, row in enumerate(pairs_from_files)]
        other = collate_vlm_pairs(
            prepared(swapped), pad_token_id=3, pad_to_multiple_of=8, processor=processor
        )
        moved = policy_logps(model, other, name="dpo", settings=None)[0]
    assert (moved - sums).abs().min() > 1e-4


# ------------------------------------------------------------- every paired loss, LoRA reference


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=r".*text_model.*\.(q_proj|v_proj|up_proj)", init_lora_weights=False
    )
    return get_peft_model(model, config)


@pytest.mark.parametrize(
    "name, options",
    [
        ("dpo", {"beta": 0.2}),
        ("ipo", {"beta": 0.5}),
        ("simpo", {"beta": 2.0, "simpo_gamma": 0.7}),
        ("orpo", {"orpo_nll_reduction": "sequence"}),
        ("orpo", {"orpo_nll_reduction": "batch"}),
    ],
)
def test_the_objective_loss_is_the_pure_loss_of_the_image_conditioned_sums(
    processor, pairs_from_files, name, options
):
    obj = objective(name, lora=True, **options)
    policy = with_lora(tiny_vlm())
    base = copy.deepcopy(policy).unload()  # the reference by other means than disable_adapter
    batch = collate_vlm_pairs(
        prepared(pairs_from_files), pad_token_id=3, pad_to_multiple_of=8, processor=processor
    )
    loss, metrics = obj.loss(policy, batch, obj.units(batch))

    def sums(model, *, all_tokens=False):
        rows = []
        for c_ids, c_labels, r_ids, r_labels, image in pairs_from_files:
            for ids, labels in ((c_ids, c_labels), (r_ids, r_labels)):
                labels = [t if all_tokens else x for t, x in zip(ids, labels, strict=True)]
                rows.append(
                    (
                        direct_logps(model, processor, ids, labels, image),
                        sum(x != IGNORE_INDEX for x in labels[1:]),
                    )
                )
        return torch.stack([s for s, _ in rows]), torch.tensor([c for _, c in rows])

    s, c = sums(policy)
    (pc, pr), (nc, nr) = (s[0::2], s[1::2]), (c[0::2], c[1::2])
    settings = obj.settings
    if name == "simpo":
        expected = pref.simpo_loss(pc, pr, nc, nr, beta=settings.beta, gamma=settings.simpo_gamma)
    elif name == "orpo":
        nll = sums(policy, all_tokens=settings.orpo_nll_reduction == "batch")
        expected = pref.orpo_loss(
            pc,
            pr,
            nc,
            nr,
            nll[0][0::2],
            nll[1][0::2],
            beta=settings.beta,
            nll_reduction=settings.orpo_nll_reduction,
        )
    else:
        with torch.no_grad():
            ref = sums(base)[0]
        if name == "ipo":
            expected = pref.ipo_loss(pc, pr, ref[0::2], ref[1::2], nc, nr, beta=settings.beta)
        else:
            expected = pref.dpo_loss(pc, pr, ref[0::2], ref[1::2], beta=settings.beta)
    torch.testing.assert_close(loss, expected.losses.mean().detach(), **LOSS_TOL)
    torch.testing.assert_close(
        metrics["rewards/margins"],
        (expected.chosen_rewards - expected.rejected_rewards).sum().detach(),
        **LOSS_TOL,
    )
    assert obj.units(batch) == len(PAIRS)


def test_precomputed_reference_log_probs_see_the_images(tmp_path, processor, pairs_from_files):
    """preference.precompute_ref_log_probs: the table computed from the collated image batches (adapters
    disabled) gives the losses of the live reference."""
    from finetune.objectives.reference import cache_path, load_or_compute

    rows = datasets.Dataset.from_list(prepared(pairs_from_files))
    policy = with_lora(tiny_vlm())
    live = objective("dpo", lora=True)
    tabled = objective("dpo", lora=True, precompute_ref_log_probs=True)

    def collate(subset):
        return collate_vlm_pairs(list(subset), pad_token_id=3, pad_to_multiple_of=8, processor=processor)

    def make_batches(subset):
        return (collate(subset.select(range(i, min(i + 2, len(subset))))) for i in range(0, len(subset), 2))

    def compute(batch):
        sums = live._reference_logps(policy, batch)
        return list(torch.split(sums, [2 * n for n in batch["num_units"].tolist()]))

    path = cache_path(tmp_path, "data", "ref")
    tabled.reference.tables = load_or_compute(
        tabled.accelerator, path, {"train": rows}, compute, make_batches, kto=False
    )
    for batch in make_batches(rows):
        with torch.no_grad():
            torch.testing.assert_close(
                tabled.loss(policy, batch, live.units(batch))[0],
                live.loss(policy, batch, live.units(batch))[0],
                **LOSS_TOL,
            )


def test_vision_language_recipes_take_the_preference_objectives_and_online_rl_and_refuse_the_reward_model():
    from pydantic import ValidationError

    from finetune.recipe import Recipe
    from finetune.recipe.errors import format_validation_error

    def recipe(name: str, kind: str = "preference") -> dict:
        return {
            "model": {"kind": "vlm", "model_path": "HuggingFaceTB/SmolVLM-Instruct"},
            "data": {"datasets": [{"path": "p.jsonl", "type": kind}]},
            "train": {"output_dir": "out", "objective": name},
            "lora": {"enable_lora": True},
        }

    for name in ("dpo", "ipo", "simpo", "orpo"):
        assert validate_recipe(recipe(name)).data.sample_packing is False
    # kto too, unpacked: its KL rows are built over the split (finetune.data.batching.vision).
    assert validate_recipe(recipe("kto", "kto")).data.sample_packing is False
    # online RL on prompts with images (tests/unit/objectives/test_online_images.py)
    online = recipe("grpo", "prompt") | {"grpo": {"num_generations": 2, "rewards": [{"name": "length"}]}}
    online["train"] |= {"micro_batch_size": 2}
    assert validate_recipe(online).grpo.num_generations == 2
    with pytest.raises(ValidationError) as info:
        validate_recipe(recipe("reward"))
    message = format_validation_error(info.value, Recipe)
    assert (
        "train.objective" in message and "train with sft, dpo, ipo, simpo, orpo, kto or an online" in message
    )
    with pytest.raises(ValidationError) as info:
        validate_recipe(
            {
                **recipe("dpo"),
                "data": {"datasets": [{"path": "p.jsonl", "type": "preference"}], "sample_packing": True},
            }
        )
    assert "data.sample_packing" in format_validation_error(info.value, Recipe)
