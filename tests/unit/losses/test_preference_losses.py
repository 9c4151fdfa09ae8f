"""Preference losses (finetune.losses.preference).

* Against TRL 1.16: the same tiny Llama, the same tokens (TRL's own tokenization and collator), the
  loss through TRL's trainer code path and through ours (forward -> token_logps -> sequence_sums ->
  loss); values, logged metrics and parameter gradients must agree.
* Against the papers: each loss on a few numbers worked out by hand with the math module.
* Packed rows (position_ids restarting at 0) against padded rows: same per-sequence log-probs, same
  losses and gradients.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from finetune.data.batching.collate import collate_rows
from finetune.errors import FinetuneError
from finetune.losses import preference as pref
from finetune.losses.causal_lm import forward
from tests.preference_checks import assert_grads_close, assert_metrics_match, loss_and_grads, trl_metrics
from tests.tiny import loss_test_model

VOCAB = 64
# fp32 end to end: TRL's fused LM head computes log-probs in fp32 whatever the model dtype.
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


# ------------------------------------------------------------------------------ fixtures


def tiny_llama(attn: str = "sdpa") -> torch.nn.Module:
    return loss_test_model(attn)


def policy_and_reference(attn: str = "sdpa") -> tuple[torch.nn.Module, torch.nn.Module]:
    """A policy and a reference that differs from it, so that log-ratios are not zero."""
    policy = tiny_llama(attn)
    reference = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return policy, reference.requires_grad_(False)


def word_tokenizer():
    """A word-level tokenizer built in memory: "w7" is one token, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(VOCAB - 3)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB - 3)}" for _ in range(rng.randint(low, high)))


def preference_dataset(num_pairs: int = 5):
    from datasets import Dataset

    rng = random.Random(0)
    rows = [
        {"prompt": _words(rng, 2, 7), "chosen": " " + _words(rng, 1, 6), "rejected": " " + _words(rng, 1, 6)}
        for _ in range(num_pairs)
    ]
    return Dataset.from_list(rows)


def unpaired_dataset(num_examples: int = 6):
    from datasets import Dataset

    rng = random.Random(1)
    rows = [
        {"prompt": _words(rng, 2, 7), "completion": " " + _words(rng, 1, 6), "label": i % 3 != 1}
        for i in range(num_examples)
    ]
    return Dataset.from_list(rows)


def trl_args(config_class, tmp_path, **options):
    return config_class(output_dir=str(tmp_path), report_to=[], use_cpu=True, seed=0, **options)


def completion_row(prompt_ids: list[int], completion_ids: list[int]) -> dict:
    return {"input_ids": prompt_ids + completion_ids, "labels": [-100] * len(prompt_ids) + completion_ids}


