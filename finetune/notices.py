"""The one way finetune warns: `warning: <what> <what to do>` on one line.

The house rule (docs/CONTRIBUTING.md): what cannot work is an error (FinetuneError); what works but
is probably not what was meant is a warning, said once at the start; what is unusual but fine is
info (logging). Every warning goes through `warn`, so they look alike and tests can find them. In a
training run, pass `emit=accelerator.print` (printed once, by the main process); the prepare step
passes its log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path


def warn(message: str, *, emit: Callable[[str], None] | None = None) -> str:
    """Print `warning: <message>` through `emit` (default: standard error); returns the line.

    >>> warn("save_steps (15) is larger than max_steps (4): no periodic checkpoint", emit=print)
    warning: save_steps (15) is larger than max_steps (4): no periodic checkpoint
    'warning: save_steps (15) is larger than max_steps (4): no periodic checkpoint'
    """
    line = f"warning: {message}"
    if emit is None:
        print(line, file=sys.stderr, flush=True)
    else:
        emit(line)
    return line


def hold_for_test(label: str, seconds: float, *, release: Path | None = None, detail: str = "") -> None:
    """Tests only: say `finetune-<label>: paused` on standard error and wait up to `seconds` (or until
    the file `release` exists), so that a test can act at that very moment (kill the run, start a
    second one). Each caller reads its own environment variable; unset, nothing happens."""
    if seconds <= 0:
        return
    print(f"finetune-{label}: paused{' ' + detail if detail else ''}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (release is not None and release.exists()):
        time.sleep(0.05)
