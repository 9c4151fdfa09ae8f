"""A reward model trained on preference pairs (train.objective reward), as TRL's RewardTrainer trains one.

The model is the base with a one-output score head (transformers' AutoModelForSequenceClassification,
num_labels 1, built by finetune.model.build with `head="score"`): full fine-tuning, or LoRA of PEFT's task
type SEQ_CLS, which trains the score head whole (modules_to_save). A score head the base's weights do not
hold is drawn from train.seed (finetune.model.build.init_score_head), so `finetune eval` can give the base
the same one.

The data are the prepared rows of the preference objectives (finetune.data.batching.pairs): chosen_0,
rejected_0, chosen_1, ... packed with position_ids restarting at every sequence, so one forward scores
every sequence of a micro-batch; a pair is never split. A sequence's reward is the score head at its last
token that is not the pad token (finetune.losses.reward.sequence_scores: transformers' pooling, per
sequence), read from one forward of the model as the engine wraps it.

The loss is TRL's Bradley-Terry loss, per pair -log sigmoid(r_chosen - r_rejected - margin) plus
reward.center_rewards_coefficient * (r_chosen + r_rejected)^2, with the margin from the pairs' margin
column (a preference entry's field_margin) when they have one. Units are pairs: a micro-batch's loss is
the sum of its pair losses divided by the pairs of the whole accumulation window on all processes, so
packing, micro-batch size, accumulation and process count do not change the update. Logged per pair:
accuracy (r_chosen > r_rejected), margin (r_chosen - r_rejected), rewards/chosen, rewards/rejected; the
held-out pairs the same with an eval_ prefix, in training and in `finetune eval` (`held_out`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import finetune.objectives.lm as lm
from finetune import trackers
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.losses.reward import bradley_terry_loss, sequence_scores
from finetune.objectives.preference import loader
from finetune.objectives.preference_scores import real_tokens

METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


class RewardObjective:
    """A reward model (full, LoRA, QLoRA) trained on prepared preference pairs."""

    name = "reward"
    unit = "pairs"
    summary_keys = ("pairs",)

    def __init__(self, recipe):
        lm.start(self, recipe)
        self.settings = recipe.reward
        self.pad_id: int | None = None
        self.prepared: Any = None

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare.build import prepare_on_main_process
        from finetune.model.build import load_tokenizer, pad_token_id

        self.accelerator = accelerator
        self.tokenizer = load_tokenizer(self.model_settings)
        self.pad_id = pad_token_id(self.tokenizer)  # the model's config.pad_token_id too (build_lm)
        # One process per machine prepares; the others wait, however long it takes, then read the cache.
        self.prepared = prepare_on_main_process(self.recipe, accelerator)
        self.manifest = self.prepared.manifest
        kind = self.manifest.get("kind", "sft")
        if kind != "preference":
            raise FinetuneError(
                f"the prepared dataset at {self.prepared.path} holds {kind} rows, but train.objective reward "
                "trains on preference pairs: use data entries of type preference and prepare again"
            )
        model, self.flops = lm.build_lm(
            self.model_settings, self.lora, self.train, self.tokenizer, accelerator, head="score"
        )
        train_loader = self._loader(self.prepared.train, training=True)
        lm.check_batches(accelerator, train_loader, len(self.prepared.train), self.train.micro_batch_size)
        if self.prepared.eval is not None and len(self.prepared.eval) > 0:
            self.eval_loader = self._loader(self.prepared.eval, training=False)
        lm.finish_build(self, accelerator, held_out=self.eval_loader is not None)
        return Parts(
            model=model,
            train_loader=train_loader,
            manifest=self.manifest,
            loraplus_lr_ratio=self.lora.loraplus_lr_ratio,
        )

    def _loader(self, rows, *, training: bool):
        return loader(
            self.data, self.train, rows, self.tokenizer, training=training, accelerator=self.accelerator
        )

    def on_prepared(self, accelerator, model) -> None:
        """The model's config for FLOPs and the eval loader sharded; no state besides the engine's."""
        self.flops["config"] = accelerator.unwrap_model(model).config
        if self.eval_loader is not None:
            # Sharded by Accelerate, after the model (DeepSpeed wants that order).
            self.eval_loader = accelerator.prepare(self.eval_loader)
        return None

    def after_update(self, model) -> None:
        """Nothing to do after an applied update."""

    # ------------------------------------------------------------------------------------ step

    def units(self, batch: dict) -> torch.Tensor:
        return batch["num_units"].sum()

    def loss(self, model, batch: dict, num_units: torch.Tensor) -> tuple[torch.Tensor, dict]:
        center = self.settings.center_rewards_coefficient
        values = pair_values(model, batch, center_rewards_coefficient=center, pad_token_id=self.pad_id)
        losses = values.pop("loss")
        return losses.sum() / num_units, {name: v.detach().sum() for name, v in values.items()}

    def counts(self, batch: dict) -> dict[str, float]:
        from finetune.data.batching.loader import seq_stats

        seq_sq, seq = seq_stats(batch)
        real = real_tokens(batch, 2 * batch["num_units"])
        return {
            "tokens": int(real.sum()),
            "seq_sq": seq_sq,
            "seq": seq,
            "pairs": int(batch["num_units"].sum()),
        }

    def log_fields(self, interval: dict[str, float], elapsed: float, totals: dict[str, float]) -> dict:
        """tokens/s (real tokens: prompts counted in both sequences of a pair, no padding), pairs of the
        applied steps on all processes and per second, TFLOP/s and MFU."""
        units = interval.get("units", 0)
        return {
            **lm.throughput_fields(self.accelerator, self.flops, interval, elapsed, totals),
            "pairs": units,
            "pairs_per_sec": units / elapsed,
        }

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """The loss and the pair metrics over the held-out pairs, prefixed eval_."""
        return lm.evaluate_lm(self, model, step, self._eval_pairs if self.eval_loader is not None else None)

    def _eval_pairs(self, model, step: int) -> dict[str, Any]:
        acc = self.accelerator
        model.eval()
        try:
            metrics = held_out_means(
                model, self.eval_loader, center_rewards_coefficient=self.settings.center_rewards_coefficient,
                pad_token_id=self.pad_id, gather=acc.gather_for_metrics,
            )  # fmt: skip
        finally:
            model.train()
        trackers.log_scalars(acc, metrics, step)
        return metrics

    @staticmethod
    def held_out(recipe, prepared) -> dict[str, Any]:
        """`finetune eval`'s score of the held-out pairs with training's batches and metrics, and how its
        models load (as reward models: the recipe's base, a causal LM, with a new score head drawn from
        train.seed, the head training started from; the table says which head each model has)."""
        from accelerate.utils import send_to_device

        from finetune.model.inference import inference_device
        from finetune.model.reward import load_reward_model

        device, new_heads = inference_device(), {}

        def load(path: str, *, tokenizer=None, merge: bool = False):
            net, tokenizer, new = load_reward_model(
                path, tokenizer=tokenizer, merge=merge, new_head_seed=recipe.train.seed, where=path
            )
            new_heads[id(net)] = new
            return net, tokenizer

        def score(name: str, model, tokenizer) -> dict[str, Any]:
            batches = loader(recipe.data, recipe.train, prepared.eval, tokenizer, training=False)
            metrics = held_out_means(
                model, (send_to_device(b, device) for b in batches),
                center_rewards_coefficient=recipe.reward.center_rewards_coefficient,
                pad_token_id=model.config.pad_token_id,
            )  # fmt: skip
            if new_heads.get(id(model)):
                head = f"new, train.seed {recipe.train.seed}"  # training's first head: chance level
            else:
                head = "the base's own" if name == "base" else "trained"
            return {"reward": {**metrics, "score_head": head}}

        return {"score": score, "load": load}

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The reward model (or its adapter) in Hugging Face format, tokenizer and model card."""
        lm.save_final_lm(self, model, metrics, {"objective": self.name, "pairs": metrics["units"]})
        return []


