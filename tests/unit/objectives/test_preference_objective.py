"""The preference objective on a tiny Llama: its loss equals finetune.losses.preference's pure functions
on TRL's padded layout (reference = the base with the adapters disabled, a frozen copy, or precomputed
log-probs), packed and unpacked rows give the same loss and gradients, the engine's accumulation over
pairs equals one big batch, and evaluation reports the same metrics prefixed eval_."""

from __future__ import annotations

import copy
import random

import datasets
import pytest
import torch

from finetune.data.batching.collate import collate_preference, collate_rows
from finetune.data.batching.pairs import pack_examples
from finetune.engine.step import train_step
from finetune.losses import preference as pref
from finetune.losses.causal_lm import forward
from finetune.objectives.preference import PreferenceObjective
from finetune.objectives.preference_scores import completion_logps
from finetune.objectives.reference import cache_path, load_or_compute, reference_key
from finetune.recipe import validate_recipe
from tests.fakes import cpu_accelerator, fake_run
from tests.tiny import loss_test_model

VOCAB, PAD, IGNORE = 64, 0, -100
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---------------------------------------------------------------------------------------- fixtures


def tiny_llama() -> torch.nn.Module:
    return loss_test_model()


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA adapters with random (non-zero) B, so that the policy differs from the base."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config)


def objective(
    name: str = "dpo",
    *,
    lora: bool = True,
    kind: str = "preference",
    lora_settings: dict | None = None,
    **settings,
) -> PreferenceObjective:
    recipe = validate_recipe(
        {
            "model": {"model_path": "org/base"},
            "data": {"datasets": [{"path": "p.jsonl", "type": kind}]},
            "train": {"output_dir": "out", "objective": name},
            "preference": settings,
            "lora": {"enable_lora": lora, **(lora_settings or {})},
        }
    )
    obj = PreferenceObjective(recipe)
    obj.accelerator = cpu_accelerator()
    return obj


