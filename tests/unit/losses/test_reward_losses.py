"""finetune.losses.reward against TRL's RewardTrainer: the same per-sequence scores, loss and gradients
(with and without a margin column and center_rewards_coefficient) from our packed rows (position_ids
restart per sequence, scores read at each sequence's last token) as from TRL's padded batch and
transformers' own pooling; and the pooling rule's corners (a sequence ending in the pad token)."""

from __future__ import annotations

import copy
import random
import tempfile

import datasets
import pytest
import torch

from finetune.data.batching.collate import collate_preference
from finetune.data.batching.pairs import pack_examples
from finetune.losses.reward import bradley_terry_loss, last_tokens, sequence_scores, token_scores
from tests.tiny import TINY_LLAMA

VOCAB, PAD = 64, 0


def tiny_reward_model(seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama with a one-output score head (initializer_range 0.2: scores far apart)."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        **{**TINY_LLAMA, "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64},
        initializer_range=0.2, num_labels=1, pad_token_id=PAD,
    )  # fmt: skip
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def pairs(num: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) sharing a prompt; every third rejected sequence ends in the pad token
    (pad = eos, as TRL's default pad token makes it), which the pooling skips."""
    rng = random.Random(seed)
    out = []
    for k in range(num):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
        chosen = prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))] + [2]
        rejected = prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
        rejected += [PAD] if k % 3 == 2 else [2]
        out.append((chosen, rejected))
    return out


def packed_batch(data, bins, margins=None) -> dict:
    """Our layout: pairs packed into rows (finetune.data.batching.pairs), collated as training collates them."""
    columns = {
        "input_ids": [c + r for c, r in data],
        "labels": [[-100, *c[1:], -100, *r[1:]] for c, r in data],
        "chosen_len": [len(c) for c, _ in data],
    }
    if margins is not None:
        columns["margin"] = margins
    rows = pack_examples(
        datasets.Dataset.from_dict(columns), bins, "preference", pad_to_multiple_of=8, pad_token_id=PAD
    )
    return collate_preference(list(rows), pad_token_id=PAD)


def trl_trainer(model, tmp: str, **options):
    trl = pytest.importorskip("trl", reason="trl is not installed (it is in the test extra)")
    from tests.unit.losses.test_preference_losses import word_tokenizer

    args = trl.RewardConfig(output_dir=tmp, report_to=[], use_cpu=True, seed=0, bf16=False, **options)
    data = datasets.Dataset.from_dict(
        {"chosen_ids": [[1, 3]], "rejected_ids": [[1, 4]]}
    )  # tokenized: no tokenizing
    return trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer())


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "center, with_margin",
    [(None, False), (0.01, False), (None, True), (0.5, True)],
    ids=["plain", "center", "margin", "both"],
)
def test_loss_scores_and_gradients_equal_trls_reward_trainer(center, with_margin):
    data = pairs(6, seed=1)
    margins = [0.5, 0.0, 1.5, -0.25, 2.0, 0.75] if with_margin else None
    model = tiny_reward_model()
    ours_model = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(model, tmp, center_rewards_coefficient=center)
        examples = [{"chosen_ids": c, "rejected_ids": r} for c, r in data]
        if with_margin:
            examples = [e | {"margin": m} for e, m in zip(examples, margins, strict=True)]
        inputs = trainer.data_collator(examples)
        trl_loss, outputs = trainer.compute_loss(trainer.model, dict(inputs), return_outputs=True)
        trl_loss.backward()
        trl_grads = grads(trainer.model)
    trl_scores = outputs.logits.squeeze(-1).detach()

    batch = packed_batch(data, [[0, 1, 2], [3, 4, 5]], margins)
    scores = sequence_scores(ours_model, batch, 2 * batch["num_units"], pad_token_id=PAD)
    loss = bradley_terry_loss(
        scores[0::2], scores[1::2], margin=batch.get("margin"), center_rewards_coefficient=center or 0.0
    ).mean()
    loss.backward()
    # TRL's batch is the chosen sequences, then the rejected ones; ours interleaves them pair by pair.
    torch.testing.assert_close(scores.detach(), torch.stack([trl_scores[:6], trl_scores[6:]], 1).reshape(-1),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-6)
    ours = grads(ours_model)
    assert set(ours) == set(trl_grads)
    for name, value in trl_grads.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_each_sequence_is_scored_at_its_last_non_pad_token_as_transformers_pools_one_text():
    """The score of a sequence in a packed row equals transformers' forward on that sequence alone (its
    pooled logits), also where it ends in the pad token."""
    model = tiny_reward_model().eval()
    data = pairs(3, seed=4)
    batch = packed_batch(data, [[0, 1, 2]])
    with torch.no_grad():
        scores = sequence_scores(model, batch, 2 * batch["num_units"], pad_token_id=PAD)
        alone = [model(input_ids=torch.tensor([ids])).logits.item() for pair in data for ids in pair]
    torch.testing.assert_close(scores, torch.tensor(alone), rtol=1e-5, atol=1e-6)


def test_last_tokens_skip_padding_segments_and_trailing_pad_tokens():
    ids = torch.tensor([[1, 5, 6, 0, 1, 7, 0, 0], [1, 8, 2, 0, 0, 0, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4]])
    index = last_tokens(ids, positions, torch.tensor([2, 1]), pad_token_id=0)
    assert index.tolist() == [2, 5, 10]  # row 0: 6 (the trailing pad skipped), 7; row 1: the 2 at flat 10
    assert last_tokens(ids, positions, torch.tensor([2, 1]), pad_token_id=None).tolist() == [3, 5, 10]
    all_pad = last_tokens(torch.tensor([[0, 0]]), torch.tensor([[0, 1]]), torch.tensor([1]), pad_token_id=0)
    assert all_pad.tolist() == [0]  # transformers' rule for a sequence of pad tokens: its first token


def test_token_scores_refuse_a_model_without_a_score_head():
    from finetune.errors import FinetuneError
    from tests.tiny import tiny_model

    with pytest.raises(FinetuneError, match="no score head"):
        token_scores(tiny_model(), {"input_ids": torch.tensor([[1, 2]])})
