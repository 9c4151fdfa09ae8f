"""The generation-backend protocol: what samples completions, for online RL, evaluation and chat.

A backend owns one generation engine and the copy of the weights it generates with. Everything
that generates asks a backend (finetune.generation.backends.backend_for picks one by name):
the online-RL rollout (sampled completions per prompt, each from its own seed), the held-out
rewards and generation sets (greedy answers), and `finetune chat` (one streamed answer).

* `generate(prompts, params, seeds=..., ...) -> [[Completion]]`: for each prompt (token ids, as
  finetune.generation.prompts renders them) its `params.num_return_sequences` completions, in order.
  Greedy when params.temperature is 0; else completion j of prompt k is drawn with seed
  `seeds[k][j]`, so what a prompt's completions are depends on its seeds only (a resumed run samples
  the same completions, whatever the batching) where the engine honours per-request seeds.
  With `params.stop_patterns` (inline tool triggers), a completion also ends, unfinished, at the first
  token where its text ends with a match (finetune.generation.triggers.match_at_end), so the tool loop
  (finetune.generation.tools) can run the tool and continue it: a backend that cannot stop there
  raises (the vLLM backend, for now: see tools.py for what it would take).
* `stream(inputs, params) -> Iterator[str]`: one greedy answer to a batch of one, in pieces of text.
* `sync_weights(model)`: make the engine generate with `model`'s current weights. The online-RL
  objective calls it from the engine's after-update seam (`Objective.after_update`), after every
  applied optimizer step. A backend that generates with the training model itself (transformers)
  has nothing to copy; an engine with its own copy (vLLM) loads the new weights here.

Attributes: `name` (the recipe's value, for messages), `tokenizer`, `processor` (a vision-language
model's, else None), `stops` (the stop token ids; finetune.generation.prompts.stop_token_ids) and
`copies_weights` (True: the engine holds its own copy of the weights, which `sync_weights` reads whole,
gathered from their shards under ZeRO-3 / FSDP; False: it generates with the training model, whose
weights the caller makes whole for the rollout).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Completion:
    """One generated sequence: its new token ids (cut after the stop token, which is kept), whether it
    ended at a stop token (False: cut at max_new_tokens), and, from an engine with its own copy of the
    weights (vLLM), the log-prob it sampled each token with (None: the training model sampled, so the
    trainer's log-probs are the sampler's)."""

    ids: list[int]
    finished: bool
    logprobs: list[float] | None = None
    # Which ids the model sampled (False: inserted by the tool loop: tool results, tool messages and the
    # template's turns around them, never trained); None: every id is the model's own.
    own: list[bool] | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature 0 is greedy (top_p and top_k unused); num_return_sequences
    completions per prompt.

    >>> SamplingParams(max_new_tokens=8).greedy, SamplingParams(max_new_tokens=8, temperature=0.7).greedy
    (True, False)
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    num_return_sequences: int = 1
    stop_patterns: tuple[str, ...] = ()  # regexes: stop where the text ends with a match (inline tools)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class GenerationBackend(Protocol):
    """See the module docstring."""

    name: str
    tokenizer: Any
    processor: Any
    stops: list[int]
    copies_weights: bool

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[Sequence[int]] | None = None,
        batch_size: int = 8,
        images: Sequence[Sequence[Any]] | None = None,
        progress: bool = False,
    ) -> list[list[Completion]]:
        """Each prompt's completions, in prompt order (see the module docstring)."""

    def stream(self, inputs: Mapping[str, torch.Tensor], params: SamplingParams) -> Iterator[str]:
        """One greedy answer to `inputs` (a batch of one), yielded as text while it is generated."""

    def sync_weights(self, model) -> None:
        """Generate with `model`'s current weights from now on (after every applied update)."""
