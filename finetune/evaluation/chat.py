"""`finetune chat DIR`: talk to a trained model (an adapter folder, a full model folder, a .gguf or
package:// file), one answer with --prompt or an interactive conversation, streamed as generated.

A vision-language model (model.kind vlm) also takes images: `--image PATH` (repeatable) for the
first message, and `/image PATH` in a conversation to attach one to the next message. Each image
is opened and checked as prepared training rows are (finetune.data.formats.images) before it is used."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from finetune.errors import FinetuneError

HELP = "Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits."
IMAGE_HELP = " /image PATH attaches an image to your next message."


def open_image(path: str, flag: str = "--image"):
    """The RGB PIL image at `path` (relative to the current folder), fully decoded; a FinetuneError
    naming the path when it is missing or not a readable image."""
    from finetune.data.formats import images
    from finetune.data.formats.rows import BadRow

    data = images.load_image(path, flag, Path.cwd(), None, outside_ok=True)  # the user named it: not data
    if isinstance(data, BadRow):
        raise FinetuneError(f"{flag} {path}: {data.detail}. Give the path of a PNG, JPEG or other image file")
    return images.decode(data)


def chat(
    backend,
    *,
    prompt: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 512,
    read: Callable[[str], str] = input,
    out: TextIO | None = None,
    pictures: list[Any] | None = None,
    toolbox=None,
) -> int:
    """One answer to `prompt`, or a conversation read line by line from `read` until /exit or EOF,
    each answer streamed by `backend` (finetune.generation.protocol) as it is generated.

    The whole conversation so far is the prompt of each answer (rendered with the chat template, with
    `system` as the system turn when given, else the template's default). With a vision-language
    model's backend (it has a processor), `pictures` (PIL images) go with the first message, and
    `/image PATH` lines attach images to the next one. With a `toolbox` (finetune.generation.tools) the
    model calls its tools while it answers: each answer is written whole once made (inserted results
    included), each call on a line of its own (`[tool] name(arguments) -> result`).
    """
    from finetune.data.formats.images import SENTINEL
    from finetune.generation.prompts import chat_inputs
    from finetune.generation.protocol import SamplingParams

    processor = backend.processor

    out = out or sys.stdout  # looked up now: a default bound at import would keep a replaced stream
    shown: list[Any] = []  # every image of the conversation so far, in order

    def answer(messages: list[dict[str, Any]]) -> str:
        if toolbox is not None:
            return tool_answer(messages)
        pieces = []
        inputs = chat_inputs(backend.tokenizer, messages, processor=processor, pictures=shown)
        stream = backend.stream(inputs, SamplingParams(max_new_tokens=max_new_tokens))
        for piece in stream:
            out.write(piece)
            out.flush()
            pieces.append(piece)
        out.write("\n")
        out.flush()
        return "".join(pieces).strip()

    def tool_answer(messages: list[dict[str, Any]]) -> str:
        from finetune.generation.tools import answers_with_tools

        (text,), (calls,) = answers_with_tools(backend, [messages], toolbox, max_new_tokens=max_new_tokens)
        for call in calls:
            out.write(f"[tool] {call.name}({call.arguments}) -> {call.result}\n")
        out.write(text + "\n")
        out.flush()
        return text

    def user(text: str, attached: list[Any]) -> dict[str, Any]:
        shown.extend(attached)
        return {"role": "user", "content": SENTINEL * len(attached) + text}

    start = [{"role": "system", "content": system}] if system else []
    pending = list(pictures or [])
    if prompt is not None:
        answer([*start, user(prompt, pending)])
        return 0
    out.write(HELP + (IMAGE_HELP if processor is not None else "") + "\n")
    messages = list(start)
    while True:
        try:
            line = read("> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages, pending = list(start), []
            shown.clear()
            out.write("(new conversation)\n")
            continue
        if line.startswith("/image"):
            pending += _attach(line[len("/image") :].strip(), processor, out)
            continue
        if not line:
            continue
        messages.append(user(line, pending))
        pending = []
        messages.append({"role": "assistant", "content": answer(messages)})


def tool_specs(values: list[str], *, close: str = "") -> list[Any]:
    """`--tool` values as tool specs (finetune.recipe.tools.ToolSpec): `file.py:function` (a chat tool)
    or `file.py:function:TRIGGER` (inline, `close` inserted after each result); the files are looked for
    in the current folder, and checked as `finetune validate` checks a recipe's.

    >>> [(s.function, s.trigger, s.close) for s in tool_specs(["json:loads:<<([^<>=]*)=", "json:dumps"], close=">>")]
    [('json:loads', '<<([^<>=]*)=', '>>'), ('json:dumps', None, None)]
    """
    from pydantic import ValidationError

    from finetune.recipe.tools import ToolSpec, static_problem

    specs = []
    for value in values:
        module, _, rest = value.partition(":")
        function, _, trigger = rest.partition(":")
        try:
            spec = ToolSpec(
                function=f"{module}:{function}",
                trigger=trigger or None,
                close=(close or None) if trigger else None,
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'tool'}: {e['msg']}" for e in exc.errors()
            )
            raise FinetuneError(f"--tool {value}: {problems}; write FILE.py:FUNCTION[:TRIGGER]") from None
        problem = static_problem(spec.function, spec, Path.cwd())
        if problem is not None:
            raise FinetuneError(f"--tool {value}: {problem}")
        specs.append(spec)
    return specs


def _attach(path: str, processor, out: TextIO) -> list[Any]:
    """The image of a `/image PATH` line, or none (with the reason written) when it cannot be used."""
    if processor is None:
        out.write("this model reads text only: /image needs a vision-language model\n")
        return []
    if not path:
        out.write("usage: /image PATH\n")
        return []
    try:
        image = open_image(path, "/image")
    except FinetuneError as exc:
        out.write(f"{exc}\n")
        return []
    out.write(f"(image {path} attached to your next message)\n")
    return [image]
