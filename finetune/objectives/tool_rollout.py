"""The online-RL rollout with tools in the loop (grpo.tools, grpo.environment): the parts the online
objective (finetune.objectives.online) uses instead of, or beside, finetune.objectives.rollout's when
the section has tools.

* `toolbox_for`: the section's tools and environment, loaded (finetune.generation.tools.load_tools);
* `sample`: the rollout's completions, each from its `completion_seed`, made by the tool loop: the
  model's own tokens marked (the rollout packs the others with label -100), the prompt each continues,
  its calls; with the step's tool figures (calls, errors, timeouts, and the seconds in tools apart from
  the seconds in generation);
* `prompt_messages`: a prompt row's conversation, which chat tools and environments continue. Chat
  tools' schemas must be in the prompt, and the prepared prompt ids were rendered without them, so the
  rollout renders a chat-tool prompt again from its row (what the template would render at prepare
  time with the schemas; a later data-layer change could do it there, fingerprinted);
* `samples`: the logged samples' tool calls, each with its result as the model read it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError
from finetune.generation.prompts import prompt_ids
from finetune.generation.protocol import GenerationBackend, SamplingParams
from finetune.generation.tools import LoopStats, generate_with_tools, load_tools, tool_fields
from finetune.objectives.rollout import completion_seed


def toolbox_for(settings, tokenizer, *, recipe_path: str | None, section: str = "grpo"):
    """An online section's tools and environment, loaded, or None when it has neither."""
    return load_tools(
        settings.tools,
        tokenizer=tokenizer,
        max_tool_calls=settings.max_tool_calls,
        timeout_s=settings.tool_timeout_s,
        base=Path(recipe_path).parent if recipe_path else None,
        label=section,
        environment=settings.environment,
    )


def message_fields(entries: Sequence[Any], toolbox, *, section: str = "grpo") -> list[str]:
    """The prompt columns of the data entries (field_prompt), which chat tools and environments read a
    row's conversation from; chat tools need prompts rendered with the chat template."""
    if toolbox is None or not (toolbox.chat or toolbox.environment is not None):
        return []
    for i, entry in enumerate(entries):
        if toolbox.chat and not getattr(entry, "apply_chat_template", True):
            raise FinetuneError(
                f"{section}.tools: chat tools are called in the chat template's format, but data.datasets[{i}] "
                "renders its prompts as plain text: set apply_chat_template: true (or give the tools a trigger)"
            )
    return list(dict.fromkeys(e.field_prompt for e in entries if getattr(e, "field_prompt", None)))


def prompt_messages(row: dict, fields: Sequence[str]) -> list[dict]:
    """A prompt row's conversation: its prompt column (the first of `fields` it has) as one user turn, or
    the messages it holds.

    >>> prompt_messages({"question": "2+2?", "answer": "4"}, ["question"])
    [{'role': 'user', 'content': '2+2?'}]
    """
    field = next((f for f in fields if f in row), None)
    if field is None:
        raise FinetuneError(
            f"tools: a prompt row has none of the prompt columns {list(fields)} (columns: {', '.join(row)})"
        )
    value = row[field]
    return [{"role": "user", "content": str(value)}] if not isinstance(value, list) else list(value)


def sample(
    backend: GenerationBackend,
    prompts: Sequence[dict],
    params: SamplingParams,
    *,
    seed: int,
    step: int,
    batch_size: int,
    toolbox,
    fields: Sequence[str] = (),
) -> tuple[list, dict[str, float]]:
    """finetune.objectives.rollout.sample with the tools in the loop (see the module docstring): the
    completions, flat, group after group, and the tool figures (sums: tool_calls_sum, tool_errors_sum,
    tool_timeouts_sum; this process's tool_seconds and generation_seconds)."""
    group = params.num_return_sequences
    seeds = None  # greedy (held-out rewards)
    if not params.greedy:
        seeds = [
            [completion_seed(seed, step, int(row["row_index"]), j) for j in range(group)] for row in prompts
        ]
    rows = [json.loads(row["row"]) for row in prompts]
    conversational = bool(toolbox.chat) or toolbox.environment is not None
    messages = [prompt_messages(row, fields) for row in rows] if conversational else None
    ids = [list(row["input_ids"]) for row in prompts]
    if toolbox.chat:
        ids = [prompt_ids(backend.tokenizer, m, tools=toolbox.schemas) for m in messages]
    stats = LoopStats()
    made = generate_with_tools(
        backend, ids, params, toolbox, seeds=seeds, batch_size=batch_size,
        messages=messages, rows=rows, stats=stats,
    )  # fmt: skip
    flat = [c for row in made for c in row]
    figures = tool_fields(flat)
    figures |= {"tool_seconds": stats.tool_seconds, "generation_seconds": stats.generation_seconds}
    return flat, figures


def completer(backend: GenerationBackend, toolbox, *, batch_size: int, fields: Sequence[str]):
    """The held-out rewards' way to complete prompts with the tools (rollout.eval_rewards' `complete`)."""

    def complete(rows: list[dict], params: SamplingParams):
        return sample(
            backend, rows, params, seed=0, step=0, batch_size=batch_size, toolbox=toolbox, fields=fields
        )

    return complete


def samples(completions: Sequence[Any]) -> list[str]:
    """Each completion's calls as logged beside its text: `name(arguments) -> result`, `; ` between.

    >>> from finetune.generation.tools import ToolCall
    >>> samples([type("C", (), {"calls": [ToolCall("calculate", ["24-17"], "7"), ToolCall("f", {}, "x")]})()])
    ["calculate(['24-17']) -> 7; f({}) -> x"]
    """
    return [
        "; ".join(f"{c.name}({c.arguments}) -> {c.result}" for c in getattr(x, "calls", []))
        for x in completions
    ]
