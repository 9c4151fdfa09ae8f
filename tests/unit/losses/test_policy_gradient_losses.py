"""finetune.losses.policy_gradient against TRL's GRPOTrainer: the same loss and gradients for every loss
type, with and without the KL term, on the same log-probs and advantages (our packed forward vs TRL's
padded one), and the advantages TRL computes from rewards."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch

from finetune.losses import policy_gradient as pg
from finetune.losses.causal_lm import forward
from finetune.losses.preference import token_logps
from tests.tiny import loss_test_model

VOCAB = 64
LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo"]


def tiny_llama() -> torch.nn.Module:
    return loss_test_model()


def rollout(seed: int = 0, batch: int = 4, prompt_len: int = 3, completion_len: int = 6) -> dict:
    """TRL's padded layout: prompts, right-padded completions, old and reference log-probs.

    The prompts have one length: TRL's forward passes no position_ids, so a left-padded prompt's
    positions would start at its padding (ours restart at 0 for every sequence)."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.long)
    completion_mask = torch.ones(batch, completion_len, dtype=torch.long)
    completion_mask[1, 4:] = 0  # a completion that stopped early
    completion_mask[3, 2:] = 0
    return {
        "prompt_ids": torch.randint(3, VOCAB, (batch, prompt_len), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(3, VOCAB, (batch, completion_len), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=g),
        "noise": 0.3
        * torch.randn(batch, completion_len, generator=g),  # old = policy + noise: some ratios clip
    }


def padded_logps(model, data: dict, temperature: float) -> torch.Tensor:
    """The policy's log-prob of every completion token (batch x completion_len), TRL's layout."""
    ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    mask = torch.cat([data["prompt_mask"], data["completion_mask"]], 1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits / temperature
    labels = ids.masked_fill(mask == 0, -100)
    return token_logps(logits, labels)[:, -data["completion_ids"].shape[1] :]


def packed_completion_logps(model, data: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours: every sequence packed into one row (position_ids restart at 0), then the completion
    tokens' log-probs in order, and the completion each token belongs to."""
    ids, labels, positions, owners = [], [], [], []
    for k in range(len(data["advantages"])):
        prompt = data["prompt_ids"][k][data["prompt_mask"][k].bool()].tolist()
        completion = data["completion_ids"][k][data["completion_mask"][k].bool()].tolist()
        ids += prompt + completion
        labels += [-100] * len(prompt) + completion
        positions += list(range(len(prompt) + len(completion)))
        owners += [k] * len(completion)
    batch = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions])}
    labels_t = torch.tensor([labels])
    logits = forward(model, batch).logits / temperature
    return token_logps(logits, labels_t)[labels_t != -100], torch.tensor(owners)


