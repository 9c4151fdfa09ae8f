"""`python _spy_chunked_ce.py RECIPE [overrides]`: finetune/train.py with a spy on the chunked loss's
per-chunk functions (the fused Linear path and the checkpointed path). At exit it prints one line,
`CHUNKS {"calls": n, "max_rows": m}`: how many chunks were computed and the most positions in one.
Used by test_eval_chat.py to prove the chunked loss engaged (and stayed off with loss_chunk_size 0)."""

from __future__ import annotations

import atexit
import json
import runpy
import sys
from pathlib import Path

import finetune.losses.chunked_ce as chunked_ce

SEEN = {"calls": 0, "max_rows": 0}


def _spy(name: str, chunk_arg: int) -> None:
    real = getattr(chunked_ce, name)

    def counted(*args):
        SEEN["calls"] += 1
        SEEN["max_rows"] = max(SEEN["max_rows"], args[chunk_arg].shape[0])
        return real(*args)

    # Module globals: the loss looks them up at call time, so the spy sees every chunk.
    setattr(chunked_ce, name, counted)


_spy("_loss_and_logit_grad", 0)  # (h, w, b, labels, ...): a plain Linear head
_spy("_chunk_cross_entropy", 1)  # (head, hidden, labels, ...): any other head (PEFT's wrapped lm_head)
atexit.register(lambda: print("CHUNKS " + json.dumps(SEEN), flush=True))
train = Path(__file__).resolve().parents[2] / "finetune" / "train.py"
sys.argv = [str(train), *sys.argv[1:]]
runpy.run_path(str(train), run_name="__main__")
