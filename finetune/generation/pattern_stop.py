"""A transformers stopping criterion for inline tool calls: a row stops where its generated text ends
with a trigger's match (finetune.generation.triggers), checked at every token; the others go on.

transformers' own `stop_strings` match fixed strings; a trigger is a regex. The criterion decodes each
running row's new tokens (special tokens kept, as the tool loop decodes them) and records where each
stopped row's trigger matched (`stopped_at`: new tokens kept), so the backend can cut the row there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from transformers import StoppingCriteria

from finetune.generation.triggers import match_at_end


class PatternStop(StoppingCriteria):
    """Stops row r once its text since `start` (the prompt width) ends with a match of `patterns`;
    rows that ended at a stop token (`stops`) are left alone."""

    def __init__(self, tokenizer, patterns: Sequence[re.Pattern], *, start: int, stops: Sequence[int]):
        self.tokenizer, self.patterns, self.start, self.stops = tokenizer, list(patterns), start, set(stops)
        self.stopped_at: dict[int, int] = {}  # row -> new tokens when its trigger matched

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row, ids in enumerate(input_ids[:, self.start :].tolist()):
            if row in self.stopped_at:
                done[row] = True
                continue
            if not ids or any(t in self.stops for t in ids):
                continue
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            before = len(self.tokenizer.decode(ids[:-1], skip_special_tokens=False))
            if match_at_end(self.patterns, text, before) is not None:
                self.stopped_at[row] = len(ids)
                done[row] = True
        return done
