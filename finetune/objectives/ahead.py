"""Asynchronous rollouts (grpo.async_rollouts): step n+1's completions are sampled while step n trains.

How, and what it costs:
* The prompt loader looks one step ahead (`LookaheadBatchSampler`): each loader item holds this step's
  prompt rows and the next step's.
* Generation runs in a background thread on its own copy of the policy (the transformers backend; an
  engine with its own weights, vLLM, uses its engine), so the training step can change the trained
  weights meanwhile. Memory: one more copy of the model's weights (for LoRA, only the trained
  parameters are copied at each sync, but the copy holds the whole model).
* Step n+1's completions are sampled with the weights of step n (one step old: the copy is synced
  after step n-1's update). Their log-probs under that copy (the policy that sampled them) are
  computed in the background too, and the loss takes them as the old log-probs: the clipped ratio
  pi_theta / pi_old of the update corrects the one-step staleness (the PPO correction, exact for
  one step off policy).
* The copy is synced after every update, once the background rollout has finished (`after_update`
  waits for it), so generation overlaps the forward, backward and optimizer step of the step before.
* The pending rollout is checkpointed (tensors and JSON, no pickle): a resumed run trains on the
  completions the interrupted run had sampled, so it is exact. Each step's completions are used once
  and only for the prompts they were sampled for (the rows are checked); the first step of a run and
  of each epoch (whose prompts were not known a step before) samples synchronously.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class LookaheadBatchSampler(torch.utils.data.Sampler):
    """Wraps a batch sampler: each batch is this step's indices, the marker -1, then the next batch's
    (none after the epoch's last batch); `split_lookahead` turns the fetched rows back into the pair.

    >>> list(LookaheadBatchSampler([[0, 1], [2, 3], [4]]))
    [[0, 1, -1, 2, 3], [2, 3, -1, 4], [4, -1]]
    """

    def __init__(self, sampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def dropped_per_epoch(self) -> int:
        return getattr(self.sampler, "dropped_per_epoch", 0)

    def __iter__(self):
        previous = None
        for batch in self.sampler:
            if previous is not None:
                yield [*previous, -1, *batch]
            previous = list(batch)
        if previous is not None:
            yield [*previous, -1]

    def __len__(self) -> int:
        return len(self.sampler)


class MarkedRows(torch.utils.data.Dataset):
    """`rows`, and None at index -1 (the lookahead marker; a datasets.Dataset would give its last row)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return None if index == -1 else self.rows[index]


def split_lookahead(rows: list) -> tuple[list, list]:
    """(this step's rows, the next step's) of a LookaheadBatchSampler batch.

    >>> split_lookahead(["a", "b", None, "c"])
    (['a', 'b'], ['c'])
    """
    cut = next(k for k, row in enumerate(rows) if row is None)
    return rows[:cut], rows[cut + 1 :]


class AheadRollout:
    """The background rollout of the next step's prompts and its checkpointed result.

    `start(rows, step, make)` runs `make(rows, step)` (sample, score and the sampling policy's
    log-probs: it must only read the generation copy) in a thread; `take(rows)` waits and returns its
    result when it was made for exactly `rows`, else None (then the caller rolls out synchronously);
    `wait()` joins a running rollout (before the copy is synced). The result is a dict of tensors and
    JSON-able values, saved in checkpoints (`state_dict`).
    """

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.key: list[int] | None = None
        self.result: dict[str, Any] | None = None
        self.failure: BaseException | None = None
        self.wait_seconds = 0.0

    def start(self, key: list[int], make: Callable[[], dict[str, Any]]) -> None:
        self.wait()
        self.key, self.result, self.failure = list(key), None, None

        def run() -> None:
            try:
                self.result = make()
            except BaseException as exc:  # raised in the training thread by wait()
                self.failure = exc

        self.thread = threading.Thread(target=run, name="finetune-rollout-ahead", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Join the running rollout (a sync point); its error, if it failed, is raised here."""
        if self.thread is not None:
            started = time.perf_counter()
            self.thread.join()
            self.wait_seconds += time.perf_counter() - started
            self.thread = None
        if self.failure is not None:
            failure, self.failure, self.key = self.failure, None, None
            raise failure

    def take(self, key: list[int]) -> dict[str, Any] | None:
        """The rollout made for exactly these prompt rows (once), or None. A rollout made for other rows
        is dropped: the prompts come in the loader's order, so it could never be used (that happens only
        when a step is skipped, train.iterations_to_skip)."""
        self.wait()
        result = self.result if self.key == list(key) else None
        self.key, self.result = None, None
        return result

    def state_dict(self) -> dict:
        self.wait()
        return {"key": self.key, "result": self.result}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.result = state["key"], state["result"]


def copy_trained_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy the parameters that train (requires_grad) from `source` into its copy `target`: the
    frozen ones never change, so the copy keeps them."""
    with torch.no_grad():
        for (name, a), (other, b) in zip(source.named_parameters(), target.named_parameters(), strict=True):
            if name != other:
                raise RuntimeError(
                    f"the generation copy's parameters differ from the model's: {name} != {other}"
                )
            if a.requires_grad:
                b.copy_(a)
