"""The online objective (GRPO) and its rollout's parts: packed rollouts, their loss against the padded layout, seeds, the
rollout buffer that num_iterations reuses and checkpoints, and the repeating prompt sampler."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from finetune.data.batching.sampler import RankBatchSampler, RepeatBatchSampler
from finetune.engine.extra_state import load_extra, save_extra
from finetune.losses import policy_gradient as pg
from finetune.losses.causal_lm import forward
from finetune.losses.preference import token_logps
from finetune.objectives.online import OnlineObjective
from finetune.objectives.rollout import RolloutBuffer, completion_seed, pack_completions
from finetune.recipe.grpo import GrpoSection
from finetune.recipe.objectives import OBJECTIVES
from tests.tiny import loss_test_model, tiny_model

VOCAB = 64


def tiny_llama() -> torch.nn.Module:
    return loss_test_model()


def sequences(n: int = 6, seed: int = 0) -> list[tuple[list[int], list[int], bool, float]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
        completion = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
        out.append((prompt, completion, k % 3 != 2, rng.uniform(-1, 1)))
    return out


def grouped_sequences(
    groups: int = 2, group: int = 3, seed: int = 0
) -> list[tuple[list[int], list[int], bool, float]]:
    """A rollout's shape: `group` completions of each prompt, one after the other (the prompts of different lengths)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(2 + 3 * g)]
        for k in range(group):
            completion = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
            out.append((prompt, completion, (g + k) % 3 != 2, rng.uniform(-1, 1)))
    return out


def objective(loss_type: str, **settings) -> OnlineObjective:
    obj = OnlineObjective.__new__(OnlineObjective)  # the parts `loss` and `units` read, without a build
    obj.ahead = None
    obj.toolbox, obj.message_fields = None, []  # no tools in the loop
    obj.settings = GrpoSection(
        loss_type=loss_type, max_new_tokens=8, rewards=[{"name": "length"}], **settings
    )
    return obj


