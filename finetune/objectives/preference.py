"""Preference tuning of a causal LM: DPO, IPO, SimPO, ORPO (on pairs) and KTO (on labelled examples).

The data are prepared rows of pairs (finetune.data.preference): chosen_0, rejected_0, chosen_1, ...
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
images in both rows (finetune.data.vision.collate_vlm_pairs), so the same per-sequence sums come from
per-row sums, and the policy, the reference and the precomputed log-probs all see the images. Its kto
examples come the same way, one padded row each, with their KL rows beside them (`kl_` keys, the same
pixels: finetune.data.vision_kto).

KTO's reference point is TRL's: the KL estimate from mismatched completions (each packed row's KL
row, finetune.data.preference.kto_kl_row; with images, each example's prompt and the previous
example's completion in the prepared split, finetune.data.vision_kto), detached, averaged over
processes and clamped at 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

import finetune.objectives.lm as lm
from finetune import trackers
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.losses import preference as losses
from finetune.losses.causal_lm import forward
from finetune.objectives.reference import Reference, reference_source
from finetune.recipe.lora import modifies_base
from finetune.recipe.objectives import OBJECTIVES

# Columns of prepared preference rows the loaders read (finetune.data.preference).
COLUMNS = (
    "input_ids",
    "labels",
    "position_ids",
    "seq_lens",
    "num_units",
    "desirable",
    "prompt_lens",
    "row_index",
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
        from finetune.data.prepare import prepare_on_main_process
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
            return _per_row(batch["num_units"], heads, tails, paired=self.paired)

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

    def _sequences_per_row(self, batch: dict) -> torch.Tensor:
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
        from finetune.data.loader import seq_stats

        seq_sq, seq = seq_stats(batch)
        real = _real_tokens(batch, self._sequences_per_row(batch))
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

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The adapter (or full model) in Hugging Face format, tokenizer and model card."""
        lm.save_final_lm(self, model, metrics, {"objective": self.name, self.unit: metrics["units"]})
        return []


# ------------------------------------------------------------------ the arithmetic, shared with eval
# Module functions so that `finetune eval` (finetune.evaluation.preference) scores held-out pairs with
# exactly the numbers training logs.


def loader(data, train, rows, tokenizer, *, training: bool, accelerator=None, processor=None):
    """The loader of prepared preference rows (pairs, or kto examples with their KL rows), always
    packed (one pair per row without sample_packing); training's and `finetune eval`'s. With a
    vision-language `processor`, pairs with images come as one padded row per sequence, with pixels
    (finetune.data.vision.collate_vlm_pairs), and kto examples as one padded row each beside their KL
    rows (finetune.data.vision_kto)."""
    from finetune.data.collate import collate_preference
    from finetune.data.vision import collate_vlm_pairs
    from finetune.data.vision_kto import KL_COLUMNS, collate_vlm_kto, with_kl_rows
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


def policy_logps(model, batch: dict, *, name: str, settings) -> tuple:
    """A forward of `model` on a packed batch (or a vision-language batch, one sequence per row):
    (per-sequence completion log-prob sums, their token counts, ORPO's batch-NLL sums and counts over
    every token of the chosen sequences, or None)."""
    labels, position_ids = batch["labels"], batch.get("position_ids")  # None: one sequence per row
    num_sequences = batch["num_units"] * (2 if OBJECTIVES[name].kind == "paired" else 1)
    logits = forward(model, _model_inputs(batch)).logits
    orpo_batch_nll = name == "orpo" and settings.orpo_nll_reduction == "batch"
    if orpo_batch_nll:  # TRL's NLL term scores the prompt too: one log-prob per real token
        real = _real_tokens(batch, num_sequences)
        token_logps = losses.token_logps(logits, batch["input_ids"].masked_fill(~real, -100))
    else:
        token_logps = losses.token_logps(logits, labels)
    total = int(num_sequences.sum())  # sync point (sequence_sums has one anyway)
    sums, counts = losses.sequence_sums(token_logps, labels != -100, position_ids, num_sequences=total)
    nll = None
    if orpo_batch_nll:
        all_sums, all_counts = losses.sequence_sums(token_logps, real, position_ids, num_sequences=total)
        nll = (all_sums[0::2], all_counts[0::2])
    return sums, counts, nll


def completion_logps(model, batch: dict, *, paired: bool, kl: bool = False) -> torch.Tensor:
    """Per-sequence completion log-prob sums of a packed batch (kto's KL rows with `kl`), no gradient
    taken here: the caller decides (a reference pass wraps it in no_grad)."""
    inputs = _kl_inputs(batch) if kl else batch
    logits = forward(model, _model_inputs(inputs)).logits
    num_sequences = int(batch["num_units"].sum()) * (2 if paired and not kl else 1)
    return _completion_sums(logits, inputs, num_sequences)


