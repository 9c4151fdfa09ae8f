"""`finetune chat DIR`: talk to a trained model (an adapter folder, a full model folder, a .gguf or
package:// file), one answer with --prompt or an interactive conversation, streamed as generated."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

HELP = "Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits."


def chat(
    model,
    tokenizer,
    *,
    prompt: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 512,
    read: Callable[[str], str] = input,
    out: TextIO | None = None,
) -> int:
    """One answer to `prompt`, or a conversation read line by line from `read` until /exit or EOF.

    The whole conversation so far is the prompt of each answer (rendered with the chat template, with
    `system` as the system turn when given, else the template's default).
    """
    from finetune.generation.sampling import stream_chat

    out = out or sys.stdout  # looked up now: a default bound at import would keep a replaced stream

    def answer(messages: list[dict[str, Any]]) -> str:
        pieces = []
        for piece in stream_chat(model, tokenizer, messages, max_new_tokens=max_new_tokens):
            out.write(piece)
            out.flush()
            pieces.append(piece)
        out.write("\n")
        out.flush()
        return "".join(pieces).strip()

    start = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        answer([*start, {"role": "user", "content": prompt}])
        return 0
    out.write(HELP + "\n")
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
            messages = list(start)
            out.write("(new conversation)\n")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": answer(messages)})