def sequences(num: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """(prompt ids, completion ids, prompt length) for `num` completions of random lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
        completion = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))] + [2]
        out.append((prompt, completion))
    return out


def sequence(prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
    return prompt + completion, [IGNORE] * len(prompt) + completion


def pair_rows(num: int = 5, seed: int = 0) -> list[tuple[tuple, tuple]]:
    """Pairs of ((chosen ids, labels), (rejected ids, labels)) sharing a prompt."""
    rng = random.Random(seed)
    pairs = []
    for prompt, completion in sequences(num, seed):
        other = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))] + [2]
        pairs.append((sequence(prompt, completion), sequence(prompt, other)))
    return pairs


def pair_dataset(pairs) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "input_ids": [c[0] + r[0] for c, r in pairs],
            "labels": [c[1] + r[1] for c, r in pairs],
            "chosen_len": [len(c[0]) for c, _ in pairs],
        }
    )


def batches(ds: datasets.Dataset, kind: str, bins: list[list[int]] | None, rows_per_batch: int) -> list[dict]:
    rows = pack_examples(ds, bins, kind, pad_to_multiple_of=8 if bins else None, pad_token_id=PAD)
    rows = rows.add_column("row_index", list(range(len(rows))))
    rows = list(rows)
    return [
        collate_preference(rows[i : i + rows_per_batch], pad_token_id=PAD)
        for i in range(0, len(rows), rows_per_batch)
    ]


def padded_sums(model, seqs: list[tuple[list[int], list[int]]], *, all_tokens: bool = False):
    """TRL's layout: one sequence per row, right-padded; (sums, counts) of the completion log-probs
    (of every token with `all_tokens`, as ORPO's batch NLL)."""
    batch = collate_rows(
        [{"input_ids": ids, "labels": labels} for ids, labels in seqs], pad_token_id=PAD, packed=False
    )
    labels = (
        batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        if all_tokens
        else batch["labels"]
    )
    logits = forward(model, batch).logits
    return pref.sequence_sums(pref.token_logps(logits, labels), labels != IGNORE)


def _unloaded(model) -> torch.nn.Module:
    """The LoRA reference by other means than disable_adapter: a copy with the adapters removed."""
    return copy.deepcopy(model).unload()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -------------------------------------------------------------------------- loss = pure functions


def expected_paired(name: str, policy, reference, pairs, settings) -> torch.Tensor:
    chosen, rejected = [c for c, _ in pairs], [r for _, r in pairs]
    sums, counts = padded_sums(policy, chosen + rejected)
    (pc, pr), (nc, nr) = sums.chunk(2), counts.chunk(2)
    if name == "simpo":
        return pref.simpo_loss(pc, pr, nc, nr, beta=settings.beta, gamma=settings.simpo_gamma).losses
    if name == "orpo":
        nll = padded_sums(policy, chosen, all_tokens=settings.orpo_nll_reduction == "batch")
        return pref.orpo_loss(
            pc, pr, nc, nr, *nll, beta=settings.beta, nll_reduction=settings.orpo_nll_reduction
        ).losses
    with torch.no_grad():
        rc, rr = padded_sums(reference, chosen + rejected)[0].chunk(2)
    if name == "ipo":
        return pref.ipo_loss(pc, pr, rc, rr, nc, nr, beta=settings.beta).losses
    return pref.dpo_loss(
        pc,
        pr,
        rc,
        rr,
        beta=settings.beta,
        label_smoothing=settings.label_smoothing,
        smoothing=settings.dpo_smoothing,
    ).losses


@pytest.mark.parametrize(
    "name, options",
    [
        ("dpo", {"beta": 0.2}),
        ("dpo", {"label_smoothing": 0.1, "dpo_smoothing": "robust"}),
        ("ipo", {"beta": 0.5}),
        ("simpo", {"beta": 2.0, "simpo_gamma": 0.7}),
        ("orpo", {"orpo_nll_reduction": "sequence"}),
        ("orpo", {"orpo_nll_reduction": "batch"}),
    ],
)
def test_the_objective_loss_is_the_pure_loss_with_the_base_as_reference(name, options):
    obj = objective(name, **options)
    policy = with_lora(tiny_llama())
    reference = _unloaded(policy)
    pairs = pair_rows(5)
    (batch,) = batches(pair_dataset(pairs), "preference", [[0, 1, 2, 3, 4]], rows_per_batch=1)
    policy.zero_grad()
    loss, metrics = obj.loss(policy, batch, obj.units(batch))
    loss.backward()
    ours = grads(policy)
    policy.zero_grad()
    expected = expected_paired(name, policy, reference, pairs, obj.settings)
    expected.mean().backward()
    torch.testing.assert_close(loss, expected.mean().detach(), **TOL)
    for key, value in grads(policy).items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert obj.units(batch) == 5 and set(metrics) == {
        "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"
    }  # fmt: skip


def test_full_fine_tuning_uses_the_frozen_copy_as_reference():
    obj = objective("dpo", lora=False)
    policy = tiny_llama()
    obj.reference.copy = copy.deepcopy(policy).requires_grad_(False).eval()
    with torch.no_grad():  # the policy has moved away from the copy
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pairs = pair_rows(4, seed=3)
    (batch,) = batches(pair_dataset(pairs), "preference", [[0, 1], [2, 3]], rows_per_batch=2)
    loss, metrics = obj.loss(policy, batch, obj.units(batch))
    expected = expected_paired("dpo", policy, obj.reference.copy, pairs, obj.settings)
    torch.testing.assert_close(loss, expected.mean().detach(), **TOL)
    rewards = pref.dpo_loss(*padded_sums(policy, [c for c, _ in pairs] + [r for _, r in pairs])[0].chunk(2),
                            *padded_sums(obj.reference.copy, [c for c, _ in pairs] + [r for _, r in pairs])[0].chunk(2))  # fmt: skip
    assert (
        metrics["rewards/accuracies"].item()
        == (rewards.chosen_rewards > rewards.rejected_rewards).sum().item()
    )


def kto_dataset(examples) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "input_ids": [p + c for p, c, _ in examples],
            "labels": [[IGNORE] * len(p) + c for p, c, _ in examples],
            "desirable": [d for _, _, d in examples],
            "prompt_len": [len(p) for p, _, _ in examples],
        }
    )


