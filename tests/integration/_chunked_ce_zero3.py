"""Run under `accelerate launch --use_deepspeed --zero_stage 3` (one process, CPU): three SGD steps of a
tiny Llama with the model's own loss and with causal_lm_loss, for a tied full fine-tune and for LoRA on
lm_head; prints one JSON line of the losses. Used by test_chunked_ce_zero3.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Run as a script: the repository root (for `tests` and this checkout's `finetune`) goes first on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from peft import LoraConfig, get_peft_model

from finetune.data.batching.collate import collate_rows
from finetune.losses.chunked_ce import causal_lm_loss
from tests.fakes import reset_accelerator_state
from tests.tiny import sequences, tiny_model


def losses(kind: str, chunked: bool) -> list[float]:
    reset_accelerator_state()
    plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    acc = Accelerator(deepspeed_plugin=plugin)
    model = tiny_model(tie_word_embeddings=kind == "full")
    if kind == "lora":
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                            target_modules=["q_proj", "lm_head"])  # fmt: skip
        model = get_peft_model(model, config)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model, optimizer = acc.prepare(model, optimizer)
    batch = collate_rows(sequences(), pad_token_id=0, packed=False)
    num_items = (batch["labels"][:, 1:] != -100).sum()
    out = []
    for _ in range(3):
        if chunked:
            loss = causal_lm_loss(model, batch, num_items=num_items, chunk_size=5)
        else:
            loss = model(**batch, use_cache=False, num_items_in_batch=num_items).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    assert acc.state.deepspeed_plugin.zero_stage == 3
    return out


if __name__ == "__main__":
    result = {
        f"{kind}-{c}": losses(kind, c == "chunked") for kind in ("full", "lora") for c in ("model", "chunked")
    }
    print("RESULT " + json.dumps(result))
