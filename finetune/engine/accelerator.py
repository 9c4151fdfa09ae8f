"""The Accelerator of a run: precision, accumulation, trackers and the engine's plugin."""

from __future__ import annotations

from typing import Any

import torch

from finetune.errors import FinetuneError


def make_accelerator(train, *, model_kind: str, qlora: bool, compile_model: bool, lora: bool = False):
    """An Accelerator for the recipe's train section on the engine `accelerate launch` started.

    `model_kind` (model.kind), `qlora` (lora.enable_qlora) and `lora` (lora.enable_lora) feed the same
    refusals `finetune train` makes before launch, for `accelerate launch` users; `compile_model`
    (model.enable_compile) adds the TorchDynamo plugin.
    """
    from finetune.quiet import quiet_third_party

    quiet_third_party(torch.cuda.is_available())  # before accelerate can import DeepSpeed (finetune/quiet.py)
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    from finetune.accelerate_config import setup_from_env
    from finetune.distributed import accelerator_kwargs, check_combination

    if train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise FinetuneError(
            "train.mixed_precision: fp16 with dynamic loss scaling needs a GPU; on CPU use bf16 or no"
        )
    from finetune.trackers import check_available

    check_available(train.report_to)
    engine = setup_from_env()
    check_combination(
        engine, train, model_kind=model_kind, qlora=qlora, cuda_available=torch.cuda.is_available(), lora=lora
    )
    kwargs: dict[str, Any] = accelerator_kwargs(train, engine)
    from finetune.parallel.context import parallelism_config

    # Context parallel: Accelerate's cp_size mesh (FSDP2). Tensor and sequence parallel need none: the
    # model's TP plan and DeepSpeed's Ulysses bring their own (finetune.parallel).
    kwargs["parallelism_config"] = parallelism_config(train, engine.num_processes)
    if compile_model:
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    return Accelerator(
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        log_with=list(train.report_to) or None,
        project_dir=train.output_dir,
        # The loop steps the scheduler once per optimizer step itself (Accelerate would otherwise
        # step it num_processes times per call).
        step_scheduler_with_optimizer=False,
        **kwargs,
    )