def padded_loss(model, seqs, loss_type: str, settings: GrpoSection) -> torch.Tensor:
    """The same loss from a right-padded batch, one sequence per row (TRL's layout)."""
    width = max(len(p) + len(c) for p, c, _, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for k, (p, c, _, _) in enumerate(seqs):
        ids[k, : len(p) + len(c)] = torch.tensor(p + c)
        labels[k, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[k, : len(p) + len(c)] = 1
    logps = token_logps(model(input_ids=ids, attention_mask=mask).logits, labels)
    trained = labels != -100
    owners = torch.arange(len(seqs))[:, None].expand_as(labels)[trained]
    advantages = torch.tensor([a for *_, a in seqs])[owners]
    out = pg.per_token_loss(
        logps[trained], logps[trained].detach(), advantages, epsilon_low=0.2, epsilon_high=0.2
    )
    total = pg.policy_loss_sums(out.losses, owners, len(seqs), loss_type=loss_type, max_completion_length=8)
    units = {"completions": len(seqs), "tokens": int(trained.sum()), "micro_batches": 1}[pg.UNITS[loss_type]]
    return total / units


@pytest.mark.parametrize("share", [False, True], ids=["prompt_per_completion", "shared_prompts"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_a_packed_rollout_gives_the_padded_layouts_loss_and_gradients(loss_type, share):
    seqs = sequences() + grouped_sequences()
    policy = tiny_llama()
    padded_model = copy.deepcopy(policy)
    obj = objective(loss_type)
    (batch,) = pack_completions(
        seqs, per_batch=len(seqs), pad_token_id=0, pad_to_multiple_of=16, share_prompts=share
    )
    assert batch["input_ids"].shape[1] % 16 == 0
    real = int(batch["prompt_tokens"]) + int(batch["completion_tokens"])
    copies = sum(len(p) for p, *_ in seqs)
    once = sum(len(p) for k, (p, *_) in enumerate(seqs) if k == 0 or seqs[k - 1][0] != p)
    assert real == sum(len(c) for _, c, *_ in seqs) + (once if share else copies)
    loss, metrics = obj.loss(policy, batch, obj.units(batch))
    loss.backward()
    expected = padded_loss(padded_model, seqs, loss_type, obj.settings)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    theirs = {n: p.grad for n, p in padded_model.named_parameters()}
    for name, param in policy.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name], rtol=1e-4, atol=1e-6, msg=name)
    assert set(metrics) == {
        "clip_ratio/low",
        "clip_ratio/high",
        "count:clip_ratio/low",
        "count:clip_ratio/high",
    }


@pytest.mark.parametrize("share", [False, True], ids=["prompt_per_completion", "shared_prompts"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_a_packed_rollout_that_clips_and_pays_kl_gives_trls_loss_and_gradients(loss_type, share, tmp_path):
    """The objective's loss on a packed rollout against TRL's GRPOTrainer._compute_loss on the padded
    layout, in the setting where the packing could go wrong unseen: num_iterations 2 (old log-probs of
    the policy before the update, perturbed so that ratios clip on both sides), beta > 0 with reference
    log-probs (the KL term), an asymmetric clip and a temperature. Loss and gradients."""
    from tests.unit.losses.test_policy_gradient_losses import grads, padded_logps, trl_trainer

    generator = torch.Generator().manual_seed(7)
    width, num = 8, 6  # completions right-padded to max_new_tokens; prompts of one length (TRL's
    # forward gets no position_ids, so a left-padded prompt would start at its padding's positions)
    lengths = [8, 3, 5, 1, 6, 4]
    data = {
        "prompt_ids": torch.randint(3, VOCAB, (num, 4), generator=generator),
        "prompt_mask": torch.ones(num, 4, dtype=torch.long),
        "completion_mask": (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long(),
        "advantages": torch.tensor([0.9, -1.2, 0.4, -0.7, 1.5, -0.3]),  # both signs: both clips act
    }
    data["prompt_ids"] = data["prompt_ids"][[0, 0, 0, 3, 3, 3]]  # two groups of three completions
    data["completion_ids"] = (
        torch.randint(3, VOCAB, (num, width), generator=generator) * data["completion_mask"]
    )
    settings = {"num_iterations": 2, "beta": 0.1, "epsilon": 0.15, "epsilon_high": 0.3, "temperature": 0.7}
    policy = tiny_llama()
    ours_model = copy.deepcopy(policy)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
        old = padded_logps(policy, data, 0.7) + 0.5 * torch.randn(num, width, generator=generator)
        ref = padded_logps(reference, data, 0.7)

    trainer = trl_trainer(
        policy, str(tmp_path), loss_type=loss_type, max_completion_length=width, per_device_train_batch_size=num,
        num_iterations=2, beta=0.1, epsilon=0.15, epsilon_high=0.3, temperature=0.7, use_bias_correction_kl=True,
    )  # fmt: skip
    inputs = {
        k: data[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    }
    inputs |= {"old_per_token_logps": old, "ref_per_token_logps": ref}
    trl_loss = trainer._compute_loss(
        trainer.model, inputs | {"num_items_in_batch": data["completion_mask"].sum()}
    )
    trl_loss.backward()

    mask = data["completion_mask"].bool()
    seqs = [
        (
            data["prompt_ids"][k].tolist(),
            data["completion_ids"][k][mask[k]].tolist(),
            True,
            float(data["advantages"][k]),
        )
        for k in range(num)
    ]
    (batch,) = pack_completions(
        seqs, per_batch=num, pad_token_id=0, pad_to_multiple_of=16, share_prompts=share
    )
    trained = batch["labels"] != -100
    for key, padded in (("old_logps", old), ("ref_logps", ref)):  # each completion token's, in packed order
        batch[key] = torch.zeros(batch["labels"].shape)
        batch[key][trained] = padded[mask]
    obj = objective(loss_type, kl_bias_correction=True, **settings)
    loss, metrics = obj.loss(ours_model, batch, obj.units(batch))
    loss.backward()
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    theirs, ours = grads(trainer.model), grads(ours_model)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert metrics["clip_ratio/low"] > 0 and metrics["clip_ratio/high"] > 0, metrics  # both clips acted
    assert metrics["kl"] > 0


@pytest.mark.parametrize("share", [False, True], ids=["prompt_per_completion", "shared_prompts"])
def test_accumulated_micro_batches_equal_one_batch_for_the_window_units(share):
    """Two micro-batches normalised by the window's units give the one-batch loss (dapo: tokens); with
    shared prompts, a group split over the two micro-batches has its prompt in each."""
    seqs = sequences(2, seed=3) + grouped_sequences(2, 3, seed=3)
    policy = tiny_llama()
    obj = objective("dapo")
    whole = pack_completions(seqs, per_batch=8, pad_token_id=0, share_prompts=share)
    halves = pack_completions(seqs, per_batch=4, pad_token_id=0, share_prompts=share)
    units = sum(obj.units(b) for b in halves)
    assert units == obj.units(whole[0])
    split = sum(obj.loss(policy, b, units)[0] for b in halves)
    torch.testing.assert_close(
        split, obj.loss(policy, whole[0], obj.units(whole[0]))[0], rtol=1e-5, atol=1e-6
    )


def test_a_shared_prompt_row_scores_like_one_copy_per_completion_with_eager_attention_too():
    """The tree mask in both forms (SDPA's boolean, eager's additive) and the positions projected on the
    vocabulary: the log-probs of a shared-prompt row equal the copy-per-completion row's."""
    from finetune.objectives.rollout import shares_prompts, token_logps_at

    seqs = grouped_sequences(3, 4, seed=5)
    for attn in ("sdpa", "eager"):
        model = loss_test_model(attn)
        assert shares_prompts(model)
        copied, shared = (
            pack_completions(seqs, per_batch=len(seqs), pad_token_id=0, share_prompts=share)[0]
            for share in (False, True)
        )
        assert shared["input_ids"].shape[1] < copied["input_ids"].shape[1]
        with torch.no_grad():
            full = token_logps(
                forward(
                    model, {"input_ids": copied["input_ids"], "position_ids": copied["position_ids"]}
                ).logits,
                copied["labels"],
            )
            ours = token_logps_at(model, shared)
        torch.testing.assert_close(
            ours[shared["labels"] != -100], full[copied["labels"] != -100], rtol=1e-5, atol=1e-5
        )


def test_prompts_are_shared_only_where_the_attention_takes_the_tree_mask():
    """Flash attention reads sequence boundaries only: its rows keep a prompt copy per completion, as
    do models without transformers' logits_to_keep; a PEFT or DDP-wrapped model is read underneath."""
    from finetune.model.adapters import apply_lora
    from finetune.objectives.rollout import shares_prompts
    from finetune.recipe import LoraSection

    model = loss_test_model("sdpa")
    wrapped = SimpleNamespace(
        module=apply_lora(
            copy.deepcopy(model), LoraSection(enable_lora=True, lora_rank=2), gradient_checkpointing=False
        )
    )
    assert shares_prompts(model) and shares_prompts(wrapped)
    model.config._attn_implementation = "flash_attention_2"
    assert not shares_prompts(model)

    class NoKeep(torch.nn.Module):
        config = SimpleNamespace(_attn_implementation="sdpa")

        def forward(self, input_ids, position_ids=None):
            return input_ids

    assert not shares_prompts(NoKeep()) and not shares_prompts(None)


def test_masked_truncated_completions_train_nothing_but_still_count():
    seqs = sequences()
    (masked,) = pack_completions(seqs, per_batch=6, pad_token_id=0, mask_truncated=True)
    (kept,) = pack_completions(seqs, per_batch=6, pad_token_id=0)
    truncated_tokens = sum(len(c) for _, c, finished, _ in seqs if not finished)
    assert int((kept["labels"] != -100).sum()) - int((masked["labels"] != -100).sum()) == truncated_tokens
    assert int(masked["num_sequences"]) == 6 and int(masked["completion_tokens"]) == int(
        kept["completion_tokens"]
    )


def test_completion_seeds_are_fixed_and_distinct():
    seeds = {completion_seed(42, step, row, j) for step in range(3) for row in range(5) for j in range(4)}
    assert len(seeds) == 60 and all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(42, 1, 2, 3) == completion_seed(42, 1, 2, 3)


def test_the_rollout_buffer_is_reused_then_renewed_and_survives_a_checkpoint(tmp_path):
    batches = pack_completions(sequences(), per_batch=3, pad_token_id=0)
    buffer = RolloutBuffer()
    assert buffer.take([1, 2], 2) is None
    buffer.keep([1, 2], batches)
    save_extra({"rollout": buffer}, tmp_path)
    again = buffer.take([1, 2], 2)
    assert again is not None and torch.equal(again[1]["input_ids"], batches[1]["input_ids"])
    assert buffer.take([1, 2], 2) is None  # used twice: a new rollout
    assert buffer.take([3, 4], 2) is None  # other prompts
    restored = RolloutBuffer()
    load_extra({"rollout": restored}, tmp_path)
    assert restored.key == [1, 2] and restored.uses == 1
    for ours, theirs in zip(restored.take([1, 2], 2), batches, strict=True):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_repeating_sampler_gives_each_batch_in_a_row_and_keeps_epochs():
    sampler = RepeatBatchSampler(RankBatchSampler(6, micro_batch_size=2, seed=1), 3)
    first = list(sampler)
    assert len(first) == len(sampler) == 9
    assert all(first[i] == first[i + 1] == first[i + 2] for i in range(0, 9, 3))
    sampler.set_epoch(1)
    assert list(sampler) != first and sampler.dropped_per_epoch == 0


def test_units_follow_the_loss_type():
    (batch,) = pack_completions(sequences(), per_batch=6, pad_token_id=0)
    trained = int((batch["labels"] != -100).sum())
    assert [int(objective(t).units(batch)) for t in ("grpo", "dr_grpo", "dapo", "bnpo")] == [6, 6, trained, 1]


def test_counts_skip_a_window_consumed_without_rollout():
    obj = objective("dapo")
    assert obj.counts([{"prompt_ids": [1, 2]}]) == {}
    (batch,) = pack_completions(sequences(), per_batch=6, pad_token_id=0)
    assert obj.counts(batch)["tokens"] == sum(len(p) + len(c) for p, c, _, _ in sequences())


def test_sampling_temperature_scales_the_trained_log_probs():
    seqs = sequences()
    policy = tiny_llama()
    (batch,) = pack_completions(seqs, per_batch=6, pad_token_id=0)
    cold = objective("dapo", temperature=0.5)
    logps = cold._token_logps(policy, batch)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    logits = forward(policy, inputs).logits / 0.5
    torch.testing.assert_close(logps, token_logps(logits, batch["labels"]))


@pytest.mark.parametrize(
    "kind, stage, sharding",
    [("FSDP", None, "fsdp"), ("DEEPSPEED", 3, "zero3"), ("DEEPSPEED", 2, None), ("MULTI_CPU", None, None)],
)
def test_how_the_weights_are_sharded_decides_the_generation_context(kind, stage, sharding):
    """ZeRO-3 and FSDP shard the weights (the rollout gathers them); ZeRO-2 and DDP keep them whole."""
    from accelerate.utils import DistributedType

    from finetune.distributed import sharding_of

    acc = SimpleNamespace(
        distributed_type=getattr(DistributedType, kind),
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)),
    )
    assert sharding_of(acc) == sharding


class RecordingBackend:
    """A generation backend that answers every prompt with fixed completions and records its calls."""

    name = "recording"
    processor = None
    copies_weights = False
    stops = (2,)

    def __init__(self, tokenizer, completions, logprobs=None):
        self.tokenizer, self.completions, self.calls, self.synced = tokenizer, completions, [], []
        self.logprobs = logprobs  # per completion, as an engine with its own weights (vLLM) returns them

    def generate(self, prompts, params, *, seeds=None, batch_size=8, images=None, progress=False):
        from finetune.generation.protocol import Completion

        self.calls.append((prompts, params, seeds, batch_size))
        return [
            [
                Completion(list(ids), ids[-1:] == [2], None if self.logprobs is None else self.logprobs[j])
                for j, ids in enumerate(self.completions)
            ]
            for _ in prompts
        ]

    def sync_weights(self, model):
        self.synced.append(model)


PROMPTS = [
    {"input_ids": [1, 5, 6], "row_index": 4, "row": '{"q": "a"}'},
    {"input_ids": [1, 9], "row_index": 8, "row": '{"q": "b"}'},
]


def online_objective(tokenizer, completions, logprobs=None, **settings) -> OnlineObjective:
    """An online objective ready to roll out through a RecordingBackend (no model build)."""
    from finetune.generation.rewards import Reward

    settings = {"loss_type": "grpo", "num_generations": 3, "log_completions": 0, **settings}
    obj = objective(settings.pop("loss_type"), **settings)
    obj.estimator = pg.ESTIMATORS["group"]
    obj.train = SimpleNamespace(seed=11, micro_batch_size=3)
    obj.data = SimpleNamespace(pad_to_multiple_of=1)
    obj.tokenizer = tokenizer
    obj.buffer = RolloutBuffer()
    obj.accelerator = SimpleNamespace(
        num_processes=1, device=torch.device("cpu"), unwrap_model=lambda m: ("unwrapped", m)
    )
    obj.backend = RecordingBackend(tokenizer, completions, logprobs)
    obj.sharding = None  # whole weights (finetune.distributed.sharding_of)
    obj.ahead = None  # in step (async_rollouts: false)

    def is_seven(completions, rows):
        return [float(text.strip() == "7") for text in completions]

    obj.rewards = [Reward("seven", 1.0, is_seven)]
    return obj


def test_the_rollout_samples_scores_and_packs_through_the_backend():
    """The online objective's rollout through the generation-backend seam: prompts go in as ids with
    the section's sampling settings and one seed per completion; rewards of the decoded completions
    become group advantages; an update syncs the backend with the unwrapped model."""
    from transformers import AutoTokenizer

    from finetune.generation.protocol import SamplingParams
    from finetune.objectives.rollout import completion_seed

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    digits = [tokenizer(f" {n}", add_special_tokens=False)["input_ids"] for n in (7, 13, 7)]
    obj = online_objective(
        tokenizer, [[*ids, 2] for ids in digits], temperature=0.7, top_k=5, generation_batch_size=4
    )
    batches, stats = obj.rollout(torch.nn.Identity(), [PROMPTS], step=3)
    ((ids, params, seeds, batch_size),) = obj.backend.calls
    assert ids == [[1, 5, 6], [1, 9]] and batch_size == 4
    assert params == SamplingParams(
        max_new_tokens=8, temperature=0.7, top_p=1.0, top_k=5, num_return_sequences=3
    )
    assert seeds == [[completion_seed(11, 3, row, j) for j in range(3)] for row in (4, 8)]
    assert stats["reward_sum"] == 4.0 and stats["completions"] == 6.0
    advantages, _ = pg.group_advantages(
        torch.tensor([1.0, 0, 1, 1, 0, 1]), num_generations=3, scale_rewards="group"
    )
    trained = torch.cat([b["advantages"][b["seq_index"] >= 0] for b in batches])
    lengths = [len(ids) + 1 for ids in digits] * 2
    torch.testing.assert_close(trained, advantages.repeat_interleave(torch.tensor(lengths)))
    obj.after_update("model")
    assert obj.backend.synced == [("unwrapped", "model")]


@pytest.mark.parametrize(
    "settings",
    [{}, {"epsilon_high": 0.28}, {"epsilon": 0.1}, {"kl_bias_correction": False}, {"beta": 0.3}],
    ids=["defaults", "epsilon_high", "epsilon", "no_kl_bias_correction", "beta"],
)
def test_every_loss_setting_reaches_the_loss(settings):
    """The section's clipping and KL settings reach the per-token loss: the objective's loss equals the
    pure loss called with exactly those settings, and differs from the one with the defaults (the
    batch's old and reference log-probs are spread so that clipping and the KL term both act)."""
    seqs = sequences(6, seed=5)
    policy = tiny_llama()
    (batch,) = pack_completions(seqs, per_batch=6, pad_token_id=0)
    obj = objective("grpo", **{"num_iterations": 2, "beta": 0.1, **settings})
    default = objective("grpo", num_iterations=2, beta=0.1)
    mask = batch["labels"] != -100
    logps = obj._token_logps(policy, batch).detach()
    generator = torch.Generator().manual_seed(0)
    batch["old_logps"] = logps + 0.4 * torch.randn(logps.shape, generator=generator)
    batch["ref_logps"] = logps + 0.4 * torch.randn(logps.shape, generator=generator)
    s = obj.settings
    out = pg.per_token_loss(
        logps[mask], batch["old_logps"][mask], batch["advantages"][mask],
        epsilon_low=s.epsilon, epsilon_high=s.epsilon_high or s.epsilon, beta=s.beta,
        ref_logps=batch["ref_logps"][mask], kl_bias_correction=s.kl_bias_correction,
    )  # fmt: skip
    expected = pg.policy_loss_sums(
        out.losses, batch["seq_index"][mask], 6, loss_type="grpo", max_completion_length=8
    ) / obj.units(batch)
    loss, metrics = obj.loss(policy, batch, obj.units(batch))
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["kl"], out.kl.sum())
    if settings:
        assert not torch.isclose(loss, default.loss(policy, batch, default.units(batch))[0])


@pytest.mark.parametrize("correction", [True, False])
def test_sampling_log_probs_of_another_engine_are_corrected_and_logged(correction):
    """Completions that carry the sampler's log-probs (vLLM) are packed with them; the loss multiplies
    the surrogate by the capped importance weights and logs the trainer/sampler gap, unless
    vllm_importance_sampling_correction is off (then nothing is kept and the loss is uncorrected)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    completions = [[5, 6, 2], [7, 2], [8, 9, 10]]
    logprobs = [[-0.5, -3.0, -0.1], [-9.0, -0.2], [-1.0, float("nan"), -2.0]]
    obj = online_objective(
        tokenizer, completions, logprobs, generation_backend="vllm", vllm_importance_sampling_cap=2.0,
        vllm_importance_sampling_correction=correction,
    )  # fmt: skip
    obj.reference = SimpleNamespace(forward_passes=0)
    (batch,) = obj.rollout(torch.nn.Identity(), [PROMPTS[:1]], step=1)[0]
    if not correction:
        assert "sampling_logps" not in batch
        return
    mask = batch["labels"] != -100
    torch.testing.assert_close(
        batch["sampling_logps"][mask], torch.tensor([x for row in logprobs for x in row]), equal_nan=True
    )
    policy = tiny_llama()
    loss, metrics = obj.loss(policy, batch, obj.units(batch))
    logps = obj._token_logps(policy, batch)[mask].detach()
    sampled = batch["sampling_logps"][mask]
    known = ~torch.isnan(sampled)
    weights = torch.where(known, torch.exp(logps - sampled).clamp(max=2.0), torch.ones_like(logps))
    out = pg.per_token_loss(
        logps.clone().requires_grad_(), logps, batch["advantages"][mask], epsilon_low=0.2, epsilon_high=0.2,
        sampling_weights=weights,
    )  # fmt: skip
    expected = pg.policy_loss_sums(
        out.losses, batch["seq_index"][mask], 3, loss_type="grpo", max_completion_length=8
    )
    torch.testing.assert_close(loss.detach(), expected / 3, rtol=1e-5, atol=1e-6)
    gap = (logps - sampled).abs()[known]
    torch.testing.assert_close(metrics["sampling/logp_gap"] / metrics["count:sampling/logp_gap"], gap.mean())
    assert 0 < float(metrics["sampling/capped"]) < float(metrics["count:sampling/capped"])


def test_rloo_rolls_out_leave_one_out_advantages_with_the_kl_paid_from_the_reward():
    """train.objective rloo: the table row's estimator and section defaults reach the rollout; with beta
    > 0 each completion's summed log(old / ref) is paid out of its reward before the advantages."""
    from transformers import AutoTokenizer

    from finetune.objectives.rollout import completion_sums
    from finetune.recipe.defaults import resolve_defaults

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    digits = [tokenizer(f" {n}", add_special_tokens=False)["input_ids"] for n in (7, 13, 7)]
    section = resolve_defaults({"train": {"objective": "rloo"}, "grpo": {"beta": 0.5}})["grpo"]
    assert section == {"beta": 0.5, "loss_type": "rloo", "scale_rewards": "none", "kl_in_reward": True}
    obj = online_objective(tokenizer, [[*ids, 2] for ids in digits], **section)
    obj.estimator = pg.ESTIMATORS[OBJECTIVES["rloo"].estimator]
    policy = tiny_model(vocab_size=len(tokenizer), initializer_range=0.2)
    shifted = copy.deepcopy(policy)
    with torch.no_grad():
        shifted.lm_head.weight.add_(
            0.5 * torch.randn(shifted.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )

    class Ref:  # the reference model: another set of weights
        forward_passes = 1

        @staticmethod
        def model(model, acc):
            import contextlib

            return contextlib.nullcontext(shifted)

    obj.reference = Ref()
    batches, stats = obj.rollout(policy, [PROMPTS], step=1)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    kl = completion_sums(batches, lambda b: b["old_logps"] - b["ref_logps"])
    assert (kl.abs() > 1e-3).all()
    expected, _ = pg.leave_one_out_advantages(rewards - 0.5 * kl, num_generations=3, scale_rewards="none")
    trained = torch.cat([b["advantages"][b["seq_index"] >= 0] for b in batches])
    lengths = torch.tensor([len(ids) + 1 for ids in digits] * 2)
    torch.testing.assert_close(trained, expected.repeat_interleave(lengths))
    torch.testing.assert_close(torch.tensor(stats["reward_kl_sum"]), kl.sum().double(), check_dtype=False)
    loss, metrics = obj.loss(policy, batches[0], obj.units(batches[0]))
    assert "kl" not in metrics and torch.isfinite(loss)  # the KL is in the reward, not the loss


def test_reinforce_pp_whitens_group_centred_rewards_over_the_trained_tokens():
    """train.objective reinforce_pp: the table row's estimator and defaults reach the rollout; the
    advantages are the group-centred rewards whitened over the trained tokens of the step, the token counts
    read from the packed rows (a truncated completion masked by mask_truncated_completions weighs nothing)."""
    from transformers import AutoTokenizer

    from finetune.recipe.defaults import resolve_defaults

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    digits = [tokenizer(f" {n}", add_special_tokens=False)["input_ids"] for n in (7, 13, 7)]
    section = resolve_defaults({"train": {"objective": "reinforce_pp"}, "grpo": {"beta": 0.0}})["grpo"]
    assert section == {"beta": 0.0, "scale_rewards": "batch", "kl_in_reward": True}
    # the second completion of each group is cut at max_new_tokens (no eos) and masked
    completions = [[*digits[0], 2], digits[1], [*digits[2], 2]]
    obj = online_objective(tokenizer, completions, **section, mask_truncated_completions=True)
    obj.estimator = pg.ESTIMATORS[OBJECTIVES["reinforce_pp"].estimator]
    batches, _ = obj.rollout(torch.nn.Identity(), [PROMPTS], step=1)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    tokens = torch.tensor([len(digits[0]) + 1, 0, len(digits[2]) + 1] * 2, dtype=torch.float32)
    expected, _ = pg.whitened_advantages(rewards, num_generations=3, scale_rewards="batch", tokens=tokens)
    trained = torch.cat([b["advantages"][b["seq_index"] >= 0] for b in batches])
    torch.testing.assert_close(trained, expected.repeat_interleave(tokens.long()))
    # weighing every completion alike (the masked ones too) would give other advantages
    alike, _ = pg.whitened_advantages(rewards, num_generations=3, scale_rewards="batch")
    assert not torch.allclose(alike, expected)


def test_async_rollouts_sample_the_next_step_with_one_step_old_weights():
    """grpo.async_rollouts: the rollout of step n starts the next step's in the background, on the
    policy copy as it is at step n; the update of step n does not reach it (the copy is synced after the
    background rollout has finished); its old log-probs are the sampling copy's. A rollout is used once,
    only for the rows it was made for; any other rows are sampled in step."""
    from transformers import AutoTokenizer

    from finetune.generation.protocol import SamplingParams
    from finetune.generation.transformers_backend import TransformersBackend
    from finetune.objectives.ahead import AheadRollout, MarkedRows
    from finetune.objectives.rollout import completion_seed

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    policy = tiny_model(vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=2, pad_token_id=3)
    obj = online_objective(tokenizer, [[5, 2]], temperature=1.0)
    obj.ahead, obj.backend = AheadRollout(), TransformersBackend(copy.deepcopy(policy), tokenizer)
    obj._waits_logged = 0.0
    obj.model = policy
    obj.accelerator.unwrap_model = lambda m: m
    obj.reference = SimpleNamespace(forward_passes=0)
    rows = [{"input_ids": [1, 5 + k, 6], "row_index": k, "row": '{"q": "x"}'} for k in range(4)]
    marked = MarkedRows(rows)

    def items(now, later):
        return [[marked[k] for k in [*now, -1, *later]]]

    obj.rollout(policy, items([0], [1]), step=1)  # samples row 0 in step, starts row 1 in the background
    before = copy.deepcopy(policy)  # the weights step 2's completions must come from
    with torch.no_grad():  # the update of step 1
        for param in policy.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    obj.after_update(policy)
    made_ahead = obj.ahead.result  # finished: after_update waited for it
    second, _ = obj.rollout(policy, items([1], [2]), step=2)
    assert obj.ahead.key == [2]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, num_return_sequences=3)
    seeds = [[completion_seed(11, 2, 1, j) for j in range(3)]]
    want = TransformersBackend(before, tokenizer).generate([rows[1]["input_ids"]], params, seeds=seeds)[0]
    now = TransformersBackend(policy, tokenizer).generate([rows[1]["input_ids"]], params, seeds=seeds)[0]
    got = [b["input_ids"][0][b["seq_index"][0] == j].tolist() for b in second for j in range(3)]
    assert got == [c.ids for c in want] and got != [c.ids for c in now]  # one step old, not the new weights
    mask = second[0]["labels"] != -100
    with torch.no_grad():
        before.eval()
        old = obj._token_logps(before, second[0])
    torch.testing.assert_close(second[0]["old_logps"][mask], old[mask])
    assert made_ahead is not None and obj.ahead.take([1]) is None  # used once
    obj.after_update(policy)
    third, _ = obj.rollout(policy, items([3], []), step=3)  # rows 3 were not made ahead (2 were): in step
    assert obj.ahead.key is None and len(third) == 1


def test_prompt_rows_a_reward_cannot_score_and_prompts_too_long_for_the_model_are_errors():
    import datasets

    from finetune.errors import FinetuneError
    from finetune.objectives.rollout import check_lengths, check_reward_columns

    specs = GrpoSection(rewards=[{"name": "exact_match", "field_expected": "answer"}]).rewards
    rows = datasets.Dataset.from_dict(
        {"row": ['{"q": "a", "answer": "#### 1"}', '{"q": "b", "answer": null}', '{"q": "c", "answer": ""}'],
         "input_ids": [[1, 2, 3], [1, 2], [1]]}
    )  # fmt: skip
    with pytest.raises(FinetuneError, match=r"2 of 3 prompt rows have no 'answer' .*rows 1, 2\)"):
        check_reward_columns(specs, rows)
    check_reward_columns(specs, rows.select([0]))
    with pytest.raises(FinetuneError, match="no column 'answer'"):
        check_reward_columns(specs, datasets.Dataset.from_dict({"row": ['{"q": "a"}'], "input_ids": [[1]]}))
    check_lengths(rows, 5, 8)  # 3 + 5 fits 8 positions
    with pytest.raises(
        FinetuneError, match=r"longest prompt \(3 tokens\) .* lower max_new_tokens to 5 or less"
    ):
        check_lengths(rows, 6, 8)
