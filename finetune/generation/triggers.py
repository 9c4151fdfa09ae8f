"""Inline tool calls: where a trigger matches at the end of generated text.

A trigger is a regex such as GSM8K's ``<<([^<>=]*)=``; generation pauses where the text generated so
far ends with a match. Text grows a token at a time and a token may hold several characters, so a
match may end anywhere inside the last token: `match_at_end` looks for the earliest match ending there
(its end past the text before the token). The transformers backend's stopping criterion
(finetune.generation.pattern_stop) and the tool loop (finetune.generation.tools) both ask it, so they
agree on every call.

>>> patterns = compile_triggers(["<<([^<>=]*)="])
>>> match_at_end(patterns, "Sam has <<24-17=", 15)[1].groups()
('24-17',)
>>> match_at_end(patterns, "Sam has <<24-17=7", 15)[1].end()  # "=7" was one token: the match ends inside it
16
>>> match_at_end(patterns, "Sam has <<24-17", 13) is None
True
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def compile_triggers(triggers: Sequence[str]) -> list[re.Pattern]:
    """Each trigger anchored at the end of the text it is tried on."""
    return [re.compile(f"(?:{t})\\Z", re.DOTALL) for t in triggers]


def match_at_end(patterns: Sequence[re.Pattern], text: str, before: int) -> tuple[int, re.Match] | None:
    """(which pattern, its match) for the earliest match ending after `before` (the length of the text
    before the last token) and at most at the end of `text`; None when no pattern matches there."""
    for end in range(max(before, 0) + 1, len(text) + 1):
        for index, pattern in enumerate(patterns):
            found = pattern.search(text, 0, end)
            if found is not None:
                return index, found
    return None
