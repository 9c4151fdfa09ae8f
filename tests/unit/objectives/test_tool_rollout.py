"""Online RL with tools in the loop: inserted results are packed padding-free but never trained (label
-100, out of the ratio's log-probs), the packed loss and gradients equal the padded layout's, the
rollout logs the tool figures and the calls of its samples, and a reward reads an environment's."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from finetune.losses import policy_gradient as pg
from finetune.losses.preference import token_logps
from finetune.objectives.rollout import pack_completions
from tests.unit.objectives.test_online_objective import (
    PROMPTS,
    VOCAB,
    objective,
    online_objective,
    tiny_llama,
)


def with_tools(n: int = 6, seed: int = 0):
    """Sequences (prompt, completion, finished, advantage) and each completion's own-token mask: a run of
    inserted tokens (a tool's result) in the middle of some completions."""
    rng = random.Random(seed)
    seqs, own = [], []
    for k in range(n):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 4))]
        completion = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 9))]
        mask = [True] * len(completion)
        if k % 2 == 0:  # a result inserted after the model's second token
            mask[2 : 2 + rng.randint(1, 2)] = [False] * 2 if len(completion) > 4 else [False]
            mask = mask[: len(completion)]
        seqs.append((prompt, completion, k % 3 != 2, rng.uniform(-1, 1)))
        own.append(mask if not all(mask) else None)
    return seqs, own


def test_inserted_tokens_stay_in_the_row_with_label_minus_100_and_no_completion_index():
    (batch,) = pack_completions(
        [([1, 2], [3, 4, 5, 6], True, 0.5)], per_batch=1, pad_token_id=0, own=[[True, False, False, True]]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    assert batch["labels"].tolist() == [[-100, -100, 3, -100, -100, 6]]
    assert batch["seq_index"].tolist() == [[-1, -1, 0, -1, -1, 0]]
    assert batch["advantages"].tolist() == [[0.0, 0.0, 0.5, 0.0, 0.0, 0.5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]] and int(batch["completion_tokens"]) == 4


def padded_loss(model, seqs, own, loss_type: str) -> torch.Tensor:
    """The loss of the same completions right-padded one per row (TRL's layout), the inserted tokens
    given label -100 there too."""
    width = max(len(p) + len(c) for p, c, _, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for k, (p, c, _, _) in enumerate(seqs):
        mine = own[k] or [True] * len(c)
        ids[k, : len(p) + len(c)] = torch.tensor(p + c)
        labels[k, len(p) : len(p) + len(c)] = torch.tensor(
            [t if m else -100 for t, m in zip(c, mine, strict=True)]
        )
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


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_packed_completions_with_tool_results_give_the_padded_layouts_loss_and_gradients(loss_type):
    seqs, own = with_tools()
    assert any(m is not None for m in own)
    policy = tiny_llama()
    padded_model = copy.deepcopy(policy)
    obj = objective(loss_type)
    (batch,) = pack_completions(seqs, per_batch=len(seqs), pad_token_id=0, pad_to_multiple_of=16, own=own)
    inserted = sum(m.count(False) for m in own if m is not None)
    assert int((batch["labels"] != -100).sum()) == sum(len(c) for _, c, _, _ in seqs) - inserted
    loss, _ = obj.loss(policy, batch, obj.units(batch))
    loss.backward()
    expected = padded_loss(padded_model, seqs, own, loss_type)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    theirs = {n: p.grad for n, p in padded_model.named_parameters()}
    for name, param in policy.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name], rtol=1e-4, atol=1e-6, msg=name)


class ScriptedRolls:
    """A backend answering the first segment of every completion with 'x [1+1=' (a call) and the next
    with ' ok' + eos."""

    name, processor, copies_weights, stops = "scripted", None, False, (2,)

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, params, *, seeds=None, batch_size=8, images=None, progress=False):
        from finetune.generation.protocol import Completion

        self.calls.append((params.stop_patterns, seeds))
        out = []
        for context in prompts:
            first = not any(t == self.tokenizer.convert_tokens_to_ids("[") for t in context)
            text = "x [1+1=" if first else " ok"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if first else [2])
            out.append([Completion(ids, not first)])
        return out


