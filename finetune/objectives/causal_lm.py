"""Causal-LM SFT: next-token cross-entropy on the trained tokens of prepared (packed) rows.

The loss of a micro-batch is the sum of its token losses divided by the trainable tokens of the
whole accumulation window on all processes (transformers' `num_items_in_batch`), so the window's
update is the mean over its trainable tokens, whatever the micro-batch sizes.

The parts any causal-LM objective needs (the model with LoRA / QLoRA, LoRA checkpoints of the
trained tensors only, the batch check, throughput fields, the final save) are module functions,
shared with the preference objective (finetune/objectives/preference.py).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from finetune.data.loader import count_tokens, count_trainable, make_dataloader, seq_stats
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.losses.causal_lm import forward, token_loss_sums
from finetune.metrics import device_peak_flops, forward_flops_per_token, model_flops_per_token
from finetune.notices import warn


class CausalLMObjective:
    """SFT of a transformers causal LM (full, LoRA, QLoRA) on prepared token rows."""

    name = "sft"
    summary_keys = ("tokens",)

    def __init__(self, recipe):
        from finetune.model import check_attention_backend

        # Before anything is written or prepared: an attention backend that cannot run here fails now.
        check_attention_backend(recipe.model.attn_implementation)
        # The objective is built by the entry point from the whole recipe and keeps only its parts.
        self.recipe = recipe
        self.model_settings, self.lora, self.data = recipe.model, recipe.lora, recipe.data
        self.train, self.eval_settings = recipe.train, recipe.eval
        self.generation_rows: dict[str, list[dict]] = {}
        self.eval_loader = None
        self.tokenizer = None
        self.accelerator = None
        self.flops: dict[str, Any] = {}
        self.loss_chunk_size = 0  # tokens per chunk of the head's loss; 0 = full logits
        self.manifest: dict = {}
        self.eval_every: int | None = None
        self.can_evaluate = False

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare import prepare_on_main_process
        from finetune.model import load_tokenizer, pad_token_id

        self.accelerator = accelerator
        self.tokenizer = load_tokenizer(self.model_settings)
        # One process per machine builds the prepared dataset; the others wait, however long it takes,
        # then load it from the cache.
        prepared = prepare_on_main_process(self.recipe, accelerator)
        self.manifest = prepared.manifest
        model, self.flops = build_lm(self.model_settings, self.lora, self.train, self.tokenizer, accelerator)
        self.loss_chunk_size = self._chunk_size(model, accelerator)
        pad_id = pad_token_id(self.tokenizer)
        train_loader = self._loader(prepared.train, pad_id, packed=self.data.sample_packing, training=True)
        check_batches(accelerator, train_loader, len(prepared.train), self.train.micro_batch_size)
        if prepared.eval is not None and len(prepared.eval) > 0:
            self.eval_loader = self._loader(
                prepared.eval, pad_id, packed=self.data.eval_sample_packing, training=False
            )
        self._generation_sets(accelerator)
        if self.lora.enable_lora:
            checkpoint_trainable_only(accelerator)
        self.can_evaluate = self.eval_loader is not None or bool(self.generation_rows)
        self.eval_every = self.train.eval_steps if self.can_evaluate else None
        return Parts(model=model, train_loader=train_loader, manifest=prepared.manifest)

    def _generation_sets(self, accelerator) -> None:
        """The eval.generation_sets' rows, when they are scored during training."""
        self.generation_rows = generation_rows(self.eval_settings, accelerator)

    def _chunk_size(self, model, accelerator) -> int:
        """train.loss_chunk_size resolved for this model (auto: on for large vocab x tokens)."""
        from finetune.losses.chunked_ce import resolve_loss_chunk_size

        setting = self.train.loss_chunk_size
        if self.model_settings.enable_liger_kernel:
            if setting:  # Liger's fused linear cross-entropy already avoids the full logits
                warn(
                    "train.loss_chunk_size is ignored with model.enable_liger_kernel: Liger's fused linear "
                    "cross-entropy already computes the loss without the full logits",
                    emit=accelerator.print,
                )
            return 0
        size = resolve_loss_chunk_size(
            setting,
            vocab_size=model.get_output_embeddings().weight.shape[0],
            tokens_per_micro_batch=self.train.micro_batch_size * self.data.packing_len,
        )
        if size and setting is None:
            accelerator.print(f"train.loss_chunk_size auto: the loss is computed {size} tokens at a time")
        return size

    def _loader(self, dataset, pad_id: int, *, packed: bool, training: bool):
        return make_loader(
            self.accelerator, self.data, self.train, dataset, pad_id, packed=packed, training=training
        )

    def on_prepared(self, accelerator, model) -> None:
        self.flops["config"] = accelerator.unwrap_model(model).config
        if self.eval_loader is not None:
            # Sharded by Accelerate, after the model: DeepSpeed wants that order.
            self.eval_loader = accelerator.prepare(self.eval_loader)
        return None  # no state besides the model's, the optimizer's and the schedule's

    def after_update(self, model) -> None:
        """Nothing to do after an applied update."""

    # ------------------------------------------------------------------------------------ step

    def units(self, batch: dict) -> torch.Tensor:
        return count_trainable(batch)

    def loss(self, model, batch: dict, num_units: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if self.loss_chunk_size:
            from finetune.losses.chunked_ce import causal_lm_loss

            return causal_lm_loss(model, batch, num_items=num_units, chunk_size=self.loss_chunk_size), {}
        return forward(model, batch, num_items=num_units).loss, {}

    def counts(self, batch: dict) -> dict[str, float]:
        seq_sq, seq = seq_stats(batch)
        return {"tokens": count_tokens(batch), "seq_sq": seq_sq, "seq": seq}

    def log_fields(self, interval: dict[str, float], elapsed: float, totals: dict[str, float]) -> dict:
        """tokens/s (this process and all), trainable tokens, TFLOP/s and MFU for the interval.

        Token counts are this process's; trainable tokens (`units`) are all processes'.
        """
        fields = throughput_fields(self.accelerator, self.flops, interval, elapsed, totals)
        trainable = interval.get("units", 0)
        return {
            "tokens_per_sec": fields["tokens_per_sec"],
            "tokens_per_sec_total": fields["tokens_per_sec_total"],
            "trainable_tokens": trainable,
            "trainable_tokens_per_sec": trainable / elapsed,
            "tflops_per_device": fields["tflops_per_device"],
            "mfu": fields["mfu"],
        }

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """Eval loss and perplexity on the eval split, and the generation sets' scores and samples."""
        metrics: dict[str, Any] = self._eval_loss(model, step) if self.eval_loader is not None else {}
        if self.generation_rows:
            metrics.update(self._generation_metrics(model, step))
        return metrics

    def _generation_metrics(self, model, step: int) -> dict[str, Any]:
        return generation_metrics(
            self.accelerator,
            model,
            self.tokenizer,
            self.eval_settings,
            self.generation_rows,
            step=step,
            report_to=self.train.report_to,
        )

    def _eval_loss(self, model, step: int) -> dict[str, float]:
        """Token-weighted eval loss and perplexity over the eval split, gathered across processes."""
        acc = self.accelerator
        model.eval()
        total_loss, total_count = 0.0, 0
        with torch.no_grad():
            for batch in self.eval_loader:
                sums, counts = token_loss_sums(model, batch, chunk_size=self.loss_chunk_size)
                sums, counts = acc.gather_for_metrics((sums, counts))
                total_loss += float(sums.sum())
                total_count += int(counts.sum())
        model.train()
        loss = total_loss / max(total_count, 1)
        metrics = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": total_count}
        if self.train.report_to:
            acc.log(metrics, step=step)
        return metrics

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The adapter (or full model) in Hugging Face format, tokenizer and model card."""
        save_final_lm(self, model, metrics, {"trainable_tokens": metrics["units"]})
        return []


def _samples_markdown(samples: list[dict]) -> str:
    """Sample generations as a markdown table for the trackers' text panel."""
    lines = ["| prompt | output | expected | correct |", "|---|---|---|---|"]
    for sample in samples:
        cells = [sample["prompt"], sample["output"], sample.get("expected"), sample.get("correct")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ shared with preference


def build_lm(model_settings, lora, train, tokenizer, accelerator) -> tuple[Any, dict[str, Any]]:
    """(the causal LM to train, not yet prepared; its parameter counts for FLOPs): pretrained or
    random-init weights, LoRA / QLoRA adapters (a random-init base is saved with the tokenizer to
    output_dir/base_model, so the adapter can be loaded later), fp32 trainable weights under fp16."""
    from finetune.model import (
        apply_lora,
        build_model,
        count_parameters,
        save_base_model,
        upcast_trainable_to_fp32,
    )

    output_dir = Path(train.output_dir)
    model = build_model(
        model_settings,
        lora,
        mixed_precision=train.mixed_precision,
        vocab_size=len(tokenizer),
        gradient_checkpointing=train.gradient_checkpointing,
    )
    if lora.enable_lora:
        base_dir = None
        if model_settings.model_path is None:
            base_dir = output_dir / "base_model"
            save_base_model(model, base_dir, is_main_process=accelerator.is_main_process)
            if accelerator.is_main_process:  # so the base alone loads for eval and chat
                tokenizer.save_pretrained(base_dir)
        model = apply_lora(model, lora, gradient_checkpointing=train.gradient_checkpointing)
        if base_dir is not None:
            model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
    if train.mixed_precision == "fp16":
        upcast_trainable_to_fp32(model)
    trainable, total = count_parameters(model)
    accelerator.print(f"parameters: {trainable:,} trainable / {total:,} total")
    return model, {"num_params": total, "num_trainable": trainable}


def make_loader(accelerator, data, train, dataset, pad_id: int, *, packed: bool, training: bool, **options):
    """The loader of a causal-LM objective's prepared rows (SFT and preference): the recipe's loader
    settings; in training this rank's share in a shuffled order (unless data.shuffle_merged_datasets
    is false, which keeps the prepared order), in evaluation every row in order. `options` go to
    make_dataloader (preference rows bring their columns and collation)."""
    return make_dataloader(
        dataset,
        micro_batch_size=train.micro_batch_size,
        seed=train.seed,
        pad_id=pad_id,
        packed=packed,
        shuffle=training and data.shuffle_merged_datasets,
        drop_last=data.dataloader_drop_last if training else False,
        pad_to_multiple_of=data.pad_to_multiple_of,
        num_workers=data.dataloader_num_workers,
        prefetch_factor=data.dataloader_prefetch_factor,
        pin_memory=data.dataloader_pin_memory,
        num_replicas=accelerator.num_processes if training else None,
        rank=accelerator.process_index,
        **options,
    )


def save_final_lm(objective, model, metrics: dict[str, Any], card_fields: dict[str, Any]) -> None:
    """save_lm for a causal-LM objective (SFT, preference) at the end of its run: the model card shows
    the step, `card_fields` and the final eval_ metrics, beside the recipe and the data manifest."""
    from finetune.recipe import recipe_to_dict

    card_metrics = {"step": metrics["step"], **card_fields}
    card_metrics.update(
        {k: v for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, (int, float))}
    )
    save_lm(
        objective.accelerator,
        model,
        objective.tokenizer,
        lora=objective.lora,
        output_dir=Path(objective.train.output_dir),
        card={
            "recipe": recipe_to_dict(objective.recipe),
            "manifest": objective.manifest,
            "metrics": card_metrics,
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


def generation_rows(eval_settings, accelerator) -> dict[str, list[dict]]:
    """The eval.generation_sets' rows by set name, when they are scored during training ({} otherwise)."""
    from accelerate.utils import DistributedType

    from finetune.evaluation.report import load_generation_rows

    if not (eval_settings.generation_sets and eval_settings.during_training):
        return {}
    sharded = accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.zero_stage == 3
    )
    if sharded:
        raise FinetuneError(
            "eval.generation_sets during training: generation with a sharded model (FSDP, ZeRO-3) is not "
            "supported; set eval.during_training: false and run `finetune eval` on the saved model"
        )
    return {s.name: load_generation_rows(s) for s in eval_settings.generation_sets}


def generation_metrics(
    accelerator, model, tokenizer, eval_settings, rows: dict, *, step: int, report_to: list
) -> dict[str, Any]:
    """Generation sets scored on the main process (greedy decoding of the unwrapped model); the
    others wait. Scores and samples go to progress.jsonl, and to the trackers as scalars and text."""
    from finetune.evaluation.report import score_generation_sets

    acc, fields = accelerator, {}
    if acc.is_main_process:
        results = score_generation_sets(
            acc.unwrap_model(model),
            tokenizer,
            eval_settings.generation_sets,
            rows,
            batch_size=eval_settings.batch_size,
            progress=False,
        )
        tracked = {}
        for name, result in results.items():
            if result["score"] is not None:
                fields[f"eval_{name}_{result['metric']}"] = result["score"]
                tracked[f"eval/{name}_{result['metric']}"] = result["score"]
            fields[f"eval_{name}_samples"] = result["samples"]
            tracked[f"eval/{name}_samples"] = _samples_markdown(result["samples"])
        if report_to:
            acc.log(tracked, step=step)
    acc.wait_for_everyone()
    return fields


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
    accelerator, flops: dict, interval: dict, elapsed: float, totals: dict, *, forward_passes: int = 0
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
    tflops = tokens * flops_per_token / elapsed / 1e12
    peak = device_peak_flops(accelerator.device)
    return {
        "tokens_per_sec": tokens / elapsed,
        "tokens_per_sec_total": tokens * accelerator.num_processes / elapsed,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
    }


def save_lm(accelerator, model, tokenizer, *, lora, output_dir: Path, card: dict) -> None:
    """The adapter (or full model, or the merged model with lora.save_lora_only false) in Hugging Face
    format with the tokenizer and a model card (`card`: recipe, manifest, metrics); every process calls
    it."""
    from accelerate.utils import DistributedType

    from finetune.model_card import write_model_card

    unwrapped = accelerator.unwrap_model(model)
    # Sharded engines must gather the full weights first; otherwise the unwrapped model saves its
    # own state dict (get_state_dict of a torch.compile'd PEFT model has keys PEFT's save cannot map).
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    # ZeRO-3 gathers the 16-bit weights, FSDP2 a full state dict on rank 0 (every rank takes part).
    state_dict = accelerator.get_state_dict(model) if sharded else None
    merge = lora.enable_lora and not lora.save_lora_only
    if merge and sharded:
        _merge_sharded(accelerator, unwrapped, tokenizer, state_dict, output_dir)
    else:
        if merge:
            unwrapped = unwrapped.merge_and_unload()
        unwrapped.save_pretrained(
            output_dir,
            state_dict=state_dict,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            safe_serialization=True,
        )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        write_model_card(output_dir, **card)


def _merge_sharded(accelerator, unwrapped, tokenizer, state_dict, output_dir: Path) -> None:
    """The sharded model cannot merge in place: save the adapter, then merge it into the base
    weights on the main process (the same code as `finetune merge-lora`)."""
    from accelerate.utils import DistributedType

    from finetune.model import merge_lora

    adapter_dir = output_dir / ".adapter-to-merge"
    unwrapped.save_pretrained(
        adapter_dir,
        state_dict=state_dict,
        is_main_process=accelerator.is_main_process,
        safe_serialization=True,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(adapter_dir)  # its length sizes the embeddings
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            # Otherwise transformers would load the base for merging partitioned (ZeRO-3 init);
            # training is over, nothing else is built under ZeRO-3 after this.
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        merge_lora(str(adapter_dir), str(output_dir))
        shutil.rmtree(adapter_dir)
