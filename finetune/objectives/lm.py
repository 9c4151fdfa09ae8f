"""The causal-LM toolkit every LM objective shares (SFT, preference, GRPO, and the next ones).

* `start` / `finish_build` / `evaluate_lm`: the attributes an LM objective starts with, the end of
  its build (generation sets, trainable-only checkpoints, the evaluation cadence), and its
  evaluation (its held-out metrics plus the generation sets);

* `build_lm`: the model to train (pretrained or random-init, LoRA / QLoRA, fp32 trainable weights
  under fp16) and its parameter counts for FLOPs;
* `make_loader`: a loader of prepared rows with the recipe's loader settings (training: this rank's
  share, shuffled per epoch; evaluation: every row in order), also used by `finetune eval`;
* `checkpoint_trainable_only`: LoRA checkpoints that hold the trained tensors, not the frozen base;
* `check_batches`, `throughput_fields`: the batch check and tokens/s, TFLOP/s and MFU;
* `save_final_lm` / `save_lm`: the final adapter or model in Hugging Face format with the tokenizer
  and model card, merging sharded weights where asked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from finetune.checkpoint import write_checksums
from finetune.data.batching.loader import make_dataloader
from finetune.errors import FinetuneError
from finetune.metrics import device_peak_flops, forward_flops_per_token, model_flops_per_token
from finetune.parallel.sizes import size_of


def start(objective, recipe) -> None:
    """Give an LM objective the recipe's parts and the attributes the engine reads, empty until
    `build`; refuse an attention backend that cannot run here before anything is prepared."""
    from finetune.model.build import check_attention_backend

    check_attention_backend(recipe.model.attn_implementation)
    # The objective is built by the entry point from the whole recipe and keeps only its parts.
    objective.recipe = recipe
    objective.model_settings, objective.lora, objective.data = recipe.model, recipe.lora, recipe.data
    objective.train, objective.eval_settings = recipe.train, recipe.eval
    objective.accelerator = objective.tokenizer = objective.eval_loader = None
    objective.manifest, objective.flops, objective.generation_rows = {}, {}, {}
    objective.can_evaluate, objective.eval_every = False, None


def finish_build(objective, accelerator, *, held_out: bool) -> None:
    """The end of an LM objective's build: the generation sets scored during training, LoRA
    checkpoints of the trained tensors only, and whether (and how often) it evaluates."""
    from finetune.generation.sets import training_generation_rows

    objective.generation_rows = training_generation_rows(
        objective.eval_settings,
        accelerator,
        vision=objective.model_settings.kind == "vlm",
        image_max_pixels=objective.data.image_max_pixels,
        images_outside=objective.data.allow_image_paths_outside,
    )
    # Checkpoints hold the adapters, not the frozen base (a TP run's hold its shards: finetune.parallel).
    if objective.lora.enable_lora and size_of(objective.train, "tensor") <= 1:
        checkpoint_trainable_only(accelerator)
    objective.can_evaluate = held_out or bool(objective.generation_rows)
    objective.eval_every = objective.train.eval_steps if objective.can_evaluate else None


def evaluate_lm(objective, model, step: int, held_out=None) -> dict[str, Any]:
    """`held_out(model, step)`'s metrics (the objective's held-out split, when it has one) and the
    eval.generation_sets' scores and samples."""
    from finetune.generation.sets import generation_metrics

    metrics: dict[str, Any] = held_out(model, step) if held_out is not None else {}
    if objective.generation_rows:
        rows, settings = objective.generation_rows, objective.eval_settings
        # A vision-language objective's processor (SFT's) turns the sets' images into pixels.
        processor = getattr(objective, "processor", None)
        metrics.update(
            generation_metrics(
                objective.accelerator,
                model,
                objective.tokenizer,
                settings,
                rows,
                step=step,
                processor=processor,
                base=recipe_folder(objective),
            )
        )
    return metrics


def recipe_folder(objective) -> Path | None:
    """The folder of the objective's recipe file, where a generation set's tool files are looked up first."""
    path = getattr(getattr(objective, "recipe", None), "source_path", None)
    return Path(path).parent if path else None


def with_row_index(rows):
    """Prepared rows with their index in the split as a `row_index` column (precomputed reference
    log-probs are looked up by it; online RL seeds a prompt's completions with it)."""
    return rows if "row_index" in rows.column_names else rows.add_column("row_index", list(range(len(rows))))


