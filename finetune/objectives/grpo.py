"""GRPO: online RL of a causal LM with verifiable rewards (and TRL's DAPO / Dr. GRPO / BNPO losses).

Each optimizer step, every process takes its share of the step's prompts (a loader item), and the
rollout (`rollout`, the engine's seam for online objectives):

1. samples `grpo.num_generations` completions per prompt with the training model
   (finetune.generation.sampling.generate_ids), each from a generator seeded by (train.seed, the
   step, the prompt's row, the completion's index): a resumed run samples the same completions,
   whatever the batching;
2. scores them with the rewards (finetune.generation.rewards), summed by weight;
3. turns rewards into advantages within each prompt's group (every group lives on one process);
   `scale_rewards: batch` divides by the std of the step's rewards on all processes;
4. packs the completions into the window's micro-batches: train.micro_batch_size completions per
   micro-batch, each micro-batch one row, padding-free (position_ids restart at every sequence), with
   per-token advantages, and the reference's log-probs (grpo.beta > 0) and the sampling policy's
   (grpo.num_iterations > 1) computed now, without gradient.

The engine then runs the usual accumulation window over those micro-batches: the per-token clipped
policy-gradient loss (finetune.losses.policy_gradient) summed over the window's units (completions,
tokens or micro-batches, by grpo.loss_type) and divided by their number on all processes. With
num_iterations > 1 the loader gives each step's prompts num_iterations times in a row and the rollout
is reused (it is checkpointed with the run, so a resume continues it).

What was simplified, and why: the sampling policy's log-probs of num_iterations == 1 are the
policy's own, detached (ratio 1, as TRL does); generation under FSDP or ZeRO-3 is refused (the
weights would have to be gathered for every generated token) rather than run slowly.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

import finetune.objectives.lm as lm
from finetune import trackers
from finetune.data.loader import seq_stats
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.generation.rewards import build_rewards, score_rewards
from finetune.generation.sampling import decode_completion, generate_ids, stop_token_ids
from finetune.losses import policy_gradient as pg
from finetune.losses.causal_lm import forward
from finetune.losses.preference import token_logps
from finetune.objectives.reference import Reference, reference_source

IGNORE = -100
# Per-token tensors of a rollout micro-batch besides the model inputs (see `pack_completions`).
TOKEN_FIELDS = ("advantages", "seq_index", "old_logps", "ref_logps")


class GRPOObjective:
    """GRPO of a transformers causal LM (full, LoRA, QLoRA) on prompts, with rewards."""

    name = "grpo"
    summary_keys = ("trained_completions",)
    batches_per_window = 1  # one loader item per step: this process's prompts (see `rollout`)

    def __init__(self, recipe):
        from finetune.model.build import check_attention_backend

        check_attention_backend(recipe.model.attn_implementation)
        self.recipe = recipe
        self.model_settings, self.lora, self.data, self.train = (
            recipe.model,
            recipe.lora,
            recipe.data,
            recipe.train,
        )
        self.settings, self.eval_settings = recipe.grpo, recipe.eval
        per_process = self.train.micro_batch_size * self.train.gradient_accumulation_steps
        self.prompts_per_step = per_process // self.settings.num_generations  # on each process
        source = reference_source(needed=self.settings.beta > 0, precompute=False, lora=self.lora.enable_lora)
        self.reference = Reference(source, objective=self.name, lora=self.lora.enable_lora)
        self.buffer = RolloutBuffer()
        self.rewards: list = []
        self.stops: list[int] = []
        self.eval_rows: list[dict] = []
        self.samples: list[dict] = []  # the last rollout's logged completions

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare import prepare_on_main_process
        from finetune.model.build import load_tokenizer

        self.accelerator = accelerator
        _refuse_sharded_generation(accelerator)
        self.tokenizer = load_tokenizer(self.model_settings)
        prepared = prepare_on_main_process(self.recipe, accelerator)
        self.manifest = prepared.manifest
        if self.manifest.get("kind") != "prompt":
            raise FinetuneError(
                f"the prepared dataset at {prepared.path} holds {self.manifest.get('kind', 'sft')} rows, but "
                "train.objective grpo trains on prompts: use data entries of type prompt and prepare again"
            )
        model, self.flops = lm.build_lm(
            self.model_settings, self.lora, self.train, self.tokenizer, accelerator
        )
        self.reference.attach(model, accelerator)
        self.stops = stop_token_ids(self.tokenizer, model)
        self.rewards = rewards_for(self.recipe, self.tokenizer)
        check_reward_columns(self.settings.rewards, prepared.train)
        train_loader = prompt_loader(
            prepared.train,
            prompts_per_step=self.prompts_per_step,
            repeat=self.settings.num_iterations,
            seed=self.train.seed,
            shuffle=self.data.shuffle_merged_datasets,
            drop_last=self.data.dataloader_drop_last,
            accelerator=accelerator,
        )
        lm.check_batches(accelerator, train_loader, len(prepared.train), self.prompts_per_step)
        if prepared.eval is not None and len(prepared.eval) > 0:
            self.eval_rows = list(prepared.eval)
        lm.finish_build(self, accelerator, held_out=bool(self.eval_rows))
        return Parts(
            model=model,
            train_loader=train_loader,
            manifest=self.manifest,
            loraplus_lr_ratio=self.lora.loraplus_lr_ratio,
        )

    def on_prepared(self, accelerator, model) -> dict[str, Any] | None:
        self.flops["config"] = accelerator.unwrap_model(model).config
        self.reference.to(accelerator.device)
        # A rollout reused over num_iterations steps is part of the run's state: a resume continues it.
        return {"rollout": self.buffer} if self.settings.num_iterations > 1 else None

    def after_update(self, model) -> None:
        """Nothing to do after an applied update."""

    # --------------------------------------------------------------------------------- rollout

    def rollout(self, model, items: list, *, step: int) -> tuple[list[dict], dict[str, float]]:
        """The window's micro-batches from this process's prompts (see the module docstring)."""
        (prompts,) = items
        key = [int(row["row_index"]) for row in prompts]
        reused = self.buffer.take(key, self.settings.num_iterations)
        if reused is not None:
            return reused, {}
        settings, acc = self.settings, self.accelerator
        group = settings.num_generations
        seeds = [[completion_seed(self.train.seed, step, k, j) for j in range(group)] for k in key]
        completions = generate_ids(
            acc.unwrap_model(model), self.tokenizer, [list(row["input_ids"]) for row in prompts],
            max_new_tokens=settings.max_new_tokens, batch_size=settings.generation_batch_size,
            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
            num_return_sequences=group, seeds=seeds,
        )  # fmt: skip
        flat = [c for row in completions for c in row]
        texts = [decode_completion(self.tokenizer, c.ids, stops=self.stops) for c in flat]
        rows = [json.loads(row["row"]) for row in prompts for _ in range(group)]
        per_reward = score_rewards(self.rewards, texts, rows)
        total = per_reward @ torch.tensor([r.weight for r in self.rewards])
        advantages, flat_groups = pg.group_advantages(
            total,
            num_generations=group,
            scale_rewards=settings.scale_rewards,
            batch_std=self._batch_std(total),
        )
        sequences = [
            (list(prompts[k // group]["input_ids"]), c.ids, c.finished, float(a))
            for k, (c, a) in enumerate(zip(flat, advantages.tolist(), strict=True))
        ]
        batches = pack_completions(
            sequences,
            per_batch=self.train.micro_batch_size,
            pad_token_id=self._pad_id(),
            pad_to_multiple_of=self.data.pad_to_multiple_of,
            mask_truncated=settings.mask_truncated_completions,
        )
        self._fill_log_probs(model, batches)
        if settings.num_iterations > 1:  # reused on the next steps (and checkpointed)
            self.buffer.keep(key, batches)
        self._keep_samples(prompts, texts, per_reward, total, step)
        return batches, self._rollout_stats(per_reward, total, flat_groups, flat)

    def _pad_id(self) -> int:
        from finetune.model.build import pad_token_id

        return pad_token_id(self.tokenizer)

    def _batch_std(self, total: torch.Tensor) -> torch.Tensor | None:
        """The std of the step's rewards on all processes (scale_rewards: batch); a sync point."""
        if self.settings.scale_rewards != "batch":
            return None
        acc = self.accelerator
        gathered = acc.gather(total.to(acc.device)).float().cpu() if acc.num_processes > 1 else total
        return gathered.std() if gathered.numel() > 1 else torch.zeros(())

    def _fill_log_probs(self, model, batches: list[dict]) -> None:
        """The reference's log-probs (beta > 0) and the sampling policy's (num_iterations > 1) of every
        completion token, without gradient, before any update on this rollout."""
        settings, acc = self.settings, self.accelerator
        if settings.beta == 0 and settings.num_iterations == 1:
            return
        for batch in batches:
            inputs = {k: batch[k].to(acc.device) for k in ("input_ids", "position_ids", "labels")}
            if settings.num_iterations > 1:
                with torch.no_grad():
                    batch["old_logps"] = self._token_logps(model, inputs).detach().cpu()
            if settings.beta > 0:
                with self.reference.model(model, acc) as reference:
                    batch["ref_logps"] = self._token_logps(reference, inputs).detach().cpu()

    def _token_logps(self, model, batch: dict) -> torch.Tensor:
        """log p(token) of every position of a packed row at the sampling temperature (0 where not trained)."""
        logits = forward(
            model, {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        ).logits
        if self.settings.temperature != 1.0:
            logits = logits / self.settings.temperature
        return token_logps(logits, batch["labels"])

    def _rollout_stats(self, per_reward, total, flat_groups, completions) -> dict[str, float]:
        """Sums over all processes (one reduce): the logging interval averages them in log_fields."""
        lengths = torch.tensor([len(c.ids) for c in completions], dtype=torch.float32)
        group = self.settings.num_generations
        local = {
            "completions": float(len(completions)),
            "reward_sum": float(total.sum()),
            "reward_sq_sum": float((total**2).sum()),
            "groups": float(len(completions) // group),
            "zero_std_groups": float(flat_groups[::group].sum()),
            "completion_length_sum": float(lengths.sum()),
            "clipped_completions": float(sum(not c.finished for c in completions)),
        }
        for i, reward in enumerate(self.rewards):
            local[f"reward/{reward.name}_sum"] = float(per_reward[:, i].sum())
            local[f"reward/{reward.name}_sq_sum"] = float((per_reward[:, i] ** 2).sum())
        acc = self.accelerator
        names = sorted(local)
        values = torch.tensor([local[n] for n in names], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            values = acc.reduce(values, reduction="sum")  # sync point
            longest = acc.gather(lengths.max().to(acc.device).reshape(1)).max()
        else:
            longest = lengths.max()
        stats = dict(zip(names, values.tolist(), strict=True))
        stats["max:completion_length"] = float(longest)
        return stats

    def _keep_samples(self, prompts, texts, per_reward, total, step: int) -> None:
        """The first grpo.log_completions completions with their rewards, for progress.jsonl and the
        trackers (this process's; the main process logs)."""
        count = self.settings.log_completions
        if not count:
            return
        group = self.settings.num_generations
        self.samples = [
            {
                "prompt": self.tokenizer.decode(prompts[k // group]["input_ids"], skip_special_tokens=True),
                "completion": texts[k],
                "reward": float(total[k]),
                **{f"reward/{r.name}": float(per_reward[k, i]) for i, r in enumerate(self.rewards)},
            }
            for k in range(min(count, len(texts)))
        ]
        columns = list(self.samples[0]) if self.samples else []
        rows = [[sample[c] for c in columns] for sample in self.samples]
        trackers.log_table(self.accelerator, "train/completions", columns, rows, step)

    # ------------------------------------------------------------------------------------ step

    def units(self, batch: dict) -> torch.Tensor:
        """Completions (grpo, dr_grpo), completion tokens (dapo) or 1 (bnpo) of a micro-batch."""
        unit = pg.UNITS[self.settings.loss_type]
        if unit == "completions":
            return batch["num_sequences"].sum()
        if unit == "tokens":
            return (batch["labels"] != IGNORE).sum()
        return torch.ones((), dtype=torch.long)

    def loss(self, model, batch: dict, num_units: torch.Tensor) -> tuple[torch.Tensor, dict]:
        settings = self.settings
        mask = batch["labels"] != IGNORE
        logps = self._token_logps(model, batch)[mask]
        old = batch["old_logps"][mask] if settings.num_iterations > 1 else logps.detach()
        out = pg.per_token_loss(
            logps, old, batch["advantages"][mask],
            epsilon_low=settings.epsilon, epsilon_high=settings.epsilon_high or settings.epsilon,
            beta=settings.beta, ref_logps=batch["ref_logps"][mask] if settings.beta else None,
            kl_bias_correction=settings.kl_bias_correction,
        )  # fmt: skip
        total = pg.policy_loss_sums(
            out.losses, batch["seq_index"][mask], int(batch["num_sequences"].sum()),
            loss_type=settings.loss_type, max_completion_length=settings.max_new_tokens,
        )  # fmt: skip
        tokens = mask.sum().float()
        metrics = {
            "clip_ratio/low": out.low_clipped.float().sum(),
            "clip_ratio/high": out.high_clipped.float().sum(),
            "count:clip_ratio/low": tokens,
            "count:clip_ratio/high": tokens,
        }
        if out.kl is not None:
            metrics |= {"kl": out.kl.sum(), "count:kl": tokens}
        return total / num_units, metrics

    def counts(self, batch) -> dict[str, float]:
        if not isinstance(batch, dict):  # a window's prompts consumed without rollout (iterations_to_skip)
            return {}
        seq_sq, seq = seq_stats(batch)
        real = int(batch["prompt_tokens"].sum() + batch["completion_tokens"].sum())
        trained = int(batch["num_sequences"].sum())  # this process's (the rollout stats are global)
        return {"tokens": real, "seq_sq": seq_sq, "seq": seq, "trained_completions": trained}

    def log_fields(self, interval: dict[str, float], elapsed: float, totals: dict[str, float]) -> dict:
        """Throughput over the training time (rollout time apart), rewards, lengths and samples."""
        rollout_seconds = interval.get("rollout_seconds", 0.0)
        train_seconds = max(elapsed - rollout_seconds, 1e-9)
        passes = self.reference.forward_passes + (1 if self.settings.num_iterations > 1 else 0)
        fields = lm.throughput_fields(
            self.accelerator, self.flops, interval, train_seconds, totals, forward_passes=passes
        )
        fields |= {"rollout_seconds": rollout_seconds, "train_seconds": train_seconds}
        return (
            fields
            | rollout_fields(interval, self.rewards)
            | ({"completions_sample": self.samples} if self.samples else {})
        )

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """The rewards of greedy completions of the held-out prompts (main process), and the
        generation sets' scores."""
        return lm.evaluate_lm(self, model, step, self._eval_rewards if self.eval_rows else None)

    def _eval_rewards(self, model, step: int) -> dict[str, Any]:
        acc, metrics = self.accelerator, {}
        if acc.is_main_process:
            metrics = eval_rewards(
                acc.unwrap_model(model), self.tokenizer, self.eval_rows, self.rewards,
                max_new_tokens=self.settings.max_new_tokens, batch_size=self.eval_settings.batch_size,
            )  # fmt: skip
            trackers.log_scalars(acc, metrics, step)
        acc.wait_for_everyone()
        return metrics

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The adapter (or full model) in Hugging Face format, tokenizer and model card."""
        lm.save_final_lm(self, model, metrics, {"objective": self.name, "completions": metrics["units"]})
        return []


# ------------------------------------------------------------------------- module functions


def completion_seed(seed: int, step: int, row: int, index: int) -> int:
    """The seed of completion `index` of prompt row `row` at optimizer step `step` (63 bits).

    >>> completion_seed(42, 3, 17, 0) == completion_seed(42, 3, 17, 0) != completion_seed(42, 3, 17, 1)
    True
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{row}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def pack_completions(
    sequences: list[tuple[list[int], list[int], bool, float]],
    *,
    per_batch: int,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
    mask_truncated: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of `per_batch` (prompt ids, completion ids, finished, advantage) sequences, each
    one packed row: position_ids restart at every sequence, labels are the completion tokens (-100 on
    prompts, on padding, and on truncated completions with `mask_truncated`), and per token the
    completion's advantage and index in the micro-batch (-1 outside completions). Padding up to a
    multiple of pad_to_multiple_of forms its own segment.

    >>> b = pack_completions([([1, 2], [3, 4], True, 0.5), ([1], [5], False, -1.0)], per_batch=2, pad_token_id=0)
    >>> b[0]["labels"].tolist(), b[0]["seq_index"].tolist(), b[0]["position_ids"].tolist()
    ([[-100, -100, 3, 4, -100, 5]], [[-1, -1, 0, 0, -1, 1]], [[0, 1, 2, 3, 0, 1]])
    """
    batches = []
    for start in range(0, len(sequences), per_batch):
        ids, labels, positions, advantages, owners = [], [], [], [], []
        prompt_tokens = completion_tokens = 0
        chunk = sequences[start : start + per_batch]
        for k, (prompt, completion, finished, advantage) in enumerate(chunk):
            trained = finished or not mask_truncated
            ids += prompt + completion
            labels += [IGNORE] * len(prompt) + (completion if trained else [IGNORE] * len(completion))
            positions += list(range(len(prompt) + len(completion)))
            advantages += [0.0] * len(prompt) + [advantage] * len(completion)
            owners += [-1] * len(prompt) + ([k] if trained else [-1]) * len(completion)
            prompt_tokens += len(prompt)
            completion_tokens += len(completion)
        pad = -len(ids) % pad_to_multiple_of
        ids += [pad_token_id] * pad
        labels += [IGNORE] * pad
        positions += list(range(pad))
        advantages += [0.0] * pad
        owners += [-1] * pad
        batch = {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "advantages": torch.tensor([advantages]),
            "seq_index": torch.tensor([owners]),
            "num_sequences": torch.tensor([len(chunk)]),
            "prompt_tokens": torch.tensor([prompt_tokens]),
            "completion_tokens": torch.tensor([completion_tokens]),
        }
        batch["old_logps"] = torch.zeros_like(batch["advantages"])
        batch["ref_logps"] = torch.zeros_like(batch["advantages"])
        batches.append(batch)
    return batches


def rollout_fields(interval: dict[str, float], rewards) -> dict[str, float]:
    """Means and stds of an interval's rollout sums (see GRPOObjective._rollout_stats).

    >>> fields = rollout_fields({"completions": 4, "reward_sum": 2, "reward_sq_sum": 2, "groups": 2,
    ...     "zero_std_groups": 1, "completion_length_sum": 40, "clipped_completions": 1, "max:completion_length": 16}, [])
    >>> {k: round(v, 4) for k, v in fields.items()}
    {'reward': 0.5, 'reward_std': 0.5774, 'frac_reward_zero_std': 0.5, 'completion_length': 10.0, 'completion_length_max': 16, 'clipped_ratio': 0.25}
    """
    n = interval.get("completions", 0)
    if not n:
        return {}
    fields = {
        "reward": interval["reward_sum"] / n,
        "reward_std": _std(interval["reward_sum"], interval["reward_sq_sum"], n),
    }
    for reward in rewards:
        total, squares = interval[f"reward/{reward.name}_sum"], interval[f"reward/{reward.name}_sq_sum"]
        fields[f"reward/{reward.name}"] = total / n
        fields[f"reward/{reward.name}_std"] = _std(total, squares, n)
    fields["frac_reward_zero_std"] = interval["zero_std_groups"] / max(interval["groups"], 1)
    fields["completion_length"] = interval["completion_length_sum"] / n
    fields["completion_length_max"] = interval["max:completion_length"]
    fields["clipped_ratio"] = interval["clipped_completions"] / n
    return fields


def _std(total: float, squares: float, n: float) -> float:
    """Sample std (Bessel-corrected, as torch.std) from a sum and a sum of squares."""
    if n < 2:
        return 0.0
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


def eval_rewards(
    model, tokenizer, rows: list[dict], rewards, *, max_new_tokens: int, batch_size: int
) -> dict[str, float]:
    """Greedy completions of held-out prompt rows scored by the rewards: eval_reward (weighted total),
    eval_reward/<name> and eval_completion_length, averaged over the rows."""
    stops = stop_token_ids(tokenizer, model)
    completions = generate_ids(
        model,
        tokenizer,
        [list(r["input_ids"]) for r in rows],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    texts = [decode_completion(tokenizer, c[0].ids, stops=stops) for c in completions]
    per_reward = score_rewards(rewards, texts, [json.loads(r["row"]) for r in rows])
    total = per_reward @ torch.tensor([r.weight for r in rewards])
    fields = {"eval_reward": float(total.mean())}
    fields |= {f"eval_reward/{r.name}": float(per_reward[:, i].mean()) for i, r in enumerate(rewards)}
    fields["eval_completion_length"] = sum(len(c[0].ids) for c in completions) / max(len(completions), 1)
    fields["eval_prompts"] = len(rows)
    return fields


def prompt_loader(
    rows, *, prompts_per_step: int, repeat: int, seed: int, shuffle: bool, drop_last: bool, accelerator
):
    """Loader items of this process's prompts for one step (a list of prepared prompt rows), each
    given `repeat` times in a row (grpo.num_iterations: the rollout is reused)."""
    from finetune.data.sampler import RankBatchSampler, RepeatBatchSampler

    sampler = RankBatchSampler(
        len(rows),
        micro_batch_size=prompts_per_step,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    return torch.utils.data.DataLoader(
        lm.with_row_index(rows).select_columns(["input_ids", "row", "row_index"]),
        batch_sampler=RepeatBatchSampler(sampler, repeat),
        collate_fn=list,
        generator=torch.Generator().manual_seed(seed),
    )


def check_reward_columns(specs, rows) -> None:
    """Each built-in reward's field_expected is a column of the prompt rows (checked on the first)."""
    if len(rows) == 0:
        return
    columns = set(json.loads(rows[0]["row"]))
    for i, spec in enumerate(specs):
        if spec.field_expected is not None and spec.field_expected not in columns:
            raise FinetuneError(
                f"grpo.rewards.{i}.field_expected: the prompt data has no column {spec.field_expected!r} "
                f"(columns: {', '.join(sorted(columns))})"
            )


def _refuse_sharded_generation(accelerator) -> None:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    zero3 = kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3
    if kind == DistributedType.FSDP or zero3:
        raise FinetuneError(
            "train.objective grpo samples with the training model, which FSDP and ZeRO-3 shard (every generated "
            "token would gather all weights): use DDP, ZeRO-1/2, or LoRA on one device per process"
        )


def rewards_for(recipe, tokenizer) -> list:
    """The recipe's grpo.rewards, ready to score: functions imported (beside the recipe first), the
    length reward counting tokens with `tokenizer`."""
    settings = recipe.grpo
    return build_rewards(
        settings.rewards,
        max_new_tokens=settings.max_new_tokens,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        base=recipe_folder(recipe),
    )


def recipe_folder(recipe) -> Path | None:
    """Where the recipe file lives (relative reward files are looked up there), if known."""
    source = getattr(recipe, "source_path", None)
    return Path(source).parent if source else None


class RolloutBuffer:
    """The last rollout's micro-batches, reused for grpo.num_iterations steps; checkpointed (tensors
    and JSON only, finetune.engine.extra_state) so a resumed run continues the same rollout."""

    def __init__(self):
        self.key: list[int] | None = None
        self.uses = 0
        self.batches: list[dict] = []

    def take(self, key: list[int], limit: int) -> list[dict] | None:
        """The kept micro-batches when `key` (the window's prompt rows) is the kept rollout's and it
        was used fewer than `limit` times; None: roll out anew."""
        if self.key == key and 0 < self.uses < limit:
            self.uses += 1
            return [dict(b) for b in self.batches]
        return None

    def keep(self, key: list[int], batches: list[dict]) -> None:
        self.key, self.uses, self.batches = list(key), 1, batches

    def state_dict(self) -> dict:
        return {"key": self.key, "uses": self.uses, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.uses, self.batches = state["key"], state["uses"], state["batches"]
