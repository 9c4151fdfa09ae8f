"""Keep what a run prints to what the user needs: third-party notices that say nothing actionable.

Called by the entry points (`finetune/train.py`, and `finetune` subcommands that load models) before
they import the heavy libraries, so it covers every path (LLM, diffusion, eval, chat, merge). It
imports no heavy library itself: what depends on torch is applied by the modules that import torch. Each
line below names what it silences and why it is safe to; nothing of finetune's own is silenced, and
real errors from these libraries still show.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# transformers' image-processor fallback: without torchvision it uses the PIL processor, which is what
# diffusion pipelines here run on (there is no CPU build of torchvision to install on the machines we
# support); the notice is printed whenever a pipeline loads.
_TORCHVISION_FALLBACK = "requires torchvision (not installed); falling back to"


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


class _DropNewScoreHeadReport(logging.Filter):
    """transformers' load report of a causal LM's checkpoint loaded as a reward model (train.objective
    reward, `finetune eval`'s base): the score head MISSING (new: finetune draws it from train.seed and
    says so) and the language-model head UNEXPECTED (a reward model has none). A report that names any
    other key, or another status, still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        cells = [[c.strip() for c in line.split("|")] for line in message.splitlines() if "|" in line]
        entries = [
            (c[0], c[1]) for c in cells if len(c) > 1 and c[1] not in ("Status", "") and set(c[0]) != {"-"}
        ]
        expected = {("MISSING", "score."), ("UNEXPECTED", "lm_head.")}
        return not entries or not all(
            any(status == s and key.startswith(prefix) for s, prefix in expected) for key, status in entries
        )


def quiet_third_party(cuda_available: bool | None = None) -> None:
    """Silence the third-party notices listed in this module; safe to call more than once.

    >>> quiet_third_party(cuda_available=False)
    >>> logging.getLogger("bitsandbytes.backends.cpu.ops").level == logging.ERROR
    True
    """
    # bitsandbytes (which PEFT and diffusers import whether or not QLoRA is used) tries at import to
    # fetch an optional faster CPU kernel from the Hub (`kernels`) and warns when it cannot; its own
    # kernel is used then, with the same results.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    fallback = logging.getLogger("transformers.utils.import_utils")
    if not any(isinstance(f, _DropMessages) for f in fallback.filters):
        fallback.addFilter(_DropMessages(_TORCHVISION_FALLBACK))
    loading = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, _DropNewScoreHeadReport) for f in loading.filters):
        loading.addFilter(_DropNewScoreHeadReport())
    # PEFT reads `model.is_gradient_checkpointing`, which transformers 5 deprecates (a FutureWarning
    # from inside PEFT; finetune itself calls the non-deprecated activation-checkpointing API).
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )
    if cuda_available is None:
        # Never imported here: this runs first in every entry point, and a command that turns out not
        # to need torch (a prepare-dataset cache hit) would pay seconds for it. Without torch loaded
        # nothing can import DeepSpeed yet; the modules that import torch call this again with it
        # (finetune.model, finetune.engine's make_accelerator).
        torch = sys.modules.get("torch")
        if torch is None:
            return
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        # DeepSpeed (imported by accelerate whenever it is installed, e.g. to unwrap a model on save)
        # would detect the CPU itself and warn that it found no GPU: name it with DeepSpeed's setting.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