def test_kto_objective_loss_equals_the_kto_loss_functions():
    """The objective's KTO loss on packed rows (the KL reference point from completions rotated within
    each packed row) equals finetune's pure KTO functions on TRL's padded layout. Those functions are
    compared with TRL's own KTOTrainer.compute_loss in
    tests/unit/losses/test_preference_losses.py::test_kto_matches_trl_kto_trainer."""
    obj = objective("kto", kind="kto", kto_undesirable_weight=1.5, beta=0.5)
    policy = with_lora(tiny_llama())
    reference = _unloaded(policy)
    examples = [(p, c, i % 3 != 1) for i, (p, c) in enumerate(sequences(6, seed=5))]
    bins = [[0, 1, 2], [3, 4, 5]]
    (batch,) = batches(kto_dataset(examples), "kto", bins, rows_per_batch=2)
    loss, metrics = obj.loss(policy, batch, obj.units(batch))

    rows = [sequence(p, c) for p, c, _ in examples]
    kl_rows = []
    for b in bins:  # TRL's rotation within each batch: here, within each packed row
        completions = pref.kto_mismatched_completions([examples[i][1] for i in b])
        kl_rows += [sequence(examples[i][0], c) for i, c in zip(b, completions, strict=True)]
    with torch.no_grad():
        z0 = pref.kto_reference_point(padded_sums(policy, kl_rows)[0], padded_sums(reference, kl_rows)[0])
        ref = padded_sums(reference, rows)[0]
    desirable = torch.tensor([d for _, _, d in examples])
    out = pref.kto_loss(padded_sums(policy, rows)[0], ref, desirable, z0, beta=0.5, undesirable_weight=1.5)
    torch.testing.assert_close(loss, out.losses.mean().detach(), **TOL)
    assert metrics["kl"].item() == pytest.approx(6 * z0.item(), rel=1e-5)
    assert metrics["count:rewards/chosen"].item() == 4 and metrics["count:rewards/rejected"].item() == 2
    assert metrics["rewards/chosen"].item() == pytest.approx(
        out.chosen_rewards.sum().item(), rel=1e-5, abs=1e-6
    )


# ----------------------------------------------------------------------- packing and accumulation


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_packed_and_unpacked_rows_give_the_same_loss_and_gradients(name):
    """Through the objective: 6 pairs in two packed rows vs one pair per row (right-padded batch)."""
    pairs = pair_rows(6, seed=7)
    ds = pair_dataset(pairs)
    results = []
    for bins, per_batch in (([[0, 1, 2], [3, 4, 5]], 2), (None, 6)):
        obj = objective(name)
        policy = with_lora(tiny_llama())
        (batch,) = batches(ds, "preference", bins, rows_per_batch=per_batch)
        loss, metrics = obj.loss(policy, batch, obj.units(batch))
        loss.backward()
        results.append((loss.detach(), grads(policy), metrics))
    (loss_a, grads_a, metrics_a), (loss_b, grads_b, metrics_b) = results
    torch.testing.assert_close(loss_a, loss_b, **TOL)
    for key in grads_a:
        torch.testing.assert_close(grads_a[key], grads_b[key], rtol=1e-4, atol=1e-6, msg=key)
    for key in metrics_a:
        torch.testing.assert_close(metrics_a[key], metrics_b[key], rtol=1e-5, atol=1e-5, msg=key)


