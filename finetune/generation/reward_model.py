"""A trained reward model as an online-RL reward (grpo.rewards[].model): a reward function like the others,
(completions, rows) -> one float per completion, that scores each prompt and completion with the model.

The reward model reads text, not the policy's tokens: each prompt (the row's prompt column, a string or a
list of messages) and its completion are rendered with the reward model's own tokenizer, as its training
rendered its pairs (finetune.data.formats.preference): with its chat template when it has one (the prompt's
turns, then the completion as the assistant's turn), else `[its bos] prompt completion eos`, the prompt and
the completion tokenized apart. So a reward model whose tokenizer differs from the policy's scores the same
texts. `batch_size` completions share one packed row (position_ids restart per sequence), and each is
scored at its last token that is not the pad token, as in training (finetune.losses.reward); a text longer
than the model's positions keeps its end. The model stays on `device` (the rollout's), in eval mode,
without gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.generation.prompts import _prefix_ids


def reward_text_ids(tokenizer, prompt: str | list[dict[str, Any]], completion: str) -> list[int]:
    """The ids the reward model scores for `prompt` (a string: one user turn; or messages) and `completion`,
    rendered with its tokenizer's chat template when it has one, as its training pairs were: with the demo
    tokenizer `<s><|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n4<|im_end|>\\n`; without a
    template `<s>2+2? 4</s>` (the prompt and the completion tokenized apart)."""
    prefix = _prefix_ids(tokenizer)
    if tokenizer.chat_template is None:
        if not isinstance(prompt, str):
            raise ValueError("a prompt of messages needs a chat template to render")
        ids = tokenizer([prompt, completion], add_special_tokens=False)["input_ids"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return [*prefix, *ids[0], *ids[1], *eos]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    text = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": completion}], tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if ids[: len(prefix)] == prefix else [*prefix, *ids]


def reward_model_reward(
    path: str, *, batch_size: int, device, prompt_fields: Sequence[str], where: str
) -> Callable[[list[str], list[dict[str, Any]]], list[float]]:
    """The reward function (finetune.generation.rewards.RewardFn) of the reward model at `path` (loaded now, on `device`: a wrong location or head
    is a FinetuneError starting with `where`, the recipe path). A row's prompt is its first column among
    `prompt_fields` (grpo.rewards[].field_prompt, else the prompt entries' field_prompt)."""
    from finetune.losses.reward import sequence_scores
    from finetune.model.reward import load_reward_model

    model, tokenizer, _ = load_reward_model(path, where=where)
    model.to(device)
    pad_id = model.config.pad_token_id
    # A text longer than the reward model's positions keeps its end (where it is scored), cut from the left.
    longest = getattr(model.config.get_text_config(), "max_position_embeddings", None)

    def prompt_of(row: dict[str, Any]):
        field = next((f for f in prompt_fields if f in row), None)
        if field is None:
            raise FinetuneError(
                f"{where}: the prompt row has none of the columns {', '.join(prompt_fields) or '(none given)'}: "
                f"set {where.rpartition('.')[0]}.field_prompt to the column holding the prompt"
            )
        return row[field]

    def score(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
        sequences = [
            reward_text_ids(tokenizer, prompt_of(row), completion)[-longest if longest else 0 :]
            for completion, row in zip(completions, rows, strict=True)
        ]
        values: list[float] = []
        with torch.no_grad():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start : start + batch_size]
                batch = {
                    "input_ids": torch.tensor([[t for ids in chunk for t in ids]], device=device),
                    "position_ids": torch.tensor(
                        [[p for ids in chunk for p in range(len(ids))]], device=device
                    ),
                }
                scores = sequence_scores(model, batch, torch.tensor([len(chunk)]), pad_token_id=pad_id)
                values += scores.tolist()  # a sync point: the rewards go to the host
        return values

    score.__name__ = where
    return score
