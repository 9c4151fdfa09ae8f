"""Causal-LM SFT: next-token cross-entropy on the trained tokens of prepared (packed) rows.

The loss of a micro-batch is the sum of its token losses divided by the trainable tokens of the
whole accumulation window on all processes (transformers' `num_items_in_batch`), so the window's
update is the mean over its trainable tokens, whatever the micro-batch sizes.
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
from finetune.metrics import device_peak_flops, model_flops_per_token
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
        model = self._model(accelerator)
        pad_id = pad_token_id(self.tokenizer)
        train_loader = self._loader(prepared.train, pad_id, packed=self.data.sample_packing, training=True)
        self._check_batches(train_loader, len(prepared.train))
        if prepared.eval is not None and len(prepared.eval) > 0:
            self.eval_loader = self._loader(
                prepared.eval, pad_id, packed=self.data.eval_sample_packing, training=False
            )
        self._generation_sets(accelerator)
        if self.lora.enable_lora:
            self._checkpoint_trainable_only(accelerator)
        self.can_evaluate = self.eval_loader is not None or bool(self.generation_rows)
        self.eval_every = self.train.eval_steps if self.can_evaluate else None
        return Parts(model=model, train_loader=train_loader, manifest=prepared.manifest)

    def _checkpoint_trainable_only(self, accelerator) -> None:
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

    def _generation_sets(self, accelerator) -> None:
        """The eval.generation_sets' rows, when they are scored during training."""
        from accelerate.utils import DistributedType

        from finetune.evaluation.report import load_generation_rows

        settings = self.eval_settings
        if not (settings.generation_sets and settings.during_training):
            return
        sharded = accelerator.distributed_type == DistributedType.FSDP or (
            accelerator.distributed_type == DistributedType.DEEPSPEED
            and accelerator.state.deepspeed_plugin.zero_stage == 3
        )
        if sharded:
            raise FinetuneError(
                "eval.generation_sets during training: generation with a sharded model (FSDP, ZeRO-3) is not "
                "supported; set eval.during_training: false and run `finetune eval` on the saved model"
            )
        self.generation_rows = {s.name: load_generation_rows(s) for s in settings.generation_sets}

    def _model(self, accelerator):
        from finetune.model import (
            apply_lora,
            build_model,
            count_parameters,
            save_base_model,
            upcast_trainable_to_fp32,
        )

        train, output_dir = self.train, Path(self.train.output_dir)
        model = build_model(
            self.model_settings,
            self.lora,
            mixed_precision=train.mixed_precision,
            vocab_size=len(self.tokenizer),
            gradient_checkpointing=train.gradient_checkpointing,
        )
        if self.lora.enable_lora:
            base_dir = None
            if self.model_settings.model_path is None:
                base_dir = output_dir / "base_model"
                save_base_model(model, base_dir, is_main_process=accelerator.is_main_process)
                if accelerator.is_main_process:  # so the base alone loads for eval and chat
                    self.tokenizer.save_pretrained(base_dir)
            model = apply_lora(model, self.lora, gradient_checkpointing=train.gradient_checkpointing)
            if base_dir is not None:
                model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
        if train.mixed_precision == "fp16":
            upcast_trainable_to_fp32(model)
        trainable, total = count_parameters(model)
        accelerator.print(f"parameters: {trainable:,} trainable / {total:,} total")
        self.flops = {"num_params": total, "num_trainable": trainable}
        self.loss_chunk_size = self._chunk_size(model, accelerator)
        return model

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
        acc, data = self.accelerator, self.data
        return make_dataloader(
            dataset,
            micro_batch_size=self.train.micro_batch_size,
            seed=self.train.seed,
            pad_id=pad_id,
            packed=packed,
            # data.shuffle_merged_datasets: false keeps the prepared order in training too.
            shuffle=training and data.shuffle_merged_datasets,
            drop_last=data.dataloader_drop_last if training else False,
            pad_to_multiple_of=data.pad_to_multiple_of,
            num_workers=data.dataloader_num_workers,
            prefetch_factor=data.dataloader_prefetch_factor,
            pin_memory=data.dataloader_pin_memory,
            num_replicas=acc.num_processes if training else None,
            rank=acc.process_index,
        )

    def _check_batches(self, loader, num_rows: int) -> None:
        processes, micro = self.accelerator.num_processes, self.train.micro_batch_size
        if len(loader) == 0:
            raise FinetuneError(
                "no training batches: the prepared train split has fewer rows than "
                f"train.micro_batch_size x processes ({num_rows} rows); lower micro_batch_size "
                "or set data.dataloader_drop_last: false"
            )
        dropped = loader.batch_sampler.dropped_per_epoch
        if dropped:
            self.accelerator.print(
                f"data.dataloader_drop_last: {dropped} of {num_rows} rows per epoch do not fill a "
                f"last batch of {micro} x {processes} processes and are not trained on (a different set "
                "each epoch); set dataloader_drop_last: false to keep them"
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
        acc = self.accelerator
        tokens, trainable = interval.get("tokens", 0), interval.get("units", 0)
        totals["num_tokens"] = totals.get("num_tokens", 0) + tokens
        flops_per_token = model_flops_per_token(
            self.flops["config"],
            num_params=self.flops["num_params"],
            num_trainable=self.flops["num_trainable"],
            seq_len_sq_mean=interval.get("seq_sq", 0.0) / max(interval.get("seq", 0), 1),
        )
        tflops = tokens * flops_per_token / elapsed / 1e12
        peak = device_peak_flops(acc.device)
        return {
            "tokens_per_sec": tokens / elapsed,
            "tokens_per_sec_total": tokens * acc.num_processes / elapsed,
            "trainable_tokens": trainable,
            "trainable_tokens_per_sec": trainable / elapsed,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / peak if peak else None,
        }

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """Eval loss and perplexity on the eval split, and the generation sets' scores and samples."""
        metrics: dict[str, Any] = self._eval_loss(model, step) if self.eval_loader is not None else {}
        if self.generation_rows:
            metrics.update(self._generation_metrics(model, step))
        return metrics

    def _generation_metrics(self, model, step: int) -> dict[str, Any]:
        """Generation sets scored on the main process (greedy decoding of the unwrapped model); the
        others wait. Scores and samples go to progress.jsonl, and to the trackers as scalars and text."""
        from finetune.evaluation.report import score_generation_sets

        acc, fields = self.accelerator, {}
        if acc.is_main_process:
            results = score_generation_sets(
                acc.unwrap_model(model),
                self.tokenizer,
                self.eval_settings.generation_sets,
                self.generation_rows,
                batch_size=self.eval_settings.batch_size,
                progress=False,
            )
            tracked = {}
            for name, result in results.items():
                if result["score"] is not None:
                    fields[f"eval_{name}_{result['metric']}"] = result["score"]
                    tracked[f"eval/{name}_{result['metric']}"] = result["score"]
                fields[f"eval_{name}_samples"] = result["samples"]
                tracked[f"eval/{name}_samples"] = _samples_markdown(result["samples"])
            if self.train.report_to:
                acc.log(tracked, step=step)
        acc.wait_for_everyone()
        return fields

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
        from accelerate.utils import DistributedType

        from finetune.model_card import write_model_card
        from finetune.recipe import recipe_to_dict

        acc, output_dir = self.accelerator, Path(self.train.output_dir)
        unwrapped = acc.unwrap_model(model)
        # Sharded engines must gather the full weights first; otherwise the unwrapped model saves its
        # own state dict (get_state_dict of a torch.compile'd PEFT model has keys PEFT's save cannot map).
        sharded = acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        # ZeRO-3 gathers the 16-bit weights, FSDP2 a full state dict on rank 0 (every rank takes part).
        state_dict = acc.get_state_dict(model) if sharded else None
        merge = self.lora.enable_lora and not self.lora.save_lora_only
        if merge and sharded:
            self._merge_sharded(unwrapped, state_dict, output_dir)
        else:
            if merge:
                unwrapped = unwrapped.merge_and_unload()
            unwrapped.save_pretrained(
                output_dir,
                state_dict=state_dict,
                is_main_process=acc.is_main_process,
                save_function=acc.save,
                safe_serialization=True,
            )
        if acc.is_main_process:
            self.tokenizer.save_pretrained(output_dir)
            card_metrics = {"step": metrics["step"], "trainable_tokens": metrics["units"]}
            card_metrics.update(
                {k: v for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, (int, float))}
            )
            write_model_card(
                output_dir, recipe=recipe_to_dict(self.recipe), manifest=self.manifest, metrics=card_metrics
            )
        return []

    def _merge_sharded(self, unwrapped, state_dict, output_dir: Path) -> None:
        """The sharded model cannot merge in place: save the adapter, then merge it into the base
        weights on the main process (the same code as `finetune merge-lora`)."""
        from accelerate.utils import DistributedType

        from finetune.model import merge_lora

        acc = self.accelerator
        adapter_dir = output_dir / ".adapter-to-merge"
        unwrapped.save_pretrained(
            adapter_dir, state_dict=state_dict, is_main_process=acc.is_main_process, safe_serialization=True
        )
        if acc.is_main_process:
            self.tokenizer.save_pretrained(adapter_dir)  # its length sizes the embeddings
            if acc.distributed_type == DistributedType.DEEPSPEED:
                # Otherwise transformers would load the base for merging partitioned (ZeRO-3 init);
                # training is over, nothing else is built under ZeRO-3 after this.
                from transformers.integrations.deepspeed import unset_hf_deepspeed_config

                unset_hf_deepspeed_config()
            merge_lora(str(adapter_dir), str(output_dir))
            shutil.rmtree(adapter_dir)


def _samples_markdown(samples: list[dict]) -> str:
    """Sample generations as a markdown table for the trackers' text panel."""
    lines = ["| prompt | output | expected | correct |", "|---|---|---|---|"]
    for sample in samples:
        cells = [sample["prompt"], sample["output"], sample.get("expected"), sample.get("correct")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)