def build_lm(
    model_settings, lora, train, tokenizer, accelerator, processor=None, init_loader=None, head="lm"
) -> tuple[Any, dict[str, Any]]:
    """(the causal LM to train, not yet prepared; its parameter counts for FLOPs): pretrained or
    random-init weights, LoRA / QLoRA adapters (a random-init base is saved with the tokenizer, or a
    vision-language model's `processor`, to output_dir/base_model, so the adapter can be loaded later),
    fp32 trainable weights under fp16. A vision-language model's LoRA targets its language model
    (finetune.model.vlm.lora_settings). `init_loader()` makes a fresh loader of this process's training
    batches, which EVA and CorDA (lora.init_lora_weights) compute their init from. `head` score builds a
    reward model (one score per token, finetune.model.build), its LoRA of PEFT's task type SEQ_CLS."""
    from finetune.gguf.convert import resolve_model_source
    from finetune.gguf.names import portable_base
    from finetune.model.adapters import (
        apply_lora,
        enable_neftune,
        init_modifies_base,
        save_initial_adapter,
        upcast_trainable_to_fp32,
    )
    from finetune.model.build import build_model, count_parameters, pad_token_id, save_base_model
    from finetune.parallel.tensor import check_adapter_layers, check_lora_plan, distributed_config

    output_dir = Path(train.output_dir)
    model_settings = _splittable(model_settings, lora, train, tokenizer, accelerator, processor)
    model = build_model(
        model_settings,
        lora,
        mixed_precision=train.mixed_precision,
        vocab_size=len(tokenizer),
        gradient_checkpointing=train.gradient_checkpointing,
        head=head,
        pad_token_id=pad_token_id(tokenizer),
        seed=train.seed,
        distributed_config=distributed_config(train, accelerator.num_processes),
    )
    if lora.enable_lora:
        base_dir = None
        if model_settings.model_path is None:
            base_dir = output_dir / "base_model"
            save_base_model(model, base_dir, is_main_process=accelerator.is_main_process)
            if accelerator.is_main_process:  # so the base alone loads for eval and chat
                (processor or tokenizer).save_pretrained(base_dir)
                write_checksums(base_dir)  # verified when eval, chat or merge-lora load the adapter's base
        base = (
            str(base_dir.resolve())
            if base_dir is not None
            else portable_base(model_settings.model_path, model_settings.gguf_file, model_settings.revision)
            or resolve_model_source(model_settings).model_path
        )
        targets = {}
        if model_settings.kind == "vlm":
            from finetune.model.vlm import lora_settings

            targets = lora_settings(
                model,
                lora.lora_target_modules,
                lora.modules_to_save,
                train_vision_tower=model_settings.train_vision_tower,
                train_projector=model_settings.train_projector,
            )
        if size_of(train, "tensor") > 1:
            check_lora_plan(model, lora.modules_to_save)
        model = apply_lora(
            model,
            lora,
            gradient_checkpointing=train.gradient_checkpointing,
            base=base,
            init_data=_init_data(lora, train, tokenizer, accelerator, init_loader, model),
            task_type="SEQ_CLS" if head == "score" else "CAUSAL_LM",
            **targets,
        )
        if base_dir is not None:
            model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
        if size_of(train, "tensor") > 1:
            check_adapter_layers(model)
        # PiSSA / OLoRA / CorDA (also on resume: PiSSA and OLoRA are seeded, CorDA loads its saved init)
        if init_modifies_base(model):
            save_initial_adapter(
                model, output_dir / INITIAL_ADAPTER, is_main_process=accelerator.is_main_process
            )
    if model_settings.kind == "vlm":
        from finetune.model.vlm import release_frozen_towers, scale_out_settings

        if train.gradient_checkpointing:  # after PEFT, which hooks the input embeddings again
            release_frozen_towers(model)
        scale_out_settings(model, accelerator)
    if train.neftune_noise_alpha is not None:
        enable_neftune(model, train.neftune_noise_alpha)
    if train.mixed_precision == "fp16":
        upcast_trainable_to_fp32(model)
    trainable, total = count_parameters(model)
    accelerator.print(f"parameters: {trainable:,} trainable / {total:,} total")
    return model, {"num_params": total, "num_trainable": trainable}