def _run(obj, model, ga: int):
    run = fake_run(obj, model, ga=ga)
    obj.accelerator = run.accelerator
    return run


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_accumulation_over_pairs_equals_one_batch(kind):
    """GA over micro-batches of 3 and 1 pairs (kto: rows of 3 and 1 examples) = one batch of all four:
    the loss is summed over pairs and divided by the window's pairs. (kto's reference point is per
    micro-batch, as TRL's: it is the same here because both windows see the same rows.)"""
    if kind == "dpo":
        ds, bins = pair_dataset(pair_rows(4, seed=9)), [[0, 1, 2], [3]]
    else:
        examples = [(p, c, i != 1) for i, (p, c) in enumerate(sequences(4, seed=9))]
        ds, bins = kto_dataset(examples), [[0, 1, 2], [3]]
    base = with_lora(tiny_llama())
    outs, params = [], []
    for ga, per_batch in ((2, 1), (1, 2)):
        obj = objective(kind, kind="kto" if kind == "kto" else "preference")
        run = _run(obj, copy.deepcopy(base), ga)
        window = batches(ds, "kto" if kind == "kto" else "preference", bins, rows_per_batch=per_batch)
        outs.append(train_step(run, window))
        params.append({n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad})
    (ga_out, big_out) = outs
    assert ga_out["units"] == big_out["units"] == 4 and ga_out["applied"]
    if kind == "dpo":
        assert ga_out["loss"] == pytest.approx(big_out["loss"], rel=1e-5)
        for name in params[0]:
            torch.testing.assert_close(params[0][name], params[1][name], rtol=1e-5, atol=1e-6, msg=name)
        for key, value in big_out["metrics"].items():
            assert ga_out["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    else:  # the desirable examples' rewards are averaged over those examples only
        obj = objective("kto", kind="kto")
        (batch,) = batches(ds, "kto", bins, rows_per_batch=2)
        _, sums = obj.loss(copy.deepcopy(base), batch, obj.units(batch))
        assert sums["count:rewards/chosen"].item() == 3 and sums["count:rewards/rejected"].item() == 1
        for side in ("chosen", "rejected"):
            mean = (sums[f"rewards/{side}"] / sums[f"count:rewards/{side}"]).item()
            assert big_out["metrics"][f"rewards/{side}"] == pytest.approx(mean, rel=1e-5, abs=1e-7)
        assert not any(k.startswith("count:") for k in big_out["metrics"])


# ------------------------------------------------------------------------------ precomputed reference


def test_precomputed_reference_is_the_base_and_is_cached(tmp_path):
    pairs = pair_rows(6, seed=11)
    ds = pair_dataset(pairs)
    bins = [[0, 1, 2], [3, 4], [5]]
    rows = pack_examples(ds, bins, "preference", pad_to_multiple_of=8, pad_token_id=PAD)
    rows = rows.add_column("row_index", list(range(len(rows))))
    policy = with_lora(tiny_llama())
    live = objective("dpo")
    tabled = objective("dpo", precompute_ref_log_probs=True)
    calls = []

    def make_batches(subset):
        for i in range(0, len(subset), 2):
            yield collate_preference(list(subset.select(range(i, min(i + 2, len(subset))))), pad_token_id=PAD)

    def compute(batch):
        calls.append(len(batch["num_units"]))
        sums = live._reference_logps(policy, batch)
        return list(torch.split(sums, [2 * n for n in batch["num_units"].tolist()]))

    path = cache_path(tmp_path, "data", "ref")
    tables = load_or_compute(tabled.accelerator, path, {"train": rows}, compute, make_batches, kto=False)
    assert path.is_file() and sum(calls) == 3
    again = load_or_compute(tabled.accelerator, path, {"train": rows}, compute, make_batches, kto=False)
    assert sum(calls) == 3  # loaded, not computed again
    torch.testing.assert_close(again["train"].values, tables["train"].values)
    tabled.reference.tables = again
    for batch in batches(ds, "preference", bins, rows_per_batch=2):
        torch.testing.assert_close(
            tabled.loss(policy, batch, obj_units := live.units(batch))[0],
            live.loss(policy, batch, obj_units)[0],
            **TOL,
        )


def test_the_reference_key_names_what_the_log_probs_depend_on():
    recipe = validate_recipe(
        {
            "model": {"config_path": {"model_type": "llama"}, "tokenizer_path": "t"},
            "data": {"datasets": [{"path": "p", "type": "preference"}]},
            "train": {"output_dir": "o", "objective": "dpo"},
        }
    )
    key = reference_key(recipe.model, mixed_precision="bf16", seed=1)
    assert key == reference_key(recipe.model, mixed_precision="bf16", seed=1)
    assert key != reference_key(recipe.model, mixed_precision="no", seed=1)
    assert key != reference_key(
        recipe.model, mixed_precision="bf16", seed=2
    )  # random init: the seed makes it
    other = recipe.model.model_copy(update={"attn_implementation": "eager"})
    assert key != reference_key(other, mixed_precision="bf16", seed=1)


# ---------------------------------------------------------------------------------------- evaluate


def test_evaluate_reports_the_mean_metrics_over_held_out_pairs():
    obj = objective("dpo", beta=0.3)
    policy = with_lora(tiny_llama())
    reference = _unloaded(policy)
    pairs = pair_rows(7, seed=13)
    rows = pack_examples(
        pair_dataset(pairs), [[0, 1, 2], [3, 4], [5, 6]], "preference", pad_to_multiple_of=8, pad_token_id=PAD
    )
    rows = rows.add_column("row_index", list(range(len(rows))))
    loader = torch.utils.data.DataLoader(
        rows.select_columns(["input_ids", "labels", "position_ids", "seq_lens", "num_units", "row_index"]),
        batch_size=2,
        collate_fn=lambda r: collate_preference(r, pad_token_id=PAD),
    )
    obj.eval_loader = obj.accelerator.prepare(loader)
    fields = obj.evaluate(policy, step=0)
    with torch.no_grad():
        expected = expected_paired("dpo", policy, reference, pairs, obj.settings)
        sums = padded_sums(policy, [c for c, _ in pairs] + [r for _, r in pairs])[0].chunk(2)
        refs = padded_sums(reference, [c for c, _ in pairs] + [r for _, r in pairs])[0].chunk(2)
    out = pref.dpo_loss(*sums, *refs, beta=0.3)
    assert fields["eval_pairs"] == 7
    assert fields["eval_loss"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert fields["eval_rewards/accuracies"] == pytest.approx(
        (out.chosen_rewards > out.rejected_rewards).float().mean().item()
    )
    assert fields["eval_rewards/margins"] == pytest.approx(
        (out.chosen_rewards - out.rejected_rewards).mean().item(), rel=1e-4, abs=1e-6
    )
    assert fields["eval_logps/rejected"] == pytest.approx(sums[1].mean().item(), rel=1e-5)
    assert policy.training  # back in training mode


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_a_base_rewriting_init_takes_its_reference_with_the_adapters_on(init):
    """PiSSA/OLoRA move part of each base weight into the adapter: before any update the policy with
    its adapters on is the initial model, and with them disabled only the residual base. The reference
    (precomputed before the first step, as the recipe requires for these inits) is the initial model."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama()
    torch.manual_seed(3)
    policy = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=init),
    )
    obj = objective("dpo", precompute_ref_log_probs=True, lora_settings={"init_lora_weights": init})
    assert obj.reference.source == "precomputed" and not obj.reference.lora
    batch = batches(pair_dataset(pair_rows(4, seed=2)), "preference", None, rows_per_batch=4)[0]
    expected = completion_logps(base, batch, paired=True)
    torch.testing.assert_close(obj._reference_logps(policy, batch), expected, rtol=1e-4, atol=1e-4)
    residual = objective("dpo", precompute_ref_log_probs=True)  # adapters disabled: the residual base
    assert not torch.allclose(residual._reference_logps(policy, batch), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("objective_name", "settings", "refused"),
    [
        ("dpo", {}, True),
        ("kto", {}, True),
        ("dpo", {"precompute_ref_log_probs": True}, False),
        ("simpo", {}, False),  # reference-free
    ],
)
def test_a_base_rewriting_init_needs_a_reference_taken_before_training(objective_name, settings, refused):
    from pydantic import ValidationError

    recipe = {
        "model": {"model_path": "org/base"},
        "data": {
            "datasets": [{"path": "p.jsonl", "type": "kto" if objective_name == "kto" else "preference"}]
        },
        "train": {"output_dir": "out", "objective": objective_name},
        "preference": settings,
        "lora": {"enable_lora": True, "init_lora_weights": "pissa"},
    }
    if not refused:
        validate_recipe(recipe)
        return
    with pytest.raises(ValidationError, match="residual base, not the initial model") as info:
        validate_recipe(recipe)
    assert "lora.init_lora_weights" in str(info.value) and "precompute_ref_log_probs: true" in str(info.value)