# ---------------------------------------------------------------------------- shared with eval


def pair_values(
    model, batch: dict, *, center_rewards_coefficient: float, pad_token_id: int | None
) -> dict[str, torch.Tensor]:
    """Per pair of a packed batch: the loss (with gradient) and the logged values (chosen and rejected
    rewards, accuracy, margin)."""
    num_sequences = 2 * batch["num_units"]
    scores = sequence_scores(model, batch, num_sequences, pad_token_id=pad_token_id)
    chosen, rejected = scores[0::2], scores[1::2]
    loss = bradley_terry_loss(
        chosen, rejected, margin=batch.get("margin"), center_rewards_coefficient=center_rewards_coefficient
    )
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "loss": loss,
        "accuracy": (chosen > rejected).float(),
        "margin": chosen - rejected,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
    }


def held_out_means(
    model,
    batches: Iterable[dict],
    *,
    center_rewards_coefficient: float,
    pad_token_id: int | None,
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> dict[str, float]:
    """eval_loss and eval_<metric> means over every held-out pair, and eval_pairs, without gradient.
    `gather` collects a table of per-row sums from every process (training's gather_for_metrics; a sync
    point per batch)."""
    names = ("loss", *METRICS)
    totals = torch.zeros(len(names) + 1, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            values = pair_values(
                model, batch, center_rewards_coefficient=center_rewards_coefficient, pad_token_id=pad_token_id
            )
            # Per-row sums: gather_for_metrics drops the rows Accelerate repeated to even the processes.
            units = batch["num_units"].to(values["loss"].device)
            rows = torch.repeat_interleave(torch.arange(len(units), device=units.device), units)
            columns = torch.stack([*(values[n].float() for n in names), torch.ones_like(values["loss"])], 1)
            table = torch.zeros(len(units), len(names) + 1, device=columns.device).index_add_(
                0, rows, columns
            )
            totals += gather(table).sum(0).double().cpu()
    pairs = totals[-1].item()
    metrics = {
        f"eval_{n}": (totals[i].item() / pairs if pairs else float("nan")) for i, n in enumerate(names)
    }
    return {**metrics, "eval_pairs": int(pairs)}