@pytest.mark.parametrize("name", ["grpo", "rloo"])  # every online objective: one rollout, one tools list
def test_the_rollout_with_an_inline_tool_trains_the_models_tokens_only_and_logs_the_calls(tmp_path, name):
    from finetune.generation.tools import load_tools
    from finetune.recipe.objectives import OBJECTIVES

    (tmp_path / "calc.py").write_text("def add(e):\n    return sum(int(x) for x in e.split('+'))\n")
    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    obj = online_objective(
        tokenizer, [[5, 2]], log_completions=2, loss_type="rloo" if name == "rloo" else "grpo"
    )
    obj.estimator = pg.ESTIMATORS[OBJECTIVES[name].estimator]
    obj.backend = ScriptedRolls(tokenizer)
    obj.accelerator.trackers = []  # the samples' table goes nowhere
    spec = SimpleNamespace(function="calc.py:add", trigger=r"\[([^\]=]*)=", close="]")
    obj.toolbox = load_tools(
        [spec], tokenizer=tokenizer, max_tool_calls=2, timeout_s=5, base=tmp_path, label="grpo"
    )
    obj.settings = obj.settings.model_copy(update={"max_new_tokens": 32})
    try:
        batches, stats = obj.rollout(torch.nn.Identity(), [PROMPTS], step=1)
    finally:
        obj.toolbox.close()
    assert stats["tool_calls_sum"] == 6.0 and stats["tool_errors_sum"] == 0 and stats["tool_seconds"] > 0
    assert "generation_seconds" in stats and stats["completions"] == 6
    assert (
        obj.samples[0]["completion"] == "x [1+1=2] ok" and obj.samples[0]["tool_calls"] == "add(['1+1']) -> 2"
    )
    inserted = tokenizer("2]", add_special_tokens=False)["input_ids"]
    for batch in batches:
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        for start in range(len(ids) - len(inserted) + 1):
            if ids[start : start + len(inserted)] == inserted:
                assert labels[start : start + len(inserted)] == [-100] * len(inserted)
    assert all(patterns == (r"\[([^\]=]*)=",) for patterns, _ in obj.backend.calls)
    _, continuation_seeds = obj.backend.calls[1]
    assert len(continuation_seeds) == 6 and len({s[0] for s in continuation_seeds}) == 6


def test_the_environment_reward_reads_each_completions_environment():
    from finetune.generation.tools import ENVIRONMENT_KEY, ToolCompletion
    from finetune.objectives.rollout import rewards_for, score
    from finetune.recipe.grpo import GrpoSection

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    settings = GrpoSection(environment="env.py:Game")  # no other reward: the environment's counts
    rewards = rewards_for(settings, tokenizer, recipe_path=None)
    assert [r.name for r in rewards] == ["environment"]
    made = [
        ToolCompletion([5, 2], True, None, [1], [], 2.5),
        ToolCompletion([6, 2], True, None, [1], [], -1.0),
    ]
    rows = [{"q": "a"}, {"q": "b"}]
    backend = SimpleNamespace(tokenizer=tokenizer, stops=[2])
    _, _, total = score(rewards, backend, made, rows)
    assert total.tolist() == [2.5, -1.0] and rows[0][ENVIRONMENT_KEY] == 2.5


def test_async_rollouts_run_the_tools_in_the_background_and_checkpoint_the_rollout_made_ahead(tmp_path):
    """grpo.async_rollouts with tools: the next step's rollout runs the tool loop in the background (the
    worker's calls serialized), and what it made (batches, tool figures, logged calls) goes through the
    checkpoint's extra state and gives the same step as a rollout made in step with those weights."""
    from finetune.engine.extra_state import load_extra, save_extra
    from finetune.generation.tools import load_tools
    from finetune.generation.transformers_backend import TransformersBackend
    from finetune.objectives.ahead import AheadRollout, MarkedRows
    from tests.tiny import tiny_model

    (tmp_path / "marks.py").write_text("def mark(vowel):\n    return vowel.upper()\n")
    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    torch.manual_seed(0)
    policy = tiny_model(vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=2, pad_token_id=3)
    obj = online_objective(tokenizer, [[5, 2]], temperature=1.0, log_completions=2)
    obj.settings = obj.settings.model_copy(update={"max_new_tokens": 16})
    obj.ahead, obj.backend = AheadRollout(), TransformersBackend(copy.deepcopy(policy), tokenizer)
    obj._waits_logged = 0.0
    obj.model = policy
    obj.accelerator.unwrap_model = lambda m: m
    obj.accelerator.trackers = []
    obj.reference = SimpleNamespace(forward_passes=0)
    spec = SimpleNamespace(function="marks.py:mark", trigger="([aeiou])", close="|")
    obj.toolbox = load_tools(
        [spec], tokenizer=tokenizer, max_tool_calls=3, timeout_s=5, base=tmp_path, label="grpo"
    )
    rows = [{"input_ids": [1, 5 + k, 6], "row_index": k, "row": '{"q": "x"}'} for k in range(3)]
    marked = MarkedRows(rows)
    try:
        obj.rollout(policy, [[marked[k] for k in (0, -1, 1)]], step=1)  # row 1 made in the background
        saved = tmp_path / "ckpt"
        saved.mkdir()
        save_extra({"rollout_ahead": obj.ahead}, saved)
        resumed = AheadRollout()
        load_extra({"rollout_ahead": resumed}, saved)
        obj.ahead = resumed
        ahead_batches, ahead_stats = obj.rollout(policy, [[marked[k] for k in (1, -1)]], step=2)
        obj.ahead = None  # the same step in step, the same weights
        in_step, stats = obj.rollout(policy, [rows[1:2]], step=2)
    finally:
        obj.toolbox.close()
    assert stats["tool_calls_sum"] > 0 and ahead_stats["tool_calls_sum"] == stats["tool_calls_sum"]
    for a, b in zip(ahead_batches, in_step, strict=True):
        assert (
            a["input_ids"].tolist() == b["input_ids"].tolist()
            and a["labels"].tolist() == b["labels"].tolist()
        )
    assert any((b["labels"] == -100).sum() > 3 for b in in_step)  # the inserted results are not trained