@dataclass
class SequenceScores:
    """What a preference loss reads from a micro-batch: per-sequence completion log-prob sums (pairs
    interleaved chosen, rejected; kto: one per example), their token counts, ORPO's batch NLL (or
    None), the reference's sums `ref` (dpo, ipo, kto), kto's labels and reference point `z0`."""

    sums: torch.Tensor
    counts: torch.Tensor
    nll: tuple | None = None
    ref: torch.Tensor | None = None
    desirable: torch.Tensor | None = None
    z0: torch.Tensor | None = None

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log-prob sums of the pairs."""
        return self.sums[0::2], self.sums[1::2]

    @property
    def ref_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) log-prob sums."""
        return self.ref[0::2], self.ref[1::2]

    @property
    def count_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) completion token counts."""
        return self.counts[0::2], self.counts[1::2]


def _dpo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    smoothing = {"label_smoothing": settings.label_smoothing, "smoothing": settings.dpo_smoothing}
    return losses.dpo_loss(*s.pair, *s.ref_pair, beta=settings.beta, **smoothing)


def _ipo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    return losses.ipo_loss(*s.pair, *s.ref_pair, *s.count_pair, beta=settings.beta)


def _simpo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    margin = {"gamma": settings.simpo_gamma, "label_smoothing": settings.label_smoothing}
    return losses.simpo_loss(*s.pair, *s.count_pair, beta=settings.beta, **margin)


def _orpo(s: SequenceScores, settings) -> losses.PreferenceLoss:
    nll = s.nll if s.nll is not None else (s.pair[0], s.count_pair[0])
    return losses.orpo_loss(
        *s.pair, *s.count_pair, *nll, beta=settings.beta, nll_reduction=settings.orpo_nll_reduction
    )


def _kto(s: SequenceScores, settings) -> losses.PreferenceLoss:
    return losses.kto_loss(
        s.sums, s.ref, s.desirable, s.z0,
        beta=settings.beta, desirable_weight=settings.kto_desirable_weight,
        undesirable_weight=settings.kto_undesirable_weight,
    )  # fmt: skip


LOSSES: dict[str, Callable[[SequenceScores, Any], losses.PreferenceLoss]] = {
    "dpo": _dpo,
    "ipo": _ipo,
    "simpo": _simpo,
    "orpo": _orpo,
    "kto": _kto,
}
"""Each preference objective's per-pair (kto: per-example) losses, by name (the objective table's)."""


def unit_values(
    out: losses.PreferenceLoss, desirable: torch.Tensor | None, z0: torch.Tensor | None, *, paired: bool
) -> dict[str, torch.Tensor]:
    """Per-unit values whose sums are averaged (over units, or over a `count:` sum)."""
    if paired:
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        return {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/accuracies": (chosen > rejected).float(),
            "rewards/margins": chosen - rejected,
            "logps/chosen": out.chosen_logps,
            "logps/rejected": out.rejected_logps,
        }
    values = {"kl": z0.expand(len(desirable))}
    for side, mask, rewards, logps in (
        ("chosen", desirable, out.chosen_rewards, out.chosen_logps),
        ("rejected", ~desirable, out.rejected_rewards, out.rejected_logps),
    ):
        for name, picked in ((f"rewards/{side}", rewards), (f"logps/{side}", logps)):
            values[name] = torch.zeros(len(mask), device=mask.device).masked_scatter(mask, picked.float())
            values[f"count:{name}"] = mask.float()
    return values


def eval_means(sums: dict[str, float], *, paired: bool, unit: str) -> dict[str, float]:
    """eval_<name> means from sums over units (`units`) or over their own `count:<name>`."""
    sums = dict(sums)
    units = sums.pop("units")
    out = {}
    for name, total in sums.items():
        if name.startswith("count:"):
            continue
        count = sums.get(f"count:{name}", units)
        if count > 0:
            out[f"eval_{name}"] = total / count
    if not paired and "eval_rewards/chosen" in out and "eval_rewards/rejected" in out:
        out["eval_rewards/margins"] = out["eval_rewards/chosen"] - out["eval_rewards/rejected"]
    out[f"eval_{unit}"] = int(units)
    return out


# ------------------------------------------------------------------------------------------ helpers


# Batch keys that are not model inputs (a vision-language batch passes every other key: pixels, masks).
_NOT_MODEL_INPUTS = {"labels", "num_units", "row_index", "desirable", "seq_lens"}


def _model_inputs(batch: dict) -> dict:
    if "position_ids" not in batch:  # a vision-language batch: padded rows, attention mask and pixels
        return {k: v for k, v in batch.items() if k not in _NOT_MODEL_INPUTS and not k.startswith("kl_")}
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}


def _kl_inputs(batch: dict) -> dict:
    """Kto's KL rows in place of the rows (same layout: one KL sequence per example); a vision-language
    batch's KL rows bring their attention mask, pixels and image-token types (every `kl_` key)."""
    if "position_ids" not in batch:
        return {k.removeprefix("kl_"): v for k, v in batch.items() if k.startswith("kl_")}
    return {k: batch[f"kl_{k}"] for k in ("input_ids", "labels", "position_ids")}


def _completion_sums(logits: torch.Tensor, inputs: dict, num_sequences: int) -> torch.Tensor:
    """Per-sequence sums of the completion tokens' log-probs of a packed batch (row-major)."""
    token_logps = losses.token_logps(logits, inputs["labels"])
    mask = inputs["labels"] != -100
    return losses.sequence_sums(token_logps, mask, inputs.get("position_ids"), num_sequences=num_sequences)[0]


def _real_tokens(batch: dict, num_sequences: torch.Tensor) -> torch.Tensor:
    """Tokens of a row's real sequences (not its padding, which forms segments after them; a
    vision-language batch's rows are one sequence each, its attention mask says which tokens are real)."""
    if "position_ids" not in batch:
        return batch["attention_mask"].bool()
    position_ids = batch["position_ids"]
    starts = position_ids == 0
    starts[:, 0] = True
    segment = torch.cumsum(starts, dim=1) - 1
    return segment < num_sequences.to(segment.device)[:, None]


def _per_row(
    num_units: torch.Tensor, heads: torch.Tensor, tails: torch.Tensor | None, *, paired: bool
) -> list:
    """Split a batch's row-major per-sequence values by row: 2 x units values each (pairs: chosen and
    rejected in turn; kto: the examples, then their KL sequences)."""
    units = num_units.tolist()
    per_head = [2 * n for n in units] if paired else units
    rows = list(torch.split(heads, per_head))
    if tails is not None:
        rows = [torch.cat([h, t]) for h, t in zip(rows, torch.split(tails, units), strict=True)]
    return rows
