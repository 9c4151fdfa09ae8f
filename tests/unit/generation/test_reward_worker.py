"""Reward functions in their worker (grpo.reward_timeout_s, finetune.generation.rewards.WorkerReward):
what a function returns or raises there gives the same result or error as in the training process; a
reward that times out (or is stopped by a stop signal) is a counted NaN with a warning naming it, never a
hang; the online rollout trains no advantage on the groups it could not score. The fast tier answers the
worker's requests in this process (tests/tools_in_process.py); the slow tests run the real process."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.errors import FinetuneError
from finetune.generation.rewards import Reward, RewardTimeout, WorkerReward, build_rewards, score_rewards

ROWS = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]

REWARDS_PY = """
import os, sys, time

def good(completions, rows):
    return [float(len(c)) for c in completions]

def numpy_and_torch(completions, rows):
    import numpy as np
    import torch
    return [np.float32(0.5), torch.tensor(2.0)]

def boom(completions, rows):
    raise ZeroDivisionError("division by zero")

def short(completions, rows):
    return [1.0]

def not_a_number(completions, rows):
    return [1.0, "1"]

def a_bool(completions, rows):
    return [True, 0.0]

def nan(completions, rows):
    return [1.0, float("nan")]

def huge(completions, rows):
    return [1e308, 0.0]

def mapping(completions, rows):
    return {0: 1.0, 1: 0.0}

def exits(completions, rows):
    sys.exit(0)

def interrupts(completions, rows):
    raise KeyboardInterrupt

def printing(completions, rows):
    print("a reward that prints")
    return [0.0 for _ in completions]

def hangs(completions, rows):
    while True:
        time.sleep(0.05)

def crashes(completions, rows):
    os._exit(3)
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards")
    (path / "rewards.py").write_text(REWARDS_PY)
    return path


def rewards_of(folder: Path, *names: str, timeout_s: float | None = 5.0) -> list[Reward]:
    specs = [
        SimpleNamespace(model=None, function=f"rewards.py:{n}", label=n, weight=1.0, name=None) for n in names
    ]
    return build_rewards(specs, max_new_tokens=8, count_tokens=len, base=folder, timeout_s=timeout_s)


def test_rewards_run_in_the_worker_with_a_timeout_and_in_process_without(folder):
    worker, here = rewards_of(folder, "good"), rewards_of(folder, "good", timeout_s=None)
    assert isinstance(worker[0].fn, WorkerReward) and not isinstance(here[0].fn, WorkerReward)
    for rewards in (worker, here):
        assert score_rewards(rewards, ["ab", "c"], ROWS).tolist() == [[2.0], [1.0]]
    assert score_rewards(rewards_of(folder, "numpy_and_torch"), ["a", "b"], ROWS).tolist() == [[0.5], [2.0]]


@pytest.mark.parametrize(
    "name, match",
    [
        ("boom", r"reward boom raised ZeroDivisionError: division by zero \(on a batch of 2 completions"),
        ("short", r"reward short returned 1 values for 2 completions"),
        ("not_a_number", r"returned '1' for completion 1"),
        ("a_bool", r"returned True for completion 0"),
        ("nan", r"returned nan for completion 1 \(row \{'question': '2\+2\?'"),
        ("huge", r"returned 1e\+308 for completion 0 .*within \+-1e\+15"),
        ("mapping", r"reward mapping returned a dict, not a list"),
        ("exits", r"reward exits called sys\.exit"),
        ("interrupts", r"reward interrupts raised KeyboardInterrupt"),
    ],
)
def test_a_misbehaving_reward_in_the_worker_stops_with_the_same_error(folder, name, match):
    for timeout_s in (5.0, None):  # in its worker, and in this process: the same words
        with pytest.raises(FinetuneError, match=match):
            score_rewards(rewards_of(folder, name, timeout_s=timeout_s), ["a", "b"], ROWS)


def test_a_stopped_or_timed_out_reward_is_a_counted_nan_with_a_warning_naming_it(folder, capsys):
    rewards = rewards_of(folder, "good") + rewards_of(folder, "printing")  # a worker each
    rewards[1].fn.runner.stop()  # what SIGTERM does (OnlineObjective.on_stop_signal): answers at once
    scores = score_rewards(rewards, ["ab", "c"], ROWS)
    assert scores[:, 0].tolist() == [2.0, 1.0] and scores[:, 1].isnan().all()
    said = capsys.readouterr().err
    assert "warning: reward printing: stopped by the run's stop signal on a batch of 2 completions" in said
    assert "reward_timeout_s" in said


def test_the_rollout_trains_no_advantage_on_groups_a_reward_could_not_score():
    from transformers import AutoTokenizer

    from tests.unit.objectives.test_online_objective import PROMPTS, online_objective

    tokenizer = AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    obj = online_objective(tokenizer, [[5, 2], [5, 6, 2], [5, 6, 7, 2]], log_completions=2)
    obj.accelerator.trackers = []
    calls = []

    def sometimes(completions, rows):  # the second batch scored times out
        calls.append(len(completions))
        if len(calls) == 2:
            raise RewardTimeout("did not answer within 1 s")
        return [float(len(c)) for c in completions]

    obj.rewards = [Reward("sometimes", 1.0, sometimes)]
    batches, stats = obj.rollout(torch.nn.Identity(), [PROMPTS], step=1)
    assert stats["reward_timeouts_sum"] == 0 and any((b["advantages"] != 0).any() for b in batches)
    batches, stats = obj.rollout(torch.nn.Identity(), [PROMPTS], step=2)
    assert stats["reward_timeouts_sum"] == stats["completions"] > 0
    assert all((b["advantages"] == 0).all() for b in batches)  # nothing trains on an unknown reward
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())  # the logs stay numbers


@pytest.mark.slow  # the reward worker is a process
def test_the_worker_stops_a_hung_reward_and_a_stop_signal_ends_a_pending_call_at_once(folder, capfd):
    rewards = rewards_of(folder, "hangs", timeout_s=0.5)
    started = time.monotonic()
    scores = score_rewards(rewards, ["a", "b"], ROWS)
    assert scores.isnan().all() and time.monotonic() - started < 5
    assert score_rewards(rewards_of(folder, "printing"), ["a", "b"], ROWS).tolist() == [[0.0], [0.0]]
    assert "a reward that prints" not in "".join(capfd.readouterr())
    with pytest.raises(FinetuneError, match=r"reward crashes ended its worker process"):
        score_rewards(rewards_of(folder, "crashes"), ["a", "b"], ROWS)
    # A long timeout: stop() from another thread (as from the signal handler) ends the wait.
    import threading

    rewards = rewards_of(folder, "hangs", timeout_s=600)
    threading.Timer(1.0, rewards[0].fn.runner.stop).start()
    started = time.monotonic()
    assert score_rewards(rewards, ["a"], ROWS[:1]).isnan().all()
    assert time.monotonic() - started < 10
