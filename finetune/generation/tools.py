"""Tools in the loop: the model calls functions while it generates, in online-RL rollouts, generation
sets and `finetune chat` alike.

Two kinds of call (a `Tool` each, loaded by `load_tools` from the recipe's `tools` list):

* **inline**: a `trigger` regex (GSM8K's ``<<([^<>=]*)=``). Generation pauses where the text generated
  so far ends with a match (finetune.generation.triggers, checked at every token by the backend:
  `SamplingParams.stop_patterns`); ``fn(*groups)`` runs and ``str(result) + close`` is inserted; the
  model goes on with the rest of its token budget. Works with any model and template.
* **chat**: no trigger. The model calls it in its chat template's own format (Qwen, Llama 3.1, Mistral:
  finetune.generation.chat_tools); at the end of such a turn the calls are parsed, each function runs
  with the call's arguments, the results go back as ``tool`` messages rendered by the template, and
  generation continues as the next assistant turn. The template gets each function's schema
  (transformers' get_json_schema: its type hints and docstring).

An **environment** (finetune.generation.environments) answers every assistant turn the same way, with
a user message and a reward.

What the loop guarantees:
* only the model's own tokens are trained: everything inserted (results, tool and user messages and the
  template's tokens around them) is marked in the completion (`own`), and the rollout gives it label
  -100; inserted tokens count toward max_new_tokens;
* every call runs in the tool worker (finetune.generation.tool_worker) with `tool_timeout_s`: a hung tool
  is stopped, an exception or arguments the function refuses become an ``error: ...`` result that the
  model reads (counted, never a crash), the tool's prints go nowhere; past `max_tool_calls` per
  completion, a call gets an error result;
* seeds: the first segment of completion j of prompt k is sampled with its seed, each continuation
  (after call c) with `segment_seed(seed, c)`, so a completion depends on its seed only, whatever the
  batching, and a resumed run samples the same completions (with deterministic tools; a tool whose
  result changes from run to run makes the continuations differ from there on, as they would).

Backends: the loop only asks `backend.generate` (finetune.generation.protocol), so any backend that
honours `stop_patterns` and per-request seeds runs it. The transformers backend does (a per-row
stopping criterion). What vLLM would need: stop at a regex (its `stop` strings take literals; a logits
processor or a literal stop at the trigger's last character followed by this regex check would do), the
text to the stop included in the output, and a seed per continuation request (it has `seed`); nothing
else changes, since continuations are new requests on the prompt plus everything so far (vLLM's prefix
cache makes that cheap).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from finetune.errors import FinetuneError
from finetune.generation import tool_worker
from finetune.generation.chat_tools import call_format, call_id, continuation_text, parse_calls, tool_schema
from finetune.generation.functions import load_function
from finetune.generation.protocol import Completion, SamplingParams
from finetune.generation.tool_worker import CallResult, ToolRunner
from finetune.generation.triggers import compile_triggers, match_at_end


@dataclass(frozen=True)
class Tool:
    """A loaded tool: its name (the function's), the recipe's `function` path, the trigger (inline) or
    the JSON schema (chat), and the text inserted after an inline result."""

    name: str
    path: str
    trigger: str | None = None
    close: str = ""
    schema: dict | None = None


@dataclass
class Toolbox:
    """The tools of a run (or of one generation set) and how they run."""

    tools: list[Tool]
    max_tool_calls: int
    runner: ToolRunner
    call_format: str | None = None  # the chat template's tool-call format (chat tools)
    environment: int | None = None  # the runner's function index of the environment factory

    @property
    def inline(self) -> list[Tool]:
        return [t for t in self.tools if t.trigger is not None]

    @property
    def chat(self) -> list[Tool]:
        return [t for t in self.tools if t.trigger is None]

    @property
    def schemas(self) -> list[dict] | None:
        """The chat tools' schemas for the template (None without chat tools)."""
        return [t.schema for t in self.chat] or None

    def close(self) -> None:
        self.runner.close()


def load_tools(
    specs: Sequence[Any],
    *,
    tokenizer,
    max_tool_calls: int,
    timeout_s: float,
    base: Path | None,
    label: str,
    environment: str | None = None,
) -> Toolbox | None:
    """The toolbox of a recipe's `tools` list (each with `function`, `trigger`, `close`) and `environment`
    (a `file.py:Factory` path), None when there are none. Functions are imported as rewards are (beside
    the recipe first: `base`), so a missing file or function fails now, before any model loads; an inline
    tool's signature must take its trigger's groups, a chat tool needs a schema (type hints and
    docstring), and its template a tool-call format finetune reads."""
    if not specs and environment is None:
        return None
    tools = []
    for i, spec in enumerate(specs):
        at = f"{label}.tools[{i}]"
        fn = load_function(spec.function, base=base, what=f"{at}.function", noun="tool")
        name = getattr(fn, "__name__", spec.function.rpartition(":")[2])
        if spec.trigger is not None:
            check_groups(fn, spec.trigger, f"{at}.function")
            tools.append(Tool(name, spec.function, spec.trigger, spec.close or ""))
        else:
            tools.append(Tool(name, spec.function, schema=tool_schema(fn, f"{at}.function")))
    fmt = call_format(tokenizer, f"{label}.tools") if any(t.trigger is None for t in tools) else None
    functions = [(t.path, str(base) if base else None) for t in tools]
    env_index = None
    if environment is not None:
        factory = load_function(environment, base=base, what=f"{label}.environment", noun="environment")
        for method in ("reset", "step"):
            if not callable(getattr(factory, method, None)):
                raise FinetuneError(
                    f"{label}.environment: {environment} has no {method}() method: an environment is a class "
                    "with reset(row) -> first message and step(text) -> (observation, reward, done)"
                )
        env_index = len(functions)
        functions.append((environment, str(base) if base else None))
    runner = tool_worker.ToolRunner(functions, timeout_s=timeout_s)  # looked up now: tests swap it
    return Toolbox(tools, max_tool_calls, runner, call_format=fmt, environment=env_index)


def check_groups(fn, trigger: str, at: str) -> None:
    """`fn` takes the trigger's capture groups as positional arguments, else a FinetuneError.

    >>> check_groups(lambda expression: 0, "<<([^<>=]*)=", "t")
    >>> check_groups(lambda a, b: 0, "<<([^<>=]*)=", "t")
    Traceback (most recent call last):
    ...
    finetune.errors.FinetuneError: t: the trigger '<<([^<>=]*)=' has 1 group, so the tool is called with 1 argument, which its signature (a, b) cannot take
    """
    import re

    groups = re.compile(trigger).groups
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its first call tells
    try:
        signature.bind(*["0"] * groups)
    except TypeError:
        raise FinetuneError(
            f"{at}: the trigger {trigger!r} has {groups} group{'s' * (groups != 1)}, so the tool is called with "
            f"{groups} argument{'s' * (groups != 1)}, which its signature {signature} cannot take"
        ) from None


def segment_seed(seed: int, index: int) -> int:
    """The seed of a completion's segment `index` (0: its own seed; then one per continuation).

    >>> segment_seed(7, 0), segment_seed(7, 1) == segment_seed(7, 1) != segment_seed(7, 2)
    (7, True)
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:tool:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class ToolCall:
    """One call as logged: the tool, its arguments, the result text, and how it went."""

    name: str
    arguments: Any
    result: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ToolCompletion:
    """A completion made with tools: the fields of a protocol Completion (`own` marks the model's own
    ids), the prompt it continues (an environment's first message makes a new one), its calls, and
    the environment's summed reward (None without one)."""

    ids: list[int]
    finished: bool
    own: list[bool] | None
    prompt: list[int]
    calls: list[ToolCall]
    environment_reward: float | None = None
    logprobs: list[float] | None = None


@dataclass
class _Episode:
    """One completion being made: its context, what was generated or inserted, and its conversation."""

    prompt: list[int]
    seed: int | None
    messages: list[dict] | None
    key: str
    ids: list[int] = field(default_factory=list)
    own: list[bool] = field(default_factory=list)
    # the sampler's log-prob of each id (NaN where inserted); None once a segment came without them
    logprobs: list[float] | None = field(default_factory=list)
    segment: int = 0  # continuations so far
    segment_start: int = 0  # where the model's current segment starts in ids
    turn_start: int = 0  # where the current assistant turn starts in ids
    calls: list[ToolCall] = field(default_factory=list)
    finished: bool = False
    done: bool = False
    reward: float | None = None  # the environment's rewards so far (None: no environment)
    turns: int = 0
    row: dict | None = None  # the data row the environment was reset with
    texts: list[str] = field(default_factory=list)  # the turns it answered (replayed after a restart)
    worker: int = 0  # the worker start that holds its environment


@dataclass
class LoopStats:
    """Wall time in the backend's generate calls and in tool calls (a rollout logs both)."""

    generation_seconds: float = 0.0
    tool_seconds: float = 0.0


def generate_with_tools(
    backend,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    toolbox: Toolbox,
    *,
    seeds: Sequence[Sequence[int]] | None = None,
    batch_size: int = 8,
    messages: Sequence[list[dict] | None] | None = None,
    rows: Sequence[dict] | None = None,
    progress: bool = False,
    stats: LoopStats | None = None,
) -> list[list[ToolCompletion]]:
    """For each prompt its `params.num_return_sequences` completions, made with the toolbox's tools (see
    the module docstring). `messages[k]` is prompt k's conversation (chat tools and environments render
    what follows a turn with it), `rows[k]` its data row (an environment's reset reads it). Calls go in
    rounds: every unfinished completion generates its next segment in one backend call (`batch_size`
    prompts' completions at a time), then its calls run."""
    n = params.num_return_sequences
    if not params.greedy and (seeds is None or any(len(s) != n for s in seeds)):
        raise ValueError("sampling needs one seed per completion: seeds[k] holds num_return_sequences seeds")
    stats = stats if stats is not None else LoopStats()
    episodes = [
        _Episode(
            list(prompt),
            None if params.greedy else int(seeds[k][j]),
            list(messages[k]) if messages is not None and messages[k] is not None else None,
            key=f"{k}:{j}:{time.monotonic_ns()}",
        )
        for k, prompt in enumerate(prompts)
        for j in range(n)
    ]
    if toolbox.environment is not None:
        for e, k in zip(episodes, [k for k in range(len(prompts)) for _ in range(n)], strict=True):
            _reset(e, toolbox, backend.tokenizer, rows[k] if rows is not None else {}, stats)
    triggers = tuple(t.trigger for t in toolbox.inline)
    while active := [e for e in episodes if not e.done]:
        budget = max(params.max_new_tokens - len(e.ids) for e in active)
        segment = SamplingParams(
            max_new_tokens=budget, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            stop_patterns=triggers,
        )  # fmt: skip
        started = time.perf_counter()
        made = backend.generate(
            [e.prompt + e.ids for e in active],
            segment,
            seeds=None if params.greedy else [[segment_seed(e.seed, e.segment)] for e in active],
            batch_size=batch_size * n,
            progress=progress,
        )
        stats.generation_seconds += time.perf_counter() - started
        for e, (completion,) in zip(active, made, strict=True):
            _advance(e, completion, params.max_new_tokens, toolbox, backend, stats)
    if toolbox.environment is not None:
        for e in episodes:
            toolbox.runner.request({"op": "env_close", "episode": e.key})
    out = [
        ToolCompletion(
            e.ids, e.finished, e.own if not all(e.own) else None, e.prompt, e.calls, e.reward, e.logprobs
        )
        for e in episodes
    ]
    return [out[k * n : (k + 1) * n] for k in range(len(prompts))]


def continuation_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` where it continues a sequence. SentencePiece tokenizers (Llama 2, Mistral) put a
    space before a text that starts an input, so `7>>` alone would read ` 7>>` after `<<24-17=`: the text
    is tokenized after a newline, whose ids are then dropped (when they are a prefix of the result; else
    it is tokenized alone, as byte-level tokenizers need).

    >>> tok = __import__("transformers").AutoTokenizer.from_pretrained("recipes/demo/tokenizer")
    >>> tok.decode(tok("<<24-17=", add_special_tokens=False)["input_ids"] + continuation_ids(tok, "7>>"))
    '<<24-17=7>>'
    """
    marker = tokenizer("\n", add_special_tokens=False)["input_ids"]
    joined = tokenizer("\n" + text, add_special_tokens=False)["input_ids"]
    if marker and joined[: len(marker)] == marker:
        return joined[len(marker) :]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _insert(e: _Episode, ids: list[int], limit: int) -> bool:
    """Append inserted (not trained) ids within the budget; False when the budget ran out (the
    completion ends there, cut)."""
    room = limit - len(e.ids)
    e.ids += ids[:room]
    e.own += [False] * min(len(ids), room)
    if e.logprobs is not None:
        e.logprobs += [math.nan] * min(len(ids), room)
    e.segment_start = len(e.ids)
    if len(ids) >= room:
        e.done, e.finished = True, False
        return False
    return True


def _advance(e: _Episode, c: Completion, limit: int, toolbox: Toolbox, backend, stats: LoopStats) -> None:
    """Take one generated segment: keep the model's ids (within the budget), then run the inline call it
    stopped at, or the chat calls / environment step of the turn it ended, or end the completion."""
    room = limit - len(e.ids)
    e.ids += list(c.ids[:room])
    e.own += [True] * min(len(c.ids), room)
    e.logprobs = None if e.logprobs is None or c.logprobs is None else e.logprobs + list(c.logprobs[:room])
    e.segment += 1
    if len(c.ids) > room:  # out of budget
        e.done, e.finished = True, False
    elif c.finished and (toolbox.chat or toolbox.environment is not None):
        _turn_end(e, limit, toolbox, backend, stats)
    elif c.finished:
        e.done, e.finished = True, True
    elif (found := _inline_match(e, toolbox, backend)) is not None:
        _inline_call(e, found, limit, toolbox, backend, stats)
    else:  # stopped at the budget, without a stop token or a trigger
        e.done, e.finished = True, False


def _inline_match(e: _Episode, toolbox: Toolbox, backend):
    """(tool, match, text) where the current segment ends with a trigger's match, else None."""
    if not toolbox.inline:
        return None
    tokenizer, segment = backend.tokenizer, e.ids[e.segment_start :]
    if not segment:
        return None
    text = tokenizer.decode(segment, skip_special_tokens=False)
    before = len(tokenizer.decode(segment[:-1], skip_special_tokens=False))
    found = match_at_end(compile_triggers([t.trigger for t in toolbox.inline]), text, before)
    if found is None:
        return None
    return toolbox.inline[found[0]], found[1], text, before


def _inline_call(e: _Episode, found, limit: int, toolbox: Toolbox, backend, stats: LoopStats) -> None:
    """Run an inline call and insert `str(result) + close`. A match that ends inside the last token
    (the model wrote `=7` as one token) drops that token: the text up to the match's end is inserted
    in its place, not trained, so the result follows the trigger exactly."""
    tool, match, text, before = found
    tokenizer = backend.tokenizer
    inserted = ""
    if match.end() < len(text):
        e.ids.pop()
        e.own.pop()
        if e.logprobs is not None:
            e.logprobs.pop()
        inserted = text[before : match.end()]
    result = _run(e, toolbox, tool, {"op": "call", "args": list(match.groups())}, stats)
    inserted += result.text + tool.close
    _insert(e, continuation_ids(tokenizer, inserted), limit)


def _run(e: _Episode, toolbox: Toolbox, tool: Tool, request: dict, stats: LoopStats) -> CallResult:
    """One call through the worker, or the error result past max_tool_calls; recorded on the episode."""
    arguments = request.get("args", request.get("kwargs"))
    if len(e.calls) >= toolbox.max_tool_calls:
        result = CallResult(
            f"error: no more tool calls (max_tool_calls {toolbox.max_tool_calls})", error=True
        )
    else:
        result = toolbox.runner.request({**request, "fn": toolbox.tools.index(tool)})
    stats.tool_seconds += result.seconds
    e.calls.append(ToolCall(tool.name, arguments, result.text, result.error, result.timeout, result.seconds))
    return result


def _turn_end(e: _Episode, limit: int, toolbox: Toolbox, backend, stats: LoopStats) -> None:
    """An assistant turn ended at its stop token: its chat tool calls run and their results follow as
    tool messages, or the environment answers it; either way the next assistant turn starts. A turn with
    neither ends the completion."""
    tokenizer = backend.tokenizer
    turn = e.ids[e.turn_start : -1]
    stop_texts = [tokenizer.decode([t], skip_special_tokens=False) for t in backend.stops]
    raw = tokenizer.decode(turn, skip_special_tokens=False)
    calls = None
    if toolbox.chat:
        prefix = tokenizer.decode(e.prompt + e.ids[: e.turn_start], skip_special_tokens=False)
        content, calls, problem = parse_calls(
            raw, toolbox.call_format, tokenizer=tokenizer, prefix=prefix, tools=toolbox.schemas
        )
        if problem is not None:  # the model tried to call but wrote no call: an error, and the end
            e.calls.append(ToolCall("?", raw[-200:], f"error: {problem}", error=True))
            e.done, e.finished = True, True
            return
    if calls:
        assistant, answer = _chat_calls(e, content, calls, toolbox, stats)
    elif toolbox.environment is not None and e.reward is not None:
        text = tokenizer.decode(turn, skip_special_tokens=True).strip()
        assistant = {"role": "assistant", "content": text}
        result = _step(e, toolbox, text, stats)
        if result is None:
            return
        answer = [{"role": "user", "content": result}]
    else:
        e.done, e.finished = True, True
        return
    try:
        following = continuation_text(
            tokenizer, [*(e.messages or []), assistant], answer, tools=toolbox.schemas, stop_texts=stop_texts
        )
    except TemplateError as exc:  # the template refuses what the model wrote (Mistral: a call id not 9 long)
        e.calls.append(
            ToolCall("?", raw[-200:], f"error: the chat template refused the turn: {exc}", error=True)
        )
        e.done, e.finished = True, True
        return
    e.messages = [*(e.messages or []), assistant, *answer]
    if _insert(e, continuation_ids(tokenizer, following), limit):
        e.turn_start = len(e.ids)


def _chat_calls(e: _Episode, content: str, calls: list[dict], toolbox: Toolbox, stats: LoopStats):
    """Run a turn's chat calls: (the assistant message with its calls, the tool messages answering them)."""
    by_name = {t.name: t for t in toolbox.chat}
    answers = []
    for call in calls:
        call.setdefault("id", call_id(len(e.calls) + 1))
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        tool = by_name.get(name)
        if tool is None:
            text = f"error: no tool named {name!r} (tools: {', '.join(by_name)})"
            e.calls.append(ToolCall(name, arguments, text, error=True))
        else:
            text = _run(e, toolbox, tool, {"op": "call", "kwargs": arguments}, stats).text
        answers.append({"role": "tool", "name": name, "tool_call_id": call["id"], "content": text})
    return {"role": "assistant", "content": content, "tool_calls": calls}, answers


def _reset(e: _Episode, toolbox: Toolbox, tokenizer, row: dict, stats: LoopStats) -> None:
    """Start an episode's environment: its first message becomes the prompt (one user turn, with the
    chat tools' schemas); no first message keeps the row's own prompt."""
    from finetune.generation.prompts import prompt_ids

    e.row = json.loads(json.dumps(row, default=str))
    result = toolbox.runner.request(
        {"op": "env_reset", "fn": toolbox.environment, "episode": e.key, "row": e.row}
    )
    e.worker = toolbox.runner.generation
    stats.tool_seconds += result.seconds
    if result.error or result.timeout:
        raise FinetuneError(f"environment reset failed on row {str(row)[:160]}: {result.text}")
    e.reward = 0.0
    if result.text:
        e.messages = [{"role": "user", "content": result.text}]
        e.prompt = prompt_ids(tokenizer, e.messages, tools=toolbox.schemas)


def _step(e: _Episode, toolbox: Toolbox, text: str, stats: LoopStats) -> str | None:
    """The environment's answer to a turn (its observation), None when the episode is over (done, a
    failed step, or max_tool_calls turns answered); the rewards add up. An environment lost with a
    restarted worker (another episode's step timed out) is rebuilt first: its reset and steps replayed."""
    runner = toolbox.runner
    if runner.started() != e.worker:
        _replay(e, toolbox)
    e.turns += 1
    e.texts.append(text)
    result = runner.request({"op": "env_step", "episode": e.key, "text": text})
    stats.tool_seconds += result.seconds
    e.calls.append(
        ToolCall("environment", text[-200:], result.text, result.error, result.timeout, result.seconds)
    )
    if result.error or result.timeout:
        e.done, e.finished = True, True
        return None
    reward, done = result.value
    e.reward += reward
    if done or e.turns >= toolbox.max_tool_calls:
        e.done, e.finished = True, True
        return None
    return result.text


def _replay(e: _Episode, toolbox: Toolbox) -> None:
    """Rebuild an episode's environment in a new worker: its reset and its steps so far, again."""
    runner = toolbox.runner
    runner.request({"op": "env_reset", "fn": toolbox.environment, "episode": e.key, "row": e.row})
    for text in e.texts:
        runner.request({"op": "env_step", "episode": e.key, "text": text})
    e.worker = runner.generation


def completion_text(tokenizer, completion, *, stops: Sequence[int]) -> str:
    """The text rewards and samples see: a plain completion cut at its first stop token; one made with
    tools, every turn up to its final stop token (inserted results included), special tokens removed.

    >>> from types import SimpleNamespace as NS
    >>> tok = NS(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    >>> completion_text(tok, NS(ids=[5, 6, 2, 7], own=None), stops=[2]), completion_text(tok, NS(ids=[5, 2, 7, 2], own=[True, True, False, True]), stops=[2])
    ('5 6', '5 2 7')
    """
    ids = list(completion.ids)
    if getattr(completion, "own", None) is None:
        end = next((k for k, t in enumerate(ids) if t in stops), len(ids))
    else:
        end = len(ids) - 1 if ids and ids[-1] in stops else len(ids)
    return tokenizer.decode(ids[:end], skip_special_tokens=True).strip()


def tool_fields(completions: Sequence[Any]) -> dict[str, float]:
    """Sums over completions made with tools: calls, errors, timeouts (each rollout adds them up).

    >>> tool_fields([ToolCompletion([1], True, None, [0], [ToolCall("f", [], "1"), ToolCall("f", [], "error: x", error=True)])])
    {'tool_calls_sum': 2.0, 'tool_errors_sum': 1.0, 'tool_timeouts_sum': 0.0}
    """
    calls = [call for c in completions for call in getattr(c, "calls", [])]
    return {
        "tool_calls_sum": float(len(calls)),
        "tool_errors_sum": float(sum(c.error for c in calls)),
        "tool_timeouts_sum": float(sum(c.timeout for c in calls)),
    }


ENVIRONMENT_KEY = "_environment_reward"  # where a completion's data row carries its environment's reward


def with_environment_rewards(rows: list[dict], completions: Sequence[Any]) -> None:
    """Put each completion's environment reward in its data row (rows[k] answers completions[k]), where
    the reward `environment` reads it; completions without one leave their row as it is."""
    for row, completion in zip(rows, completions, strict=True):
        reward = getattr(completion, "environment_reward", None)
        if reward is not None:
            row[ENVIRONMENT_KEY] = reward


def environment_reward(completions: list[str], rows: list[dict]) -> list[float]:
    """The reward `environment`: the sum of the rewards an environment gave each completion's turns.

    >>> environment_reward(["a", "b"], [{ENVIRONMENT_KEY: 1.0}, {ENVIRONMENT_KEY: -0.5}])
    [1.0, -0.5]
    """
    return [float(row[ENVIRONMENT_KEY]) for row in rows]


def answers_with_tools(
    backend,
    prompts: Sequence[Any],
    toolbox: Toolbox,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    use_chat_template: bool = True,
    progress: bool = False,
) -> tuple[list[str], list[list[ToolCall]]]:
    """Greedy answers to `prompts` (strings or message lists, finetune.generation.backends.answers' kind)
    with the toolbox's tools in the loop: (each answer's text, inserted results included; its calls)."""
    from finetune.generation.prompts import prompt_ids

    conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else list(p) for p in prompts]
    if not use_chat_template:
        ids = [prompt_ids(backend.tokenizer, p, use_chat_template=False) for p in prompts]
    else:
        ids = [prompt_ids(backend.tokenizer, m, tools=toolbox.schemas) for m in conversations]
    made = generate_with_tools(
        backend, ids, SamplingParams(max_new_tokens=max_new_tokens), toolbox, batch_size=batch_size,
        messages=conversations if use_chat_template else None, progress=progress,
    )  # fmt: skip
    texts = [completion_text(backend.tokenizer, c[0], stops=backend.stops) for c in made]
    return texts, [c[0].calls for c in made]
