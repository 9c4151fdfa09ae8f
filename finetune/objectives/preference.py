"""Preference tuning of a causal LM: DPO, IPO, SimPO, ORPO (on pairs) and KTO (on labelled examples).

The data are prepared rows of pairs (finetune.data.batching.pairs): chosen_0, rejected_0, chosen_1, ...
packed with position_ids restarting at every sequence, so one forward scores every sequence of a
micro-batch and a pair is never split. The losses are finetune.losses.preference's pure functions on
per-sequence log-prob sums.

Units are pairs (kto: examples): a micro-batch's loss is the sum of its per-pair losses divided by
the pairs of the whole accumulation window on all processes, so the window's update is the mean over
its pairs, whatever the micro-batch sizes and packing. Metric sums (rewards, accuracies, margins,
log-probs) are averaged the same way by the engine (kto's chosen / rejected ones over the desirable
/ undesirable examples, through `count:` sums).

The reference log-probs (dpo, ipo, kto; simpo and orpo need none: the objective table says which)
come from finetune.objectives.reference: the base model with the adapters disabled (LoRA / QLoRA),
a frozen copy of the initial model (full fine-tuning), or, with preference.precompute_ref_log_probs,
a table computed once before training and cached next to the prepared data.

Each objective's loss is one function in LOSSES, looked up by name, on the per-sequence log-prob
sums of a micro-batch (`SequenceScores`) and the `preference` section.

A vision-language model (model.kind vlm) trains on pairs whose prompt holds images: its batches are
not packed but one padded row per sequence (chosen_0, rejected_0, ...) with the pixels of the pair's
images in both rows (finetune.data.batching.vision.collate_vlm_pairs), so the same per-sequence sums come from
per-row sums, and the policy, the reference and the precomputed log-probs all see the images. Its kto
examples come the same way, one padded row each, with their KL rows beside them (`kl_` keys, the same
pixels: finetune.data.batching.vision).

KTO's reference point is TRL's: the KL estimate from mismatched completions (each packed row's KL
row, finetune.data.batching.pairs.kto_kl_row; with images, each example's prompt and the previous
example's completion in the prepared split, finetune.data.batching.vision), detached, averaged over
processes and clamped at 0.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

import finetune.objectives.lm as lm
from finetune import trackers
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.losses import preference as losses
from finetune.objectives.preference_scores import (
    LOSSES,
    SequenceScores,
    completion_logps,
    eval_means,
    per_row,
    policy_logps,
    real_tokens,
    unit_values,
)
from finetune.objectives.reference import Reference, reference_source
from finetune.recipe.lora import modifies_base
from finetune.recipe.objectives import OBJECTIVES

# Columns of prepared preference rows the loaders read (finetune.data.batching.pairs).
COLUMNS = (
    "input_ids",
    "labels",
    "position_ids",
    "seq_lens",
    "num_units",
    "desirable",
    "prompt_lens",
    "row_index",
    "margins",  # pairs with a margin column (train.objective reward, which reads these rows too)
)
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class PreferenceObjective:
    """DPO, IPO, SimPO, ORPO or KTO of a transformers causal LM (full, LoRA, QLoRA) on prepared pairs."""

    def __init__(self, recipe):
        lm.start(self, recipe)
        self.settings = recipe.preference
        self.spec = OBJECTIVES[recipe.train.objective]
        self.name = self.spec.name
        if self.name not in LOSSES:
            raise FinetuneError(f"train.objective {self.name!r} is not a preference objective")
        self.paired = self.spec.kind == "paired"
        self.unit = self.spec.unit
        self.summary_keys = (self.unit,)
        self.prepared: Any = None
        self.processor = None  # a vision-language model's (model.kind vlm): its collator processes the images
        source = reference_source(
            needed=self.spec.reference,
            precompute=self.settings.precompute_ref_log_probs,
            lora=self.lora.enable_lora,
        )
        # PiSSA/OLoRA/CorDA: the reference is precomputed before the first step with the adapters on
        # (recipe rule residual_reference_problems); disabling them would give the residual base.
        self.reference = Reference(
            source, objective=self.name, lora=self.lora.enable_lora and not modifies_base(self.lora)
        )

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare.build import prepare_on_main_process
        from finetune.model.build import load_tokenizer
        from finetune.model.vlm import load_processor

        self.accelerator = accelerator
        if self.model_settings.kind == "vlm":
            self.processor = load_processor(self.model_settings)
        self.tokenizer = self.processor.tokenizer if self.processor else load_tokenizer(self.model_settings)
        # One process per machine prepares; the others wait, however long it takes, then read the cache.
        self.prepared = prepare_on_main_process(self.recipe, accelerator)
        self.manifest = self.prepared.manifest
        self._check_prepared_kind()
        train_rows = lm.with_row_index(self.prepared.train)
        model, self.flops = lm.build_lm(
            self.model_settings,
            self.lora,
            self.train,
            self.tokenizer,
            accelerator,
            self.processor,
            init_loader=lambda: self._loader(train_rows, training=True),
        )
        self.reference.attach(model, accelerator)
        train_loader = self._loader(train_rows, training=True)
        lm.check_batches(accelerator, train_loader, len(train_rows), self.train.micro_batch_size)
        if self.prepared.eval is not None and len(self.prepared.eval) > 0:
            self.eval_loader = self._loader(lm.with_row_index(self.prepared.eval), training=False)
        lm.finish_build(self, accelerator, held_out=self.eval_loader is not None)
        return Parts(
            model=model,
            train_loader=train_loader,
            manifest=self.manifest,
            loraplus_lr_ratio=self.lora.loraplus_lr_ratio,
        )

    def _check_prepared_kind(self) -> None:
        wanted = self.spec.data_type
        kind = self.manifest.get("kind", "sft")
        if kind != wanted:
            raise FinetuneError(
                f"the prepared dataset at {self.prepared.path} holds {kind} rows, but train.objective "
                f"{self.name} trains on {wanted} rows: use data entries of type {wanted} and prepare again"
            )

    def _loader(self, rows, *, training: bool):
        return loader(
            self.data,
            self.train,
            rows,
            self.tokenizer,
            training=training,
            accelerator=self.accelerator,
            processor=self.processor,
        )

    def on_prepared(self, accelerator, model) -> None:
        """The model's config for FLOPs, the eval loader sharded, the frozen reference on the device,
        the precomputed reference log-probs; no state to checkpoint besides the engine's."""
        self.flops["config"] = accelerator.unwrap_model(model).config
        self.reference.to(accelerator.device)
        if self.eval_loader is not None:
            # Sharded by Accelerate, after the model (DeepSpeed wants that order).
            self.eval_loader = accelerator.prepare(self.eval_loader)
        if self.reference.source == "precomputed":
            # Before the engine loads a checkpoint: the weights are still the initial ones, the reference.
            self.reference.tables = self._precompute(model)
        return None

    def _precompute(self, model) -> dict:
        """The reference log-probs of every prepared row, from the cache or computed now (in eval mode,
        adapters disabled, before any update: the model is the reference)."""
        from accelerate.utils import send_to_device

        from finetune.objectives.reference import cache_path, load_or_compute, reference_key

        acc = self.accelerator
        key = reference_key(
            self.model_settings, mixed_precision=self.train.mixed_precision, seed=self.train.seed
        )
        path = cache_path(Path(self.data.dataset_prepared_path), self.manifest["fingerprint"], key)
        splits = {"train": lm.with_row_index(self.prepared.train)}
        if self.prepared.eval is not None and len(self.prepared.eval):
            splits["eval"] = lm.with_row_index(self.prepared.eval)

        def make_batches(rows):
            # In order, not sharded: load_or_compute gives each process its rows.
            return (send_to_device(batch, acc.device) for batch in self._loader(rows, training=False))

        def compute(batch) -> list[torch.Tensor]:
            heads = self._reference_logps(model, batch)
            tails = self._reference_logps(model, batch, kl=True) if not self.paired else None
            return per_row(batch["num_units"], heads, tails, paired=self.paired)

        model.eval()
        try:
            return load_or_compute(acc, path, splits, compute, make_batches, kto=not self.paired)
        finally:
            model.train()

    def after_update(self, model) -> None:
        """Nothing to do after an applied update."""

    # ------------------------------------------------------------------------------------ step

    def units(self, batch: dict) -> torch.Tensor:
        return batch["num_units"].sum()

    def loss(self, model, batch: dict, num_units: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out, z0 = self._losses(model, batch, split="train")
        values = self._unit_values(out, batch, z0)
        return out.losses.sum() / num_units, {name: v.sum() for name, v in values.items()}

    def _losses(self, model, batch: dict, *, split: str) -> tuple[losses.PreferenceLoss, torch.Tensor | None]:
        """The micro-batch's per-pair (kto: per-example) losses, and kto's reference point."""
        sums, counts, nll = policy_logps(model, batch, name=self.name, settings=self.settings)
        scores = SequenceScores(sums, counts, nll, desirable=batch.get("desirable"))
        if self.spec.reference:
            scores.ref, ref_kl = self._reference(model, batch, split)
            if not self.paired:
                scores.z0 = self._kto_reference_point(model, batch, ref_kl)
        return LOSSES[self.name](scores, self.settings), scores.z0

    def _sequencesper_row(self, batch: dict) -> torch.Tensor:
        return batch["num_units"] * (2 if self.paired else 1)

    # ------------------------------------------------------------------------------- reference

    def _reference(self, model, batch: dict, split: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reference log-prob sums of the batch's sequences (and kto's KL sequences)."""
        if self.reference.tables:
            device = batch["input_ids"].device
            heads, tails = self.reference.tables[split].rows(
                batch["row_index"].cpu(), batch["num_units"].cpu()
            )
            return heads.to(device), tails.to(device) if not self.paired else None
        kl = self._reference_logps(model, batch, kl=True) if not self.paired else None
        return self._reference_logps(model, batch), kl

    def _reference_logps(self, model, batch: dict, *, kl: bool = False) -> torch.Tensor:
        """The reference model's per-sequence log-prob sums (no gradient; see Reference.model)."""
        with self.reference.model(model, self.accelerator) as reference:
            return completion_logps(reference, batch, paired=self.paired, kl=kl)

    def _kto_reference_point(self, model, batch: dict, ref_kl: torch.Tensor) -> torch.Tensor:
        """z0: the policy's KL estimate on the mismatched completions, as TRL: no gradient, the mean
        over processes (a collective: every process computes a loss for every micro-batch)."""
        with torch.no_grad():
            policy_kl = completion_logps(self.accelerator.unwrap_model(model), batch, paired=False, kl=True)
        return losses.kto_reference_point(
            policy_kl, ref_kl, reduce=lambda t: self.accelerator.reduce(t, reduction="mean")
        )

    # --------------------------------------------------------------------------------- metrics

    def _unit_values(self, out: losses.PreferenceLoss, batch: dict, z0: torch.Tensor | None) -> dict:
        return unit_values(out, batch.get("desirable"), z0, paired=self.paired)

    def counts(self, batch: dict) -> dict[str, float]:
        from finetune.data.batching.loader import seq_stats

        seq_sq, seq = seq_stats(batch)
        real = real_tokens(batch, self._sequencesper_row(batch))
        return {
            "tokens": int(real.sum()),
            "seq_sq": seq_sq,
            "seq": seq,
            self.unit: int(batch["num_units"].sum()),
        }

    def log_fields(self, interval: dict[str, float], elapsed: float, totals: dict[str, float]) -> dict:
        """tokens/s (real tokens: prompts counted in both sequences of a pair, no padding), pairs
        (examples) of the applied steps on all processes and per second, TFLOP/s and MFU (reference
        and no-grad KL forwards included)."""
        units = interval.get("units", 0)
        return {
            **lm.throughput_fields(
                self.accelerator, self.flops, interval, elapsed, totals, forward_passes=self._forward_passes()
            ),
            self.unit: units,
            f"{self.unit}_per_sec": units / elapsed,
        }

    def _forward_passes(self) -> int:
        """Forward-only passes per token besides the policy's training pass."""
        kl_rows = 0 if self.paired else 1  # kto's KL rows: a policy pass, and a reference pass of them
        return self.reference.forward_passes * (1 + kl_rows) + kl_rows

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """The loss and the training metrics over the held-out pairs (examples), prefixed eval_, and the
        eval.generation_sets' scores (as for SFT)."""
        return lm.evaluate_lm(self, model, step, self._eval_pairs if self.eval_loader is not None else None)

    def _eval_pairs(self, model, step: int) -> dict[str, Any]:
        acc = self.accelerator
        model.eval()
        names: list[str] | None = None
        totals: torch.Tensor | None = None
        with torch.no_grad():
            for batch in self.eval_loader:
                out, z0 = self._losses(model, batch, split="eval")
                values = {"loss": out.losses.detach(), **self._unit_values(out, batch, z0)}
                names = names or sorted(values)
                # Per-row sums: gather_for_metrics drops the rows Accelerate repeated to even the processes.
                row = torch.repeat_interleave(
                    torch.arange(len(batch["num_units"]), device=out.losses.device), batch["num_units"]
                )
                table = torch.zeros(len(batch["num_units"]), len(names) + 1, device=out.losses.device)
                table.index_add_(
                    0,
                    row,
                    torch.stack(
                        [*(values[n].float() for n in names), torch.ones_like(row, dtype=torch.float)], 1
                    ),
                )
                table = acc.gather_for_metrics(table).sum(0)
                totals = table if totals is None else totals + table
        model.train()
        metrics = self._eval_means(dict(zip([*names, "units"], totals.tolist(), strict=True)))
        trackers.log_scalars(acc, metrics, step)
        return metrics

    def _eval_means(self, sums: dict[str, float]) -> dict[str, float]:
        return eval_means(sums, paired=self.paired, unit=self.unit)

    @staticmethod
    def held_out(recipe, prepared) -> dict[str, Any]:
        """`finetune eval`'s score of the held-out pairs (kto: examples) with training's batches, forwards
        and losses; the base is every model's reference where the objective has one (a vision-language
        recipe's pairs collated with their pixels by the recipe's processor)."""
        from finetune.model.inference import inference_device
        from finetune.model.vlm import load_processor
        from finetune.objectives.preference_eval import preference_scorer

        processor = load_processor(recipe.model) if recipe.model.kind == "vlm" else None

        def batches(tokenizer):
            return loader(
                recipe.data, recipe.train, prepared.eval, tokenizer, training=False, processor=processor
            )

        name = recipe.train.objective
        score = preference_scorer(batches, name=name, settings=recipe.preference, device=inference_device())
        return {"score": score, "needs_reference": OBJECTIVES[name].reference}

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The adapter (or full model) in Hugging Face format, tokenizer and model card."""
        lm.save_final_lm(self, model, metrics, {"objective": self.name, self.unit: metrics["units"]})
        return []


# ------------------------------------------------------------------------------ the loader


def loader(data, train, rows, tokenizer, *, training: bool, accelerator=None, processor=None):
    """The loader of prepared preference rows (pairs, or kto examples with their KL rows), always
    packed (one pair per row without sample_packing); training's and `finetune eval`'s. With a
    vision-language `processor`, pairs with images come as one padded row per sequence, with pixels
    (finetune.data.batching.vision.collate_vlm_pairs), and kto examples as one padded row each beside their KL
    rows (finetune.data.batching.vision)."""
    from finetune.data.batching.collate import collate_preference
    from finetune.data.batching.vision import KL_COLUMNS, collate_vlm_kto, collate_vlm_pairs, with_kl_rows
    from finetune.model.build import pad_token_id

    pad_id = pad_token_id(tokenizer)
    columns = COLUMNS
    collate = partial(collate_preference, pad_token_id=pad_id, pad_to_multiple_of=data.pad_to_multiple_of)
    if processor is not None:
        columns = (*COLUMNS, "images")
        kto = "prompt_lens" in rows.column_names
        if kto:  # the KL rows rotate completions over the whole split: built before it is shuffled or sharded
            rows = with_kl_rows(rows, max_len=data.sequence_len)
            columns = (*columns, *KL_COLUMNS)
        collate = partial(
            collate_vlm_kto if kto else collate_vlm_pairs,
            pad_token_id=pad_id,
            pad_to_multiple_of=data.pad_to_multiple_of,
            processor=processor,
        )
    return lm.make_loader(
        data, train, rows, pad_id,
        packed=True, training=training, accelerator=accelerator, columns=columns, collate=collate,
    )  # fmt: skip
