"""SFT of a causal LM: next-token cross-entropy on the trained tokens of prepared (packed) rows.

The loss of a micro-batch is the sum of its token losses divided by the trainable tokens of the
whole accumulation window on all processes (transformers' `num_items_in_batch`), so the window's
update is the mean over its trainable tokens, whatever the micro-batch sizes.

The parts every causal-LM objective needs (the model with LoRA / QLoRA, loaders, LoRA checkpoints of
the trained tensors only, throughput, the final save) are in finetune.objectives.lm.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import torch

import finetune.objectives.lm as lm
from finetune import trackers
from finetune.data.batching.loader import count_tokens, seq_stats
from finetune.engine.objective import Parts
from finetune.losses.causal_lm import forward, token_loss_sums, trainable_tokens
from finetune.notices import warn
from finetune.parallel.sizes import ranks_sharing_rows, size_of


class SFTObjective:
    """SFT of a transformers causal LM (full, LoRA, QLoRA) on prepared token rows."""

    name = "sft"
    summary_keys = ("tokens",)

    def __init__(self, recipe):
        lm.start(self, recipe)
        self.loss_chunk_size = 0  # tokens per chunk of the head's loss; 0 = full logits
        self.processor = None  # a vision-language model's (model.kind vlm): its collator processes the images
        self.stream = None  # the StreamLoader of a data.streaming run

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare.build import prepare_on_main_process
        from finetune.model.build import load_tokenizer
        from finetune.model.vlm import load_processor

        self.accelerator = accelerator
        if self.model_settings.kind == "vlm":
            self.processor = load_processor(self.model_settings)
        self.tokenizer = self.processor.tokenizer if self.processor else load_tokenizer(self.model_settings)
        if self.data.streaming:  # nothing prepared: rows are read, tokenized and packed as training goes
            return self._build_streaming(accelerator)
        # One process per machine builds the prepared dataset; the others wait, however long it takes,
        # then load it from the cache.
        prepared = prepare_on_main_process(self.recipe, accelerator)
        self.manifest = prepared.manifest
        make_train_loader = partial(
            loader,
            self.data,
            self.train,
            prepared.train,
            self.tokenizer,
            accelerator=accelerator,
            processor=self.processor,
        )
        model, self.flops = lm.build_lm(
            self.model_settings,
            self.lora,
            self.train,
            self.tokenizer,
            accelerator,
            self.processor,
            init_loader=make_train_loader,
        )
        self.loss_chunk_size = self._chunk_size(model, accelerator)
        train_loader = make_train_loader()
        lm.check_batches(accelerator, train_loader, len(prepared.train), self.train.micro_batch_size)
        if prepared.eval is not None and len(prepared.eval) > 0:
            self.eval_loader = loader(
                self.data,
                self.train,
                prepared.eval,
                self.tokenizer,
                training=False,
                accelerator=accelerator,
                processor=self.processor,
            )
        lm.finish_build(self, accelerator, held_out=self.eval_loader is not None)
        return Parts(
            model=model,
            train_loader=train_loader,
            manifest=prepared.manifest,
            loraplus_lr_ratio=self.lora.loraplus_lr_ratio,
        )

    def _build_streaming(self, accelerator) -> Parts:
        """data.streaming: the stream loader (its position checkpointed, see on_prepared), no eval split."""
        from finetune.data.batching.streaming import make_stream_loader

        self.stream = make_stream_loader(
            self.data,
            self.train,
            self.tokenizer,
            chat_template=self.model_settings.resolved_chat_template,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
        )
        self.manifest = {"kind": "sft", "streaming": True}
        model, self.flops = lm.build_lm(
            self.model_settings, self.lora, self.train, self.tokenizer, accelerator
        )
        self.loss_chunk_size = self._chunk_size(model, accelerator)
        lm.finish_build(self, accelerator, held_out=False)
        return Parts(
            model=model,
            train_loader=self.stream,
            manifest=self.manifest,
            loraplus_lr_ratio=self.lora.loraplus_lr_ratio,
        )

    def _chunk_size(self, model, accelerator) -> int:
        """train.loss_chunk_size resolved for this model (auto: on for large vocab x tokens)."""
        from finetune.losses.chunked_ce import fused_linear_backend, resolve_loss_chunk_size
        from finetune.model.build import full_shape

        setting = self.train.loss_chunk_size
        if size_of(self.train, "tensor") > 1:
            return 0  # the TP plan splits the output head, whose forward the chunked loss would replace
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
            vocab_size=full_shape(model.get_output_embeddings().weight)[0],  # also under ZeRO-3
            tokens_per_micro_batch=self.train.micro_batch_size * self.data.packing_len,
        )
        if size and setting is None:
            accelerator.print(f"train.loss_chunk_size auto: the loss is computed {size} tokens at a time")
        if size and fused_linear_backend(model.get_output_embeddings(), accelerator.device) == "liger":
            accelerator.print(
                "the chunked loss runs as Liger's fused linear cross-entropy (liger-kernel, CUDA)"
            )
        return size

    def on_prepared(self, accelerator, model) -> None:
        self.flops["config"] = accelerator.unwrap_model(model).config
        if self.eval_loader is not None and size_of(self.train, "tensor") <= 1:
            # Sharded by Accelerate, after the model: DeepSpeed wants that order. A tensor-parallel group
            # computes every batch together: each of its processes reads every row.
            self.eval_loader = accelerator.prepare(self.eval_loader)
        # No state besides the model's, the optimizer's and the schedule's; a stream's position.
        return {"data_stream": self.stream} if self.stream is not None else None

    def after_update(self, model) -> None:
        """Nothing to do after an applied update."""

    # ------------------------------------------------------------------------------------ step

    def units(self, batch: dict) -> torch.Tensor:
        return trainable_tokens(batch)

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
        fields = lm.throughput_fields(
            self.accelerator, self.flops, interval, elapsed, totals, copies=ranks_sharing_rows(self.train)
        )
        trainable = interval.get("units", 0)
        out = {
            "tokens_per_sec": fields["tokens_per_sec"],
            "tokens_per_sec_total": fields["tokens_per_sec_total"],
            "trainable_tokens": trainable,
            "trainable_tokens_per_sec": trainable / elapsed,
            "tflops_per_device": fields["tflops_per_device"],
            "mfu": fields["mfu"],
        }
        if self.stream is not None:
            out |= stream_fields(self.stream, self.accelerator)
        return out

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """Eval loss and perplexity on the eval split, and the generation sets' scores and samples."""
        return lm.evaluate_lm(self, model, step, self._eval_loss if self.eval_loader is not None else None)

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
        # Processes that read the same rows gathered the same sums: under tensor parallel every process
        # reads every eval row (on_prepared), also across data-parallel groups; under context parallel
        # the processes of a group.
        copies = acc.num_processes if size_of(self.train, "tensor") > 1 else ranks_sharing_rows(self.train)
        total_loss, total_count = total_loss / copies, total_count // copies
        loss = total_loss / max(total_count, 1)
        metrics = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": total_count}
        trackers.log_scalars(acc, metrics, step)
        return metrics

    @staticmethod
    def held_out(recipe, prepared) -> dict[str, Any]:
        """`finetune eval`'s batches of the held-out rows for every model's token loss and perplexity (a
        vision-language recipe's collated with their pixels by the recipe's processor, as training
        evaluates them)."""
        from finetune.model.vlm import load_processor

        processor = load_processor(recipe.model) if recipe.model.kind == "vlm" else None

        def batches(tokenizer):
            return loader(
                recipe.data, recipe.train, prepared.eval, tokenizer, training=False, processor=processor
            )

        return {"eval_batches": batches}

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The adapter (or full model) in Hugging Face format, tokenizer and model card."""
        lm.save_final_lm(self, model, metrics, {"trainable_tokens": metrics["units"]})
        return []


def loader(data, train, dataset, tokenizer, *, training: bool = True, accelerator=None, processor=None):
    """The loader of prepared SFT rows: packed as data.sample_packing (training) or
    data.eval_sample_packing (evaluation) says; training's and `finetune eval`'s. Rows with images
    (a vision-language model's `processor`) are collated with their pixels (finetune.data.batching.vision)."""
    from functools import partial

    from finetune.data.batching.loader import MODEL_COLUMNS
    from finetune.data.batching.vision import collate_vlm
    from finetune.model.build import pad_token_id

    packed = data.sample_packing if training else data.eval_sample_packing
    options = {}
    if processor is not None:
        collate = partial(
            collate_vlm,
            pad_token_id=pad_token_id(tokenizer),
            pad_to_multiple_of=data.pad_to_multiple_of,
            processor=processor,
        )
        options = {"columns": (*MODEL_COLUMNS, "images"), "collate": collate}
    return lm.make_loader(
        data,
        train,
        dataset,
        pad_token_id(tokenizer),
        packed=packed,
        training=training,
        accelerator=accelerator,
        **options,
    )


def stream_fields(stream, accelerator) -> dict:
    """The stream's row accounting for progress.jsonl (all processes' rows; a collective in a
    multi-process run): rows read, kept, truncated, dropped by reason, the pass, packing efficiency."""
    counts = stream.counts()
    local = {"rows_in": counts.rows_in, "rows_kept": counts.rows_kept, "truncated": counts.truncated}
    local |= {"dropped": dict(counts.dropped), "epoch": stream.position.epoch}
    local["packed"] = stream.position.packer_counts
    every = [local]
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        every = [None] * accelerator.num_processes
        dist.all_gather_object(every, local)
    dropped: dict[str, int] = {}
    for part in every:
        for reason, n in part["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    rows, tokens = (sum(p["packed"][k] for p in every) for k in (0, 1))
    capacity = stream.reader.capacity
    return {
        "stream_rows_in": sum(p["rows_in"] for p in every),
        "stream_rows_kept": sum(p["rows_kept"] for p in every),
        "stream_rows_truncated": sum(p["truncated"] for p in every),
        "stream_rows_dropped": sum(dropped.values()),
        "stream_dropped": dict(sorted(dropped.items())),
        "stream_pass": max(p["epoch"] for p in every),
        "stream_packing_efficiency": round(tokens / (rows * capacity), 6) if rows else 0.0,
    }