def trl_trainer(model, tmp: str, **options):
    trl = pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")
    from datasets import Dataset

    from tests.unit.losses.test_preference_losses import word_tokenizer

    beta = options.pop("beta", 0.0)
    options = {"num_generations": 2, "per_device_train_batch_size": 4, **options}
    args = trl.GRPOConfig(output_dir=tmp, report_to=[], use_cpu=True, seed=0, bf16=False, **options)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w1 w2", "w3"]}),
        processing_class=word_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; one micro-batch here
    # With beta > 0 TRL would load a reference model by the policy's name; the reference log-probs are
    # given to _compute_loss directly, so the trainer is built with beta 0 and given it afterwards.
    trainer.beta = beta
    return trainer


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "options",
    [
        {"beta": 0.0, "temperature": 1.0},
        {"beta": 0.04, "temperature": 0.7, "epsilon": 0.1, "epsilon_high": 0.28},
        {"beta": 0.1, "temperature": 1.0, "use_bias_correction_kl": False},
    ],
    ids=["no-kl", "kl-temperature-asymmetric-clip", "kl-uncorrected"],
)
def test_losses_and_gradients_equal_trls(loss_type, options):
    data = rollout()
    policy = tiny_llama()
    ours_model = copy.deepcopy(policy)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    temperature, beta = options["temperature"], options["beta"]
    epsilon_low = options.get("epsilon", 0.2)
    epsilon_high = options.get("epsilon_high", epsilon_low)
    completion_len = data["completion_ids"].shape[1]
    with torch.no_grad():
        old = padded_logps(policy, data, temperature) + data["noise"]
        ref = padded_logps(reference, data, temperature)
    mask = data["completion_mask"].bool()

    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(
            policy, tmp, loss_type=loss_type, max_completion_length=completion_len, **dict(options)
        )
        inputs = {
            **{k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")},
            "advantages": data["advantages"],
            "old_per_token_logps": old,
            "ref_per_token_logps": ref,
            "num_items_in_batch": data["completion_mask"].sum(),
        }
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        trl_loss.backward()
        trl_grads = grads(trainer.model)

    logps, owners = packed_completion_logps(ours_model, data, temperature)
    out = pg.per_token_loss(
        logps, old[mask], data["advantages"][owners],
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, ref_logps=ref[mask] if beta else None,
        kl_bias_correction=options.get("use_bias_correction_kl", True),
    )  # fmt: skip
    units = {"completions": len(data["advantages"]), "tokens": int(mask.sum()), "micro_batches": 1}
    loss = (
        pg.policy_loss_sums(
            out.losses,
            owners,
            len(data["advantages"]),
            loss_type=loss_type,
            max_completion_length=completion_len,
        )
        / units[pg.UNITS[loss_type]]
    )
    loss.backward()
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    ours = grads(ours_model)
    assert ours.keys() == trl_grads.keys()
    for name, value in trl_grads.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert out.low_clipped.any() or out.high_clipped.any()  # the noise makes some ratios clip


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trls(scale_rewards, tmp_path):
    """TRL's own code: GRPOTrainer._generate_and_score_completions on fixed completions (its generation
    replaced by them) with a reward function giving fixed rewards, against group_advantages."""
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 2.0, 2.0]
    completions = [f"w{k + 1}" for k in range(len(rewards))]  # distinct words of the test vocabulary
    by_text = dict(zip(completions, rewards, strict=True))
    trainer = trl_trainer(
        tiny_llama(), str(tmp_path), scale_rewards=scale_rewards, per_device_train_batch_size=8
    )
    trainer.reward_funcs = [lambda completions, **kwargs: [by_text[c] for c in completions]]
    trainer.reward_func_names = ["fixed"]
    trainer.reward_weights = torch.ones(1)
    tokenizer = trainer.processing_class
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    prompt = tokenizer("w1 w2", add_special_tokens=False)["input_ids"]

    def fixed_generation(prompts):
        return [prompt] * len(prompts), ids, None, completions, None, {}, None, None

    trainer._generate = fixed_generation
    trainer.model.eval()
    with torch.no_grad():
        out = trainer._generate_and_score_completions([{"prompt": "w1 w2"} for _ in rewards])
    ours, flat = pg.group_advantages(torch.tensor(rewards), num_generations=2, scale_rewards=scale_rewards)
    torch.testing.assert_close(ours, out["advantages"].cpu().float())
    assert flat.tolist() == [False, False, True, True, False, False, True, True]