def _splittable(model_settings, lora, train, tokenizer, accelerator, processor):
    """The model section to build, after the checks of its splits (finetune.parallel.sizes). Tensor
    parallel loads pretrained weights split by the TP plan: a random-init model is first built whole
    (the same seed on every process, the same weights) and saved to output_dir/base_model, which is then
    the model_path (and a LoRA adapter's base, as for any random-init base)."""
    from finetune.model.build import _load_config, build_model, save_base_model
    from finetune.parallel.sizes import check_model_splits

    check_model_splits(_load_config(model_settings), train)
    if size_of(train, "tensor") <= 1 or model_settings.model_path is not None:
        return model_settings
    base_dir = Path(train.output_dir) / "base_model"
    whole = build_model(
        model_settings,
        lora,
        mixed_precision=train.mixed_precision,
        vocab_size=len(tokenizer),
        gradient_checkpointing=False,
    )
    save_base_model(whole, base_dir, is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        (processor or tokenizer).save_pretrained(base_dir)
        write_checksums(base_dir)
    accelerator.wait_for_everyone()
    del whole
    return model_settings.model_copy(update={"model_path": str(base_dir.resolve()), "config_path": None})


def _init_data(lora, train, tokenizer, accelerator, init_loader, model):
    """What EVA or CorDA read (finetune.model.lora_init.InitData), or None for the other inits. The model
    moves to the device first: the main process's pass over the data runs there."""
    from accelerate.utils import DistributedType

    from finetune.model.build import pad_token_id
    from finetune.model.lora_init import FOLDER, InitData
    from finetune.recipe.lora import DATA_DRIVEN

    init = lora.init_lora_weights
    if init not in DATA_DRIVEN or init_loader is None:
        return None  # apply_lora says which inits need the data
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type == DistributedType.DEEPSPEED and plugin.zero_stage == 3:
        raise FinetuneError(
            f"lora.init_lora_weights: {init} runs the model over training data before training, which "
            "ZeRO-3's partitioned weights cannot do outside its engine (PEFT runs it on whole weights): "
            "use a ZeRO-1/2 or DDP accelerate config, or another init"
        )
    if not lora.enable_qlora:  # a 4-bit base is placed on its device when it loads
        model.to(accelerator.device)
    settings = getattr(lora, init)
    output_dir = Path(train.output_dir)
    spec, resume_from = train.load_checkpoint_path, None
    if spec == "auto" and any((output_dir / "checkpoints").glob("step-*")):
        resume_from = output_dir / FOLDER
    elif spec not in (None, "auto"):  # output_dir/checkpoints/step-N: its run's output_dir
        resume_from = Path(spec).resolve().parent.parent / FOLDER
    return InitData(
        init_loader, settings.num_batches, pad_token_id(tokenizer), output_dir / FOLDER, resume_from
    )


def make_loader(
    data, train, dataset, pad_id: int, *, packed: bool, training: bool, accelerator=None, **options
):
    """The loader of a causal-LM objective's prepared rows (SFT, preference; `finetune eval` too):
    the recipe's loader settings; in training this rank's share in a shuffled order (unless
    data.shuffle_merged_datasets is false, which keeps the prepared order), in evaluation every row
    in order (sharded later by `accelerator.prepare`, or not at all in `finetune eval`, which passes
    no accelerator). `options` go to make_dataloader (preference rows bring their columns and
    collation)."""
    from finetune.parallel.sizes import data_parallel_rank, data_parallel_size

    return make_dataloader(
        dataset,
        micro_batch_size=train.micro_batch_size,
        seed=train.seed,
        pad_id=pad_id,
        packed=packed,
        shuffle=training and data.shuffle_merged_datasets,
        drop_last=data.dataloader_drop_last if training else False,
        pad_to_multiple_of=data.pad_to_multiple_of,
        num_workers=data.dataloader_num_workers if accelerator is not None else 0,
        prefetch_factor=data.dataloader_prefetch_factor if accelerator is not None else None,
        pin_memory=data.dataloader_pin_memory if accelerator is not None else False,
        # Processes that compute one batch together (tensor, context parallel) read the same rows.
        num_replicas=data_parallel_size(train, accelerator.num_processes)
        if training and accelerator
        else None,
        rank=data_parallel_rank(train, process_index=accelerator.process_index) if accelerator else 0,
        **options,
    )


def save_final_lm(objective, model, metrics: dict[str, Any], card_fields: dict[str, Any]) -> None:
    """save_lm for a causal-LM objective (SFT, preference) at the end of its run: the model card shows
    the step, `card_fields` and the final eval_ metrics, beside the recipe, the data manifest and the
    run's extensions (train.extend_run)."""
    from finetune.recipe import recipe_to_dict

    card_metrics = {"step": metrics["step"], **card_fields}
    card_metrics.update(
        {k: v for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, (int, float))}
    )
    save_lm(
        objective.accelerator,
        model,
        getattr(objective, "processor", None) or objective.tokenizer,  # a VLM's processor holds its tokenizer
        lora=objective.lora,
        output_dir=Path(objective.train.output_dir),
        card={
            "recipe": recipe_to_dict(objective.recipe),
            "manifest": objective.manifest,
            "metrics": card_metrics,
            "extensions": metrics.get("extensions") or [],
        },
    )