def padded_logps(model, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our path on a right-padded batch: (completion log-prob sums, completion token counts)."""
    batch = collate_rows(rows, pad_token_id=0, packed=False)
    logits = forward(model, batch).logits
    return pref.sequence_sums(pref.token_logps(logits, batch["labels"]), batch["labels"] != -100)


def reference_logps(model, rows: list[dict]) -> torch.Tensor:
    with torch.no_grad():
        return padded_logps(model, rows)[0]


# ------------------------------------------------------------------------------ token_logps


def test_token_logps_equals_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :3] = -100
    labels[2, 5] = -100
    expected = torch.zeros(3, 7, dtype=torch.float64)
    full = logits.log_softmax(-1)
    for b in range(3):
        for t in range(1, 7):
            if labels[b, t] != -100:
                expected[b, t] = full[b, t - 1, labels[b, t]]
    torch.testing.assert_close(pref.token_logps(logits, labels), expected, rtol=0, atol=1e-12)


def test_token_logps_gradient_is_exact_and_chunked(monkeypatch):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 13, (2, 9), generator=g)
    labels[1, 4:] = -100
    logits = torch.randn(2, 9, 13, generator=g, dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(
        pref, "_CHUNK_ELEMENTS", 13 * 4
    )  # 4 rows per chunk: several chunks, a ragged last one
    assert torch.autograd.gradcheck(lambda x: pref.token_logps(x, labels), (logits,))
    weights = torch.randn(2, 9, generator=g, dtype=torch.float64)
    (pref.token_logps(logits, labels) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    reference = logits[:, :-1].log_softmax(-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    (reference * (labels[:, 1:] != -100) * weights[:, 1:]).sum().backward()
    torch.testing.assert_close(ours, logits.grad, rtol=0, atol=1e-12)


def test_token_logps_keeps_no_float32_copy_of_bf16_logits():
    """What autograd saves for backward: nothing the size of the logits in float32."""
    logits = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 64, (2, 16))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = pref.token_logps(logits, labels)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert big and all(t.dtype == torch.bfloat16 for t in big)
    expected = pref.token_logps(logits.detach().float(), labels)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)  # bf16 values, float32 arithmetic


# ------------------------------------------------------------------------------ sequence_sums


def test_sequence_sums_padded_rows():
    values = torch.tensor([[9.0, -1.0, -2.0, 0.0], [9.0, -4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    sums, counts = pref.sequence_sums(values, mask)
    assert sums.tolist() == [-3.0, -4.0]  # the first token (9.0) is never counted
    assert counts.tolist() == [2, 1]


def test_sequence_sums_packed_rows_in_row_major_order():
    values = torch.arange(12, dtype=torch.float32).view(2, 6)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 0, 1, 1, 1]], dtype=torch.bool)
    sums, counts = pref.sequence_sums(values, mask, position_ids, num_sequences=4)
    # row 0: [0,1,2] -> 1+2, [3,4] -> 4, [5] padding (no label) dropped; row 1: [6,7] -> 7, [8..11] -> 9+10+11
    assert sums.tolist() == [3.0, 4.0, 7.0, 30.0]
    assert counts.tolist() == [2, 1, 1, 3]


def test_sequence_sums_segment_start_never_counted():
    """A label at a sequence start would be predicted from the previous sequence: it is left out."""
    values = torch.tensor([[0.0, -1.0, -5.0, -2.0]])
    position_ids = torch.tensor([[0, 1, 0, 1]])
    sums, counts = pref.sequence_sums(values, torch.ones(1, 4, dtype=torch.bool), position_ids)
    assert sums.tolist() == [-1.0, -2.0] and counts.tolist() == [1, 1]


def test_sequence_sums_checks_the_number_of_sequences():
    values = torch.zeros(1, 6)
    position_ids = torch.tensor([[0, 1, 0, 1, 0, 1]])
    mask = torch.tensor([[0, 1, 0, 0, 0, 1]], dtype=torch.bool)  # the middle sequence has no label
    with pytest.raises(FinetuneError, match="expected 3"):
        pref.sequence_sums(values, mask, position_ids, num_sequences=3)


# ------------------------------------------------------------------------------ papers' formulas


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


PC, PR, RC, RR = _t(-10.0, -3.0), _t(-12.0, -2.5), _t(-11.0, -4.0), _t(-11.5, -2.0)
NC, NR = torch.tensor([4, 2]), torch.tensor([5, 3])


def test_dpo_formula():
    """Rafailov et al. 2023, Eq. 7: -log sigmoid(beta log(pi(yw)/ref(yw)) - beta log(pi(yl)/ref(yl)))."""
    out = pref.dpo_loss(PC, PR, RC, RR, beta=0.1)
    # pair 0: log-ratios 1 and -0.5; pair 1: 1 and -0.5 as well, from other numbers
    expected = [-_logsig(0.1 * (1.0 - -0.5)), -_logsig(0.1 * (1.0 - -0.5))]
    torch.testing.assert_close(out.losses, _t(*expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, _t(0.1, 0.1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.rejected_rewards, _t(-0.05, -0.05), rtol=0, atol=1e-12)


def test_dpo_label_smoothing_formulas():
    """cDPO (Mitchell 2023): expected loss under labels flipped with probability e. rDPO (Chowdhury et al.
    2024, Eq. 8): the unbiased version, divided by 1 - 2e."""
    e, z = 0.2, 0.1 * 1.5
    conservative = pref.dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=e)
    robust = pref.dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=e, smoothing="robust")
    assert conservative.losses[0].item() == pytest.approx((1 - e) * -_logsig(z) + e * -_logsig(-z), abs=1e-12)
    assert robust.losses[0].item() == pytest.approx(
        ((1 - e) * -_logsig(z) - e * -_logsig(-z)) / (1 - 2 * e), abs=1e-12
    )


def test_ipo_formula():
    """Azar et al. 2023, Eq. 17: (h - 1/(2 tau))^2, h from per-token log-ratios as TRL (and the authors) do."""
    tau = 0.5
    out = pref.ipo_loss(PC, PR, RC, RR, NC, NR, beta=tau)
    h0 = 1.0 / 4 - (-0.5) / 5
    h1 = 1.0 / 2 - (-0.5) / 3
    torch.testing.assert_close(out.losses, _t((h0 - 1) ** 2, (h1 - 1) ** 2), rtol=0, atol=1e-12)
    # counts of one give the paper's unnormalised h
    ones = torch.ones(2, dtype=torch.long)
    assert pref.ipo_loss(PC, PR, RC, RR, ones, ones, beta=tau).losses[0].item() == pytest.approx(
        (1.5 - 1) ** 2
    )


def test_simpo_formula():
    """Meng et al. 2024, Eq. 6: -log sigmoid(beta/|yw| log pi(yw) - beta/|yl| log pi(yl) - gamma)."""
    beta, gamma = 2.0, 1.0
    out = pref.simpo_loss(PC, PR, NC, NR, beta=beta, gamma=gamma)
    expected0 = -_logsig(beta / 4 * -10.0 - beta / 5 * -12.0 - gamma)
    expected1 = -_logsig(beta / 2 * -3.0 - beta / 3 * -2.5 - gamma)
    torch.testing.assert_close(out.losses, _t(expected0, expected1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, _t(beta * -2.5, beta * -1.5), rtol=0, atol=1e-12)


def test_orpo_formula():
    """Hong et al. 2024, Eqs. 2-7: L_SFT + lambda * -log sigmoid(log(odds(yw) / odds(yl))), odds = P / (1 - P),
    P the length-normalised likelihood exp(mean token logp)."""
    lam = 0.25
    nll_logps, nll_counts = _t(-14.0, -6.0), torch.tensor([7, 3])
    out = pref.orpo_loss(PC, PR, NC, NR, nll_logps, nll_counts, beta=lam, nll_reduction="sequence")

    def odds(mean_logp: float) -> float:
        p = math.exp(mean_logp)
        return p / (1 - p)

    l_or0 = -_logsig(math.log(odds(-10.0 / 4) / odds(-12.0 / 5)))
    l_or1 = -_logsig(math.log(odds(-3.0 / 2) / odds(-2.5 / 3)))
    torch.testing.assert_close(
        out.losses, _t(14.0 / 7 + lam * l_or0, 6.0 / 3 + lam * l_or1), rtol=0, atol=1e-12
    )
    # TRL's "batch" NLL: one token mean over the batch, (14 + 6) / (7 + 3), on every pair
    batch = pref.orpo_loss(PC, PR, NC, NR, nll_logps, nll_counts, beta=lam)
    torch.testing.assert_close(batch.losses, _t(2.0 + lam * l_or0, 2.0 + lam * l_or1), rtol=0, atol=1e-12)


def test_orpo_log_odds_stable_near_zero_and_far_below():
    """log(1 - e^m) where 1 - e^m cancels (m near 0) or e^m underflows (m very negative)."""
    m = _t(-1e-9, -50.0)
    expected = [math.log(-math.expm1(-1e-9)), math.log1p(-math.exp(-50.0))]
    torch.testing.assert_close(pref._log1mexp(m), _t(*expected), rtol=1e-12, atol=0)


def test_kto_formula():
    """Ethayarajh et al. 2024, Eqs. 7-8: L = lambda_y - v(x, y), v = lambda_D sigmoid(beta (r - z0)) for desirable
    and lambda_U sigmoid(beta (z0 - r)) for undesirable, z0 = max(0, KL estimate) without gradient."""
    beta, w_d, w_u = 0.5, 1.0, 1.5
    policy, ref = _t(-5.0, -9.0, -4.0), _t(-6.0, -8.0, -4.5)
    desirable = torch.tensor([True, False, False])
    kl_policy, kl_ref = _t(-7.0, -3.0, -8.0), _t(-7.5, -3.1, -8.1)  # mean KL = (0.5 + 0.1 + 0.1) / 3
    z0 = pref.kto_reference_point(kl_policy, kl_ref)
    assert z0.item() == pytest.approx(0.7 / 3, abs=1e-12)
    out = pref.kto_loss(policy, ref, desirable, z0, beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    r = [1.0, -1.0, 0.5]
    expected = [
        w_d - w_d * _sig(beta * (r[0] - 0.7 / 3)),
        w_u - w_u * _sig(beta * (0.7 / 3 - r[1])),
        w_u - w_u * _sig(beta * (0.7 / 3 - r[2])),
    ]
    torch.testing.assert_close(out.losses, _t(*expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, _t(beta * 1.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.rejected_rewards, _t(beta * -1.0, beta * 0.5), rtol=0, atol=1e-12)
    # the reference point is clamped at zero and carries no gradient
    negative = pref.kto_reference_point(_t(-9.0).requires_grad_(), _t(-8.0))
    assert negative.item() == 0.0 and not negative.requires_grad


def test_metrics_as_trl_names_them():
    out = pref.dpo_loss(PC, PR, RC, RR, beta=0.1)
    metrics = pref.preference_metrics(out)
    assert set(metrics) == {
        "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected",
    }  # fmt: skip
    assert metrics["rewards/accuracies"].item() == 1.0
    assert metrics["rewards/margins"].item() == pytest.approx(0.15)
    kto = pref.kto_loss(PC, RC, torch.tensor([True, True]), torch.tensor(0.0))
    assert "rewards/accuracies" not in pref.preference_metrics(kto)
    assert "rewards/rejected" not in pref.preference_metrics(kto)  # no undesirable example in the batch


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: pref.dpo_loss(PC, PR, RC, RR, beta=0.0), "beta must be > 0"),
        (lambda: pref.dpo_loss(PC, PR, RC, RR, label_smoothing=0.5, smoothing="robust"), r"\[0, 0.5\)"),
        (lambda: pref.dpo_loss(PC, PR, RC, RR, label_smoothing=0.1, smoothing="cdpo"), "'conservative' or"),
        (lambda: pref.orpo_loss(PC, PR, NC, NR, PC, NC, nll_reduction="mean"), "'batch'"),
    ],
)
def test_user_errors_say_how_to_fix(call, match):
    with pytest.raises(FinetuneError, match=match):
        call()


# ------------------------------------------------------------------------------ against TRL


def _trl():
    return pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")


@pytest.mark.parametrize(
    "loss_type, options",
    [("sigmoid", {"beta": 0.1}), ("robust", {"beta": 0.3, "label_smoothing": 0.1}), ("ipo", {"beta": 0.2})],
)
def test_dpo_trainer_losses_match_trl(tmp_path, loss_type, options):
    """TRL: DPOTrainer.compute_loss on a batch from its own tokenized dataset and DataCollatorForPreference."""
    trl = _trl()
    policy, reference = policy_and_reference()
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=trl_args(trl.DPOConfig, tmp_path, loss_type=[loss_type], **options),
        train_dataset=preference_dataset(),
        processing_class=word_tokenizer(),
    )
    examples = list(trainer.train_dataset)
    trl_loss, trl_grads = loss_and_grads(
        policy, lambda: trainer.compute_loss(policy, trainer.data_collator(examples))
    )
    expected_metrics = trl_metrics(trainer, policy)

    chosen = [completion_row(e["prompt_ids"], e["chosen_ids"]) for e in examples]
    rejected = [completion_row(e["prompt_ids"], e["rejected_ids"]) for e in examples]
    ref_logps = reference_logps(reference, chosen + rejected).chunk(2)
    beta = options["beta"]
    outputs = {}

    def ours():
        sums, counts = padded_logps(policy, chosen + rejected)
        policy_logps, num_tokens = sums.chunk(2), counts.chunk(2)
        if loss_type == "ipo":
            out = pref.ipo_loss(*policy_logps, *ref_logps, *num_tokens, beta=beta)
        elif loss_type == "robust":
            smoothing = options["label_smoothing"]
            out = pref.dpo_loss(
                *policy_logps, *ref_logps, beta=beta, label_smoothing=smoothing, smoothing="robust"
            )
        else:
            out = pref.dpo_loss(*policy_logps, *ref_logps, beta=beta)
        outputs["out"] = out
        return out.losses.mean()

    loss, grads = loss_and_grads(policy, ours)
    torch.testing.assert_close(loss, trl_loss, **LOSS_TOL)
    assert_grads_close(grads, trl_grads, **GRAD_TOL)
    metrics = pref.preference_metrics(outputs["out"])
    assert_metrics_match({k: v.item() for k, v in metrics.items()}, expected_metrics)


def _cpo_family_trainer(trl_trainer, config, tmp_path, **options):
    return trl_trainer(
        model=tiny_llama(),
        args=trl_args(config, tmp_path, max_length=64, **options),
        train_dataset=preference_dataset(),
        processing_class=word_tokenizer(),
    )


def _features_rows(features, side: str) -> list[dict]:
    return [{"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"]} for f in features]


def test_simpo_matches_trl_cpo_trainer(tmp_path):
    """TRL: CPOTrainer(loss_type="simpo", cpo_alpha=0).get_batch_loss_metrics on its own tokenized rows."""
    _trl()
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    beta, gamma = 2.0, 0.7
    options = {
        "loss_type": "simpo",
        "cpo_alpha": 0.0,
        "beta": beta,
        "simpo_gamma": gamma,
        "label_smoothing": 0.1,
    }
    trainer = _cpo_family_trainer(CPOTrainer, CPOConfig, tmp_path, **options)
    features = list(trainer.train_dataset)
    policy = trainer.model
    trl_out = {}

    def theirs():
        loss, trl_out["metrics"] = trainer.get_batch_loss_metrics(policy, trainer.data_collator(features))
        return loss

    trl_loss, trl_grads = loss_and_grads(policy, theirs)
    outputs = {}

    def ours():
        sums, counts = padded_logps(
            policy, _features_rows(features, "chosen") + _features_rows(features, "rejected")
        )
        outputs["out"] = pref.simpo_loss(
            *sums.chunk(2), *counts.chunk(2), beta=beta, gamma=gamma, label_smoothing=0.1
        )
        return outputs["out"].losses.mean()

    loss, grads = loss_and_grads(policy, ours)
    torch.testing.assert_close(loss, trl_loss, **LOSS_TOL)
    assert_grads_close(grads, trl_grads, **GRAD_TOL)
    metrics = pref.preference_metrics(outputs["out"])
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert metrics[key].item() == pytest.approx(trl_out["metrics"][key], rel=1e-5, abs=1e-6), key


def test_conservative_dpo_matches_trl_cpo_sigmoid_loss():
    """TRL 1.16's DPOTrainer has no conservative smoothing any more; CPOTrainer.cpo_loss ("sigmoid" with
    label_smoothing) still computes it. Its margin is chosen - rejected of what it is given, so given the
    log-ratios it is cDPO. Called on an object with the attributes the method reads (no trainer needed)."""
    _trl()
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    pc.requires_grad_(), pr.requires_grad_()
    fake = SimpleNamespace(
        alpha=0.0,
        beta=0.3,
        label_smoothing=0.15,
        loss_type="sigmoid",
        accelerator=SimpleNamespace(device="cpu"),
    )
    trl_losses, trl_chosen_rewards, _ = CPOTrainer.cpo_loss(fake, pc - rc, pr - rr)
    trl_grads = torch.autograd.grad(trl_losses.mean(), (pc, pr))
    out = pref.dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.15)
    grads = torch.autograd.grad(out.losses.mean(), (pc, pr))
    torch.testing.assert_close(out.losses, trl_losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, trl_chosen_rewards, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_orpo_matches_trl_orpo_trainer(tmp_path):
    """TRL: ORPOTrainer.get_batch_loss_metrics. Its NLL term covers prompt + chosen completion, as a token
    mean over the batch: our NLL sums use labels = input_ids on the same forward."""
    _trl()
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    beta = 0.25
    trainer = _cpo_family_trainer(ORPOTrainer, ORPOConfig, tmp_path, beta=beta)
    features = list(trainer.train_dataset)
    policy = trainer.model
    trl_out = {}

    def theirs():
        loss, trl_out["metrics"] = trainer.get_batch_loss_metrics(policy, trainer.data_collator(features))
        return loss

    trl_loss, trl_grads = loss_and_grads(policy, theirs)
    outputs = {}

    def ours():
        batch = collate_rows(
            _features_rows(features, "chosen") + _features_rows(features, "rejected"),
            pad_token_id=0,
            packed=False,
        )
        real = batch["attention_mask"].bool()
        # One log-prob per token for every real token; the completion and the NLL sums are two masks on it.
        logps = pref.token_logps(forward(policy, batch).logits, batch["input_ids"].masked_fill(~real, -100))
        sums, counts = pref.sequence_sums(logps, batch["labels"] != -100)
        nll_sums, nll_counts = pref.sequence_sums(logps, real)
        n = len(features)
        outputs["out"] = pref.orpo_loss(
            *sums.chunk(2), *counts.chunk(2), nll_sums[:n], nll_counts[:n], beta=beta
        )
        return outputs["out"].losses.mean()

    loss, grads = loss_and_grads(policy, ours)
    torch.testing.assert_close(loss, trl_loss, **LOSS_TOL)
    assert_grads_close(grads, trl_grads, **GRAD_TOL)
    metrics = pref.preference_metrics(outputs["out"])
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert metrics[key].item() == pytest.approx(trl_out["metrics"][key], rel=1e-5, abs=1e-6), key


def test_kto_matches_trl_kto_trainer(tmp_path):
    """TRL: KTOTrainer.compute_loss on a batch from its own dataset (with its KL completions) and collator."""
    trl = _trl()
    policy, reference = policy_and_reference()
    dataset = unpaired_dataset()
    beta, w_d, w_u = 0.5, 1.0, 1.4
    trainer = trl.KTOTrainer(
        model=policy,
        ref_model=reference,
        args=trl_args(
            trl.KTOConfig,
            tmp_path,
            per_device_train_batch_size=len(dataset),
            beta=beta,
            desirable_weight=w_d,
            undesirable_weight=w_u,
        ),
        train_dataset=dataset,
        processing_class=word_tokenizer(),
    )
    examples = list(trainer.train_dataset)
    assert [e["KL_completion_ids"] for e in examples] == pref.kto_mismatched_completions(
        [e["completion_ids"] for e in examples]
    )
    trl_loss, trl_grads = loss_and_grads(
        policy, lambda: trainer.compute_loss(policy, trainer.data_collator(examples))
    )
    expected_metrics = trl_metrics(trainer, policy)

    rows = [completion_row(e["prompt_ids"], e["completion_ids"]) for e in examples]
    kl_rows = [completion_row(e["prompt_ids"], e["KL_completion_ids"]) for e in examples]
    desirable = torch.tensor([e["label"] for e in examples])
    ref_logps, ref_kl_logps = reference_logps(reference, rows), reference_logps(reference, kl_rows)
    outputs = {}

    def ours():
        with torch.no_grad():
            policy_kl_logps = padded_logps(policy, kl_rows)[0]
        z0 = pref.kto_reference_point(policy_kl_logps, ref_kl_logps)
        outputs["z0"] = z0
        outputs["out"] = pref.kto_loss(
            padded_logps(policy, rows)[0],
            ref_logps,
            desirable,
            z0,
            beta=beta,
            desirable_weight=w_d,
            undesirable_weight=w_u,
        )
        return outputs["out"].losses.mean()

    loss, grads = loss_and_grads(policy, ours)
    torch.testing.assert_close(loss, trl_loss, **LOSS_TOL)
    assert_grads_close(grads, trl_grads, **GRAD_TOL)
    assert outputs["z0"].item() == pytest.approx(expected_metrics["kl"], rel=1e-4, abs=1e-6)
    metrics = pref.preference_metrics(outputs["out"])
    keys = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    assert_metrics_match({k: v.item() for k, v in metrics.items()}, expected_metrics, keys)


# ------------------------------------------------------------------------------ packed vs padded


def _pairs(num_pairs: int = 5) -> list[tuple[dict, dict]]:
    g = torch.Generator().manual_seed(2)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    pairs = []
    for _ in range(num_pairs):
        prompt = ids(int(torch.randint(2, 8, (1,), generator=g)))
        pairs.append(
            tuple(
                completion_row(prompt, [*ids(int(torch.randint(1, 9, (1,), generator=g))), 2])
                for _ in range(2)
            )
        )
    return pairs


def _pack(rows: list[dict]) -> dict:
    return {
        "input_ids": [t for r in rows for t in r["input_ids"]],
        "labels": [t for r in rows for t in r["labels"]],
        "position_ids": [p for r in rows for p in range(len(r["input_ids"]))],
    }


def _layout_logps(model, pairs, packed: bool) -> dict[str, torch.Tensor]:
    """Per-sequence completion sums/counts and full-sequence (NLL) sums/counts, as (chosen, rejected)."""
    if packed:  # chosen_i, rejected_i side by side; three pairs in the first row, the rest in the second
        flat = [r for pair in pairs for r in pair]
        rows = [_pack(flat[:6]), _pack(flat[6:])]
        batch = collate_rows(rows, pad_token_id=0, pad_to_multiple_of=16, packed=True)
        real = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for i, row in enumerate(rows):
            real[i, : len(row["input_ids"])] = True
        position_ids = batch["position_ids"]
    else:  # TRL's layout: all chosen rows, then all rejected rows
        batch = collate_rows([p[0] for p in pairs] + [p[1] for p in pairs], pad_token_id=0, packed=False)
        real, position_ids = batch["attention_mask"].bool(), None
    logps = pref.token_logps(forward(model, batch).logits, batch["input_ids"].masked_fill(~real, -100))
    n = 2 * len(pairs)
    sums, counts = pref.sequence_sums(logps, batch["labels"] != -100, position_ids, num_sequences=n)
    nll_sums, nll_counts = pref.sequence_sums(logps, real, position_ids, num_sequences=n)

    def split(x):
        return (x[0::2], x[1::2]) if packed else x.chunk(2)

    return {
        "logps": split(sums),
        "counts": split(counts),
        "nll": split(nll_sums),
        "nll_counts": split(nll_counts),
    }


_REF = (torch.tensor([-30.0, -12.0, -25.0, -8.0, -20.0]), torch.tensor([-28.0, -15.0, -20.0, -9.5, -22.0]))
_LOSSES = {
    "dpo": lambda s: pref.dpo_loss(*s["logps"], *_REF, beta=0.1),
    "ipo": lambda s: pref.ipo_loss(*s["logps"], *_REF, *s["counts"], beta=0.5),
    "simpo": lambda s: pref.simpo_loss(*s["logps"], *s["counts"], beta=2.0, gamma=0.5),
    "orpo": lambda s: pref.orpo_loss(*s["logps"], *s["counts"], s["nll"][0], s["nll_counts"][0], beta=0.1),
    "kto": lambda s: pref.kto_loss(
        torch.cat(s["logps"]),
        torch.cat(_REF),
        torch.arange(10) % 3 != 1,
        pref.kto_reference_point(torch.cat(s["nll"]), torch.cat(s["nll"]) - 0.3),
        beta=0.1,
    ),
}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_rows_give_the_padded_rows_logps(attn):
    model = tiny_llama(attn)
    pairs = _pairs()
    with torch.no_grad():
        padded, packed = _layout_logps(model, pairs, packed=False), _layout_logps(model, pairs, packed=True)
    for key in padded:
        for side in (0, 1):
            torch.testing.assert_close(packed[key][side], padded[key][side], rtol=1e-5, atol=1e-5, msg=key)
    assert packed["counts"][0].tolist() == padded["counts"][0].tolist()


@pytest.mark.parametrize("loss", sorted(_LOSSES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_rows_give_the_padded_rows_loss_and_gradients(attn, loss):
    model = tiny_llama(attn)
    pairs = _pairs()
    loss_fn = _LOSSES[loss]
    ref_loss, ref_grads = loss_and_grads(
        model, lambda: loss_fn(_layout_logps(model, pairs, False)).losses.mean()
    )
    packed_loss, grads = loss_and_grads(
        model, lambda: loss_fn(_layout_logps(model, pairs, True)).losses.mean()
    )
    torch.testing.assert_close(packed_loss, ref_loss, rtol=1e-5, atol=1e-6)
    # Summation order differs between layouts, so float32 noise scales with the gradient's size (IPO's
    # squared loss is ~25 here and its embedding gradients reach ~8): atol is relative to the largest.
    for name, ref in ref_grads.items():
        atol = 1e-6 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=atol, msg=name)
    assert grads.keys() == ref_grads.keys()


def test_packing_without_restarting_positions_would_differ():
    """Control for the test above: the same packed rows with plain 0..n-1 positions give other log-probs."""
    model = tiny_llama("sdpa")
    pairs = _pairs()
    flat = [r for pair in pairs for r in pair]
    row = _pack(flat[:6])
    leaky = dict(row, position_ids=list(range(len(row["input_ids"]))))
    with torch.no_grad():
        sums = []
        for r in (row, leaky):
            batch = collate_rows([r], pad_token_id=0, packed=True)
            values = pref.token_logps(forward(model, batch).logits, batch["labels"])
            sums.append(
                pref.sequence_sums(values, batch["labels"] != -100, torch.tensor([row["position_ids"]]))[0]
            )
    assert torch.allclose(sums[0][0], sums[1][0])  # the first sequence sees nothing before it either way
    assert not torch.allclose(sums[0][1:], sums[1][1:], rtol=1e-4)