def test_a_kl_term_without_reference_log_probs_is_refused():
    with pytest.raises(ValueError, match="ref_logps"):
        pg.per_token_loss(
            torch.zeros(2), torch.zeros(2), torch.ones(2), epsilon_low=0.2, epsilon_high=0.2, beta=0.1
        )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_importance_sampling_correction_equals_trls(loss_type, mode):
    """vLLM's sampling log-probs differ from the trainer's: the importance weights (ours, from both
    log-probs) multiply the surrogate as TRL's GRPOTrainer applies its importance_sampling_ratio, with
    the KL term left out of the correction."""
    data = rollout(seed=3)
    policy = tiny_llama()
    ours_model = copy.deepcopy(policy)
    completion_len = data["completion_ids"].shape[1]
    mask = data["completion_mask"].bool()
    with torch.no_grad():
        old = padded_logps(policy, data, 1.0)
        ref = old + 0.1
    sampled = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7))
    owners = torch.arange(len(data["advantages"]))[:, None].expand_as(mask)[mask]
    weights = pg.importance_weights(
        old[mask], sampled[mask], owners, len(data["advantages"]), mode=mode, cap=1.5
    )
    assert (weights != torch.exp(old[mask] - sampled[mask])).any()  # the cap acts
    padded_weights = torch.zeros_like(old)
    padded_weights[mask] = weights
    if mode == "sequence_mask":  # TRL's sequence ratios are one per completion: (B, 1)
        padded_weights = padded_weights.max(dim=1, keepdim=True).values
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(
            policy, tmp, loss_type=loss_type, max_completion_length=completion_len, beta=0.05
        )
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        inputs = {
            **{k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")},
            "advantages": data["advantages"],
            "old_per_token_logps": old,
            "ref_per_token_logps": ref,
            "importance_sampling_ratio": padded_weights,
            "num_items_in_batch": data["completion_mask"].sum(),
        }
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        trl_loss.backward()
        trl_grads = grads(trainer.model)
    logps, owners = packed_completion_logps(ours_model, data, 1.0)
    out = pg.per_token_loss(
        logps, old[mask], data["advantages"][owners], epsilon_low=0.2, epsilon_high=0.2,
        beta=0.05, ref_logps=ref[mask], sampling_weights=weights,
    )  # fmt: skip
    units = {"completions": len(data["advantages"]), "tokens": int(mask.sum())}[pg.UNITS[loss_type]]
    loss = (
        pg.policy_loss_sums(
            out.losses,
            owners,
            len(data["advantages"]),
            loss_type=loss_type,
            max_completion_length=completion_len,
        )
        / units
    )
    loss.backward()
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, value in trl_grads.items():
        torch.testing.assert_close(grads(ours_model)[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_importance_weights_by_mode():
    """Per token or per completion (the ratio of its log-prob sums), truncated at the cap or masked
    above it; a token vLLM gave no log-prob for (NaN) is not corrected."""
    old = torch.tensor([0.0, -1.0, -2.0, -0.5])
    sampled = torch.tensor([-1.0, -1.0, -1.0, float("nan")])
    index = torch.tensor([0, 0, 1, 1])
    e = torch.exp(torch.tensor(1.0))
    token = pg.importance_weights(old, sampled, index, 2, mode="token_truncate", cap=2.0)
    torch.testing.assert_close(token, torch.tensor([2.0, 1.0, 1 / e, 1.0]))
    masked = pg.importance_weights(old, sampled, index, 2, mode="token_mask", cap=2.0)
    torch.testing.assert_close(masked, torch.tensor([0.0, 1.0, 1 / e, 1.0]))
    sequence = pg.importance_weights(old, sampled, index, 2, mode="sequence_truncate", cap=2.0, floor=0.5)
    torch.testing.assert_close(sequence, torch.tensor([2.0, 2.0, 0.5, 0.5]))
    uncapped = pg.importance_weights(old, sampled, index, 2, mode="sequence_mask", cap=None)
    torch.testing.assert_close(uncapped, torch.tensor([e, e, 1 / e, 1 / e]))


# ------------------------------------------------------------------------------------------- RLOO


def trl_rloo_trainer(model, tmp: str, **options):
    trl = pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")
    from datasets import Dataset

    from tests.unit.losses.test_preference_losses import word_tokenizer

    options = {"num_generations": 2, "per_device_train_batch_size": 4, "beta": 0.0, **options}
    args = trl.RLOOConfig(output_dir=tmp, report_to=[], use_cpu=True, seed=0, bf16=False, **options)
    trainer = trl.RLOOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w1 w2", "w3"]}),
        processing_class=word_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize(
    "options", [{}, {"epsilon": 0.1, "epsilon_high": 0.28}], ids=["symmetric", "asymmetric"]
)
def test_rloo_sequence_loss_and_gradients_equal_trls(options):
    """RLOO's loss: one ratio per completion (exp of its summed token log-ratios), clipped, times its
    advantage, averaged over completions; TRL's RLOOTrainer._compute_loss on the same tokens."""
    data = rollout(seed=1)
    # old = policy + a shift per completion: ratios 1.5 and 0.6 clip (high with A > 0, low with A < 0)
    data["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    data["noise"] = torch.tensor([-0.4, 0.5, 0.0, 0.01])[:, None] / data["completion_mask"].sum(
        1, keepdim=True
    )
    policy = tiny_llama()
    ours_model = copy.deepcopy(policy)
    mask = data["completion_mask"].bool()
    with torch.no_grad():
        old = padded_logps(policy, data, 1.0) + data["noise"]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_rloo_trainer(
            policy, tmp, max_completion_length=data["completion_ids"].shape[1], **options
        )
        inputs = {
            **{k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")},
            "advantages": data["advantages"],
            "old_logps": (old * data["completion_mask"]).sum(1),
        }
        trl_loss = trainer._compute_loss(trainer.model, inputs)
        trl_loss.backward()
        trl_grads = grads(trainer.model)
    logps, owners = packed_completion_logps(ours_model, data, 1.0)
    n = len(data["advantages"])
    out = pg.sequence_loss(
        logps, old[mask], data["advantages"][owners], owners, n,
        epsilon_low=options.get("epsilon", 0.2), epsilon_high=options.get("epsilon_high", options.get("epsilon", 0.2)),
    )  # fmt: skip
    loss = pg.policy_loss_sums(out.losses, owners, n, loss_type="rloo", max_completion_length=6) / n
    loss.backward()
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    # Gradients to 2e-5 absolute (of entries up to about 2): a completion's ratio is the exp of a sum of
    # token log-ratios, which the two layouts add in different orders.
    for name, value in trl_grads.items():
        torch.testing.assert_close(grads(ours_model)[name], value, rtol=1e-4, atol=2e-5, msg=name)
    assert out.low_clipped.any() or out.high_clipped.any()


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_and_reward_kl_equal_trls(normalize, tmp_path):
    """TRL's own code: RLOOTrainer._generate_and_score_completions on fixed completions (its generation
    replaced by them), fixed rewards and a reference model, against ours: each completion's summed
    log(policy / reference) over the packed rows paid from its reward (beta), then leave-one-out
    advantages (normalize_advantages: scale_rewards batch)."""
    import copy

    from finetune.objectives.rollout import completion_sums, pack_completions, token_logps_at

    rewards = [1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 2.0, 1.0]
    completions = ["w1 w2", "w3", "w4 w5 w6", "w7", "w2 w2", "w8 w1", "w3 w3 w3", "w5"]
    by_text = dict(zip(completions, rewards, strict=True))
    policy = tiny_llama()
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    beta = 0.1
    trainer = trl_rloo_trainer(
        policy, str(tmp_path), per_device_train_batch_size=8, normalize_advantages=normalize
    )
    # TRL patches the models it prepares (a fused head returning log-probs): the reference goes through a
    # trainer of its own, as TRL would load it
    reference_trainer = trl_rloo_trainer(reference, str(tmp_path / "ref"), per_device_train_batch_size=8)
    trainer.beta, trainer.ref_model = beta, reference_trainer.model
    trainer.reward_funcs = [lambda completions, **kwargs: [by_text[c] for c in completions]]
    trainer.reward_func_names = ["fixed"]
    trainer.reward_weights = torch.ones(1)
    tokenizer = trainer.processing_class
    eos = tokenizer.eos_token_id
    ids = [[*tokenizer(c, add_special_tokens=False)["input_ids"], eos] for c in completions]  # all finished
    prompt = tokenizer("w1 w2", add_special_tokens=False)["input_ids"]
    trainer._generate = lambda prompts: ([prompt] * len(prompts), ids, completions)
    trainer.model.eval()
    with torch.no_grad():
        out = trainer._generate_and_score_completions([{"prompt": "w1 w2"} for _ in rewards])
    batches = pack_completions([(prompt, c, True, 0.0) for c in ids], per_batch=3, pad_token_id=0)
    with torch.no_grad():
        for batch in batches:
            batch["old_logps"] = token_logps_at(policy.eval(), batch)
            batch["ref_logps"] = token_logps_at(reference, batch)
    kl = completion_sums(batches, lambda b: b["old_logps"] - b["ref_logps"])
    ours, _ = pg.leave_one_out_advantages(
        torch.tensor(rewards) - beta * kl, num_generations=2, scale_rewards="batch" if normalize else "none"
    )
    torch.testing.assert_close(ours, out["advantages"].cpu().float(), rtol=1e-5, atol=1e-6)
    assert (kl.abs() > 1e-3).all()  # the reference differs: the KL term moves the advantages


def test_whitened_advantages_are_reinforce_pp_baseline_s_over_the_tokens():
    """REINFORCE++-baseline (OpenRLHF's reinforce_baseline): the group's mean subtracted, then every trained
    token's advantage whitened together (mean and population variance over the tokens, torch's own mean and
    var on the token layout here); equal token counts make it GRPO's centred advantages over their std.
    OpenRLHF needs Ray and vLLM to import, so it is not in the test extra: the token layout is computed
    directly."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.0, 3.0, 1.0])
    tokens = torch.tensor([4, 1, 2, 3, 3, 5, 2, 2, 7])
    ours, flat = pg.whitened_advantages(
        rewards, num_generations=3, scale_rewards="batch", tokens=tokens.float()
    )
    centred, _ = pg.group_advantages(rewards, num_generations=3, scale_rewards="none")
    per_token = centred.repeat_interleave(tokens)
    expected = (per_token - per_token.mean()) / per_token.var(correction=0).sqrt()
    torch.testing.assert_close(ours.repeat_interleave(tokens), expected)
    assert flat.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert not torch.allclose(
        ours, pg.whitened_advantages(rewards, num_generations=3, scale_rewards="batch")[0]
    )
    same, _ = pg.whitened_advantages(rewards, num_generations=3, scale_rewards="batch")
    torch.testing.assert_close(same, centred / centred.std(correction=0))
    # group and none are GRPO's own scales
    for scale in ("group", "none"):
        torch.testing.assert_close(
            pg.whitened_advantages(rewards, num_generations=3, scale_rewards=scale, tokens=tokens.float())[0],
            pg.group_advantages(rewards, num_generations=3, scale_rewards=scale)[0],
        )
    # no trained token at all (every completion masked): finite
    zero, _ = pg.whitened_advantages(rewards, num_generations=3, scale_rewards="batch", tokens=torch.zeros(9))
    assert torch.isfinite(zero).all()