def checkpoint_trainable_only(accelerator) -> None:
    """LoRA checkpoints hold what trains (adapters, modules_to_save), not the frozen base.

    accelerate's save_state would write the whole model at every checkpoint (570 MB for
    SmolLM2-135M against a 20 MB adapter; 16 GB for Llama-3.1-8B), and a QLoRA base's 4-bit
    quantization state does not load back into a freshly quantized model. Resume rebuilds the
    frozen base from the recipe (the same weights, or for a random-init base the same seed) and
    these hooks restore the trained tensors. DeepSpeed and FSDP save their own formats.
    """
    from accelerate.utils import DistributedType
    from safetensors.torch import load_file, save_file

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return
    acc = accelerator

    def trainable(model) -> dict[str, torch.Tensor]:
        return {n: p for n, p in acc.unwrap_model(model).named_parameters() if p.requires_grad}

    def save_hook(models, weights, output_dir):
        if acc.is_main_process:
            for k, model in enumerate(models):
                tensors = {n: p.detach().cpu().contiguous() for n, p in trainable(model).items()}
                save_file(tensors, str(Path(output_dir) / f"trainable_{k}.safetensors"))
        weights.clear()  # nothing left for accelerate to save: the frozen base is not written

    def load_hook(models, input_dir):
        for k, model in enumerate(models):
            path = Path(input_dir) / f"trainable_{k}.safetensors"
            params = trainable(model)
            state = load_file(str(path))
            if set(state) != set(params):
                raise FinetuneError(
                    f"{path} holds other trained tensors than this run trains ({len(state)} saved, "
                    f"{len(params)} now): resume with the recipe that wrote the checkpoint"
                )
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(state[name])
        models.clear()  # loaded: accelerate must not look for model.safetensors

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def check_batches(accelerator, loader, num_rows: int, micro_batch_size: int) -> None:
    """Refuse an epoch without batches; say how many rows drop_last leaves out of each epoch."""
    processes = accelerator.num_processes
    if len(loader) == 0:
        raise FinetuneError(
            "no training batches: the prepared train split has fewer rows than "
            f"train.micro_batch_size x processes ({num_rows} rows); lower micro_batch_size "
            "or set data.dataloader_drop_last: false"
        )
    dropped = loader.batch_sampler.dropped_per_epoch
    if dropped:
        accelerator.print(
            f"data.dataloader_drop_last: {dropped} of {num_rows} rows per epoch do not fill a "
            f"last batch of {micro_batch_size} x {processes} processes and are not trained on (a different "
            "set each epoch); set dataloader_drop_last: false to keep them"
        )


def throughput_fields(
    accelerator,
    flops: dict,
    interval: dict,
    elapsed: float,
    totals: dict,
    *,
    forward_passes: int = 0,
    copies: int = 1,
) -> dict:
    """tokens/s (this process and all processes), TFLOP/s and MFU of a logging interval.

    `interval` holds this process's `tokens` and the `seq_sq` / `seq` sums of `seq_stats`; `flops`
    the parameter counts of `build_lm` and the model `config`; `forward_passes` counts the extra
    forward-only passes over the same tokens (a reference model). Updates totals["num_tokens"].
    """
    tokens = interval.get("tokens", 0)
    totals["num_tokens"] = totals.get("num_tokens", 0) + tokens
    seq_len_sq_mean = interval.get("seq_sq", 0.0) / max(interval.get("seq", 0), 1)
    flops_per_token = model_flops_per_token(
        flops["config"],
        num_params=flops["num_params"],
        num_trainable=flops["num_trainable"],
        seq_len_sq_mean=seq_len_sq_mean,
    ) + forward_passes * forward_flops_per_token(
        flops["config"], num_params=flops["num_params"], seq_len_sq_mean=seq_len_sq_mean
    )
    # `copies` processes compute the same tokens together (tensor parallel: each a share of the FLOPs).
    tflops = tokens * flops_per_token / elapsed / 1e12 / copies
    peak = device_peak_flops(accelerator.device)
    return {
        "tokens_per_sec": tokens / elapsed,
        "tokens_per_sec_total": tokens * accelerator.num_processes / copies / elapsed,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
    }


INITIAL_ADAPTER = "initial_adapter"
"""output_dir's folder for a PiSSA/OLoRA adapter as initialised (finetune.model.adapters.save_initial_adapter)."""


def save_lm(accelerator, model, tokenizer, *, lora, output_dir: Path, card: dict) -> None:
    """The adapter (or full model, or the merged model with lora.save_lora_only false) in Hugging Face
    format with the tokenizer and a model card (`card`: recipe, manifest, metrics); every process calls
    it."""
    from accelerate.utils import DistributedType

    from finetune.model_card import write_model_card
    from finetune.parallel.tensor import is_tensor_parallel

    unwrapped = accelerator.unwrap_model(model)
    # Sharded engines must gather the full weights first; otherwise the unwrapped model saves its
    # own state dict (get_state_dict of a torch.compile'd PEFT model has keys PEFT's save cannot map).
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    # ZeRO-3 gathers the 16-bit weights, FSDP2 a full state dict on rank 0 (every rank takes part).
    state_dict = accelerator.get_state_dict(model) if sharded else None
    merge = lora.enable_lora and not lora.save_lora_only
    # A TP model's save_pretrained gathers its DTensors itself (transformers, PEFT); its LoRA merges on
    # the main process into the whole base, as a sharded engine's.
    if merge and (sharded or is_tensor_parallel(unwrapped)):
        _merge_sharded(accelerator, unwrapped, tokenizer, state_dict, output_dir)
    elif merge:
        unwrapped.merge_and_unload().save_pretrained(
            output_dir,
            state_dict=state_dict,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            safe_serialization=True,
        )
    else:  # the adapter, or a fully fine-tuned model
        _save_adapter(accelerator, unwrapped, output_dir, state_dict, output_dir / INITIAL_ADAPTER)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)  # a vision-language model's processor saves its tokenizer too
        write_model_card(output_dir, **card)


def _save_adapter(accelerator, unwrapped, folder: Path, state_dict, initial: Path) -> None:
    """Save the PEFT model's adapter into `folder` (every process calls it; the main one writes). An
    adapter trained against a residual base (PiSSA / OLoRA / CorDA) is saved converted to plain LoRA
    for the original base, against its `initial` adapter."""
    from finetune.model.adapters import adapter_save_kwargs, init_modifies_base, save_converted_adapter

    common = {"state_dict": state_dict, "is_main_process": accelerator.is_main_process}
    if init_modifies_base(unwrapped):
        save_converted_adapter(unwrapped, folder, initial=initial, **common, **adapter_save_kwargs(unwrapped))
    else:
        unwrapped.save_pretrained(
            folder,
            save_function=accelerator.save,
            safe_serialization=True,
            **common,
            **adapter_save_kwargs(unwrapped),
        )


def _merge_sharded(accelerator, unwrapped, tokenizer, state_dict, output_dir: Path) -> None:
    """The sharded model cannot merge in place: save the adapter, then merge it into the base
    weights on the main process (the same code as `finetune merge-lora`)."""
    from accelerate.utils import DistributedType

    from finetune.model.inference import merge_lora

    adapter_dir = output_dir / ".adapter-to-merge"
    try:
        # Merged below into the original base: a PiSSA/OLoRA/CorDA adapter is saved as plain LoRA for it.
        _save_adapter(accelerator, unwrapped, adapter_dir, state_dict, output_dir / INITIAL_ADAPTER)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(adapter_dir)  # its length sizes the embeddings
            if accelerator.distributed_type == DistributedType.DEEPSPEED:
                # Otherwise transformers would load the base for merging partitioned (ZeRO-3 init);
                # training is over, nothing else is built under ZeRO-3 after this.
                from transformers.integrations.deepspeed import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
            merge_lora(str(adapter_dir), str(output_dir))
    finally:  # also when the disk fills: the temporary adapter must not stay behind
        if accelerator.is_main_process:
            shutil.rmtree(adapter_dir, ignore_errors=True)
