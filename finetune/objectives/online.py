"""Online RL of a causal LM on prompts with rewards: every objective of kind `online` (GRPO and the
variants of the objective table: its loss types DAPO / Dr. GRPO / BNPO, and its advantage estimator).

Each optimizer step, every process takes its share of the step's prompts (a loader item), and the
rollout (`rollout`, the engine's seam for online objectives; its parts are finetune.objectives.rollout):

1. samples `num_generations` completions per prompt through the generation backend named by the
   section's generation_backend (finetune.generation.backends), each from its own seed;
2. scores them with the rewards, summed by weight;
3. turns rewards into advantages within each prompt's group (every group lives on one process) with
   the objective's estimator (finetune.losses.policy_gradient.ESTIMATORS, named by its row in the
   objective table); `scale_rewards: batch` divides by the std of the step's rewards on all processes;
4. packs the completions into the window's micro-batches: train.micro_batch_size completions per
   micro-batch, each micro-batch one row, padding-free (position_ids restart at every sequence), with
   per-token advantages, and the reference's log-probs (beta > 0) and the sampling policy's
   (num_iterations > 1) computed now, without gradient.

The engine then runs the usual accumulation window over those micro-batches: the per-token clipped
policy-gradient loss (finetune.losses.policy_gradient) summed over the window's units (completions,
tokens or micro-batches, by loss_type) and divided by their number on all processes. With
num_iterations > 1 the loader gives each step's prompts num_iterations times in a row and the rollout
is reused (it is checkpointed with the run, so a resume continues it). After every applied update the
backend syncs its weights from the trained model (`after_update`).

Sharded models (ZeRO-3, FSDP2) generate with their weights gathered whole on every process for the
rollout (finetune.distributed.whole_weights; grpo.sharded_generation: layerwise gathers one layer at a
time instead, for weights that do not fit whole), and a vLLM engine reads them gathered at every sync.

A vision-language model (model.kind vlm) trains the same way on prompts with images: the prompt rows
carry their images' bytes, the backend generates given them (its processor makes the pixels), and each
packed micro-batch carries the pixels of its sequences' prompts in order (`rollout.add_pixels`), which
every log-prob pass (the policy's, the sampling policy's, the reference's) feeds the model.

What was simplified, and why: the sampling policy's log-probs of num_iterations == 1 are the
policy's own, detached (ratio 1, as TRL does).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import torch

import finetune.objectives.lm as lm
import finetune.objectives.rollout as ro
import finetune.objectives.tool_rollout as tr
from finetune import trackers
from finetune.constants import IGNORE_INDEX
from finetune.data.batching.loader import seq_stats
from finetune.distributed import sharding_of, whole_weights
from finetune.engine.objective import Parts
from finetune.errors import FinetuneError
from finetune.generation.backends import backend_for
from finetune.generation.protocol import SamplingParams
from finetune.generation.transformers_backend import eval_mode
from finetune.losses import policy_gradient as pg
from finetune.notices import warn
from finetune.objectives.ahead import AheadRollout, copy_trained_weights, split_lookahead
from finetune.objectives.reference import Reference, reference_source
from finetune.recipe.objectives import OBJECTIVES


class OnlineObjective:
    """An online objective of the table (GRPO, ...) on a transformers causal LM (full, LoRA, QLoRA)."""

    summary_keys = ("trained_completions",)
    batches_per_window = 1  # one loader item per step: this process's prompts (see `rollout`)
    processor = None  # a vision-language model's (model.kind vlm, set in build): prompts with images

    def __init__(self, recipe):
        from finetune.model.build import check_attention_backend

        check_attention_backend(recipe.model.attn_implementation)
        spec = OBJECTIVES[recipe.train.objective]
        self.name, self.section = spec.name, spec.section
        self.estimator = pg.ESTIMATORS[spec.estimator]
        self.recipe = recipe
        self.model_settings, self.lora, self.data, self.train = (
            recipe.model,
            recipe.lora,
            recipe.data,
            recipe.train,
        )
        self.settings, self.eval_settings = getattr(recipe, spec.section), recipe.eval
        per_process = self.train.micro_batch_size * self.train.gradient_accumulation_steps
        self.prompts_per_step = per_process // self.settings.num_generations  # on each process
        source = reference_source(needed=self.settings.beta > 0, precompute=False, lora=self.lora.enable_lora)
        self.reference = Reference(source, objective=self.name, lora=self.lora.enable_lora)
        self.buffer = ro.RolloutBuffer()
        self.backend = None  # the generation backend, made on first use (after a resume loaded the weights)
        # grpo.async_rollouts: the next step's rollout runs in the background on a copy of the policy
        self.ahead = AheadRollout() if self.settings.async_rollouts else None
        self._waits_logged = 0.0
        self.model = None  # the prepared model (the backend is made from it on first use)
        self.rewards: list = []
        self.eval_rows: list[dict] = []
        self.samples: list[dict] = []  # the last rollout's logged completions
        # grpo.tools / grpo.environment, loaded in build (finetune.objectives.tool_rollout)
        self.toolbox = None
        self.message_fields: list[str] = []  # where chat tools and environments read a row's conversation

    # ----------------------------------------------------------------------------------- build

    def build(self, accelerator) -> Parts:
        from finetune.data.prepare.build import prepare_on_main_process
        from finetune.model.build import load_tokenizer

        self.accelerator = accelerator
        self.sharding = sharding_of(accelerator)
        if self.ahead is not None and self.sharding is not None:
            raise FinetuneError(
                f"grpo.async_rollouts: generation in the background needs the whole weights on each process, which "
                f"{self.sharding} shards (gathering them is a collective every process must join at once): set "
                "async_rollouts: false, or use DDP / ZeRO-1/2"
            )
        dtype = getattr(self.settings, "generation_dtype", None)
        if dtype is not None and self.sharding is not None:
            raise FinetuneError(
                f"{self.section}.generation_dtype {dtype}: the copy in {dtype} is made from whole weights, which "
                f"{self.sharding} shards: remove generation_dtype, or use DDP / ZeRO-1/2 (or generation_backend: "
                "vllm, which loads its own copy)"
            )
        if dtype is not None and self.lora.enable_qlora:
            raise FinetuneError(
                f"{self.section}.generation_dtype {dtype}: QLoRA's 4-bit base weights cannot be copied to {dtype} "
                "(they are dequantized on the fly already): remove generation_dtype, or train LoRA on a "
                "bf16/fp32 base"
            )
        if self.model_settings.kind == "vlm":
            from finetune.model.vlm import load_processor

            self.processor = load_processor(self.model_settings)
        self.tokenizer = self.processor.tokenizer if self.processor else load_tokenizer(self.model_settings)
        prepared = prepare_on_main_process(self.recipe, accelerator)
        self.manifest = prepared.manifest
        if self.manifest.get("kind") != "prompt":
            raise FinetuneError(
                f"the prepared dataset at {prepared.path} holds {self.manifest.get('kind', 'sft')} rows, but "
                f"train.objective {self.name} trains on prompts: use data entries of type prompt and prepare again"
            )
        model, self.flops = lm.build_lm(
            self.model_settings, self.lora, self.train, self.tokenizer, accelerator, processor=self.processor
        )
        if self.processor is not None:
            _check_packable(model)
        self.reference.attach(model, accelerator)
        self.rewards = ro.rewards_for(
            self.settings, self.tokenizer, recipe_path=_recipe_path(self.recipe), device=accelerator.device,
            prompt_fields=ro.prompt_fields(self.data), section=self.section,
        )  # fmt: skip
        for split in (prepared.train, prepared.eval):
            if split is not None:
                ro.check_reward_columns(self.settings.rewards, split, section=self.section)
                limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
                ro.check_lengths(split, self.settings.max_new_tokens, limit, section=self.section)
        path = _recipe_path(self.recipe)
        self.toolbox = tr.toolbox_for(self.settings, self.tokenizer, recipe_path=path, section=self.section)
        self.message_fields = tr.message_fields(self.data.datasets, self.toolbox, section=self.section)
        train_loader = ro.prompt_loader(
            prepared.train,
            prompts_per_step=self.prompts_per_step,
            repeat=self.settings.num_iterations,
            lookahead=self.ahead is not None,
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
        self.model = model
        self.flops["config"] = accelerator.unwrap_model(model).config
        self.reference.to(accelerator.device)
        self._warn_generation_dtype_unused(accelerator.unwrap_model(model), accelerator)
        # A rollout reused over num_iterations steps, or made ahead for the next step, is part of the
        # run's state: a resume continues it.
        if self.ahead is not None:
            return {"rollout_ahead": self.ahead}
        return {"rollout": self.buffer} if self.settings.num_iterations > 1 else None

    def _warn_generation_dtype_unused(self, unwrapped, accelerator) -> None:
        """generation_dtype on weights already in that dtype without LoRA copies nothing: sampling is as
        without it, and the correction weights only measure a gap of zero."""
        dtype = getattr(self.settings, "generation_dtype", None)
        if dtype is None or self.lora.enable_lora:
            return
        if all(p.dtype == getattr(torch, dtype) for p in unwrapped.parameters() if p.is_floating_point()):
            warn(
                f"{self.section}.generation_dtype {dtype}: the weights are in {dtype} already, so sampling is "
                f"unchanged (nothing is copied); remove generation_dtype, or load the model in float32 "
                f"(model.torch_dtype fp32) to sample from a {dtype} copy",
                emit=accelerator.print,
            )

    def _backend(self):
        """The generation backend, made on first use: after a resume has loaded the trained weights, so an
        engine with its own copy (vLLM) starts from them. With async_rollouts the transformers backend
        generates with a copy of the policy, which training does not touch while it samples."""
        if self.backend is None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            options = dict(self.settings.backend_options)
            if "max_model_len" in options and options["max_model_len"] is None:
                options["max_model_len"] = self.data.sequence_len + self.settings.max_new_tokens
            generator = unwrapped
            if self.ahead is not None and self.settings.generation_backend == "transformers":
                generator = copy.deepcopy(unwrapped)  # memory: one more copy of the model
            with whole_weights(self.model, self.accelerator) if self.sharding else contextlib.nullcontext():
                self.backend = backend_for(
                    self.settings.generation_backend, generator, self.tokenizer, processor=self.processor,
                    **options,
                )  # fmt: skip
        return self.backend

    def after_update(self, model) -> None:
        """The generation backend generates with the updated weights from the next rollout on (an engine
        with its own copy reads them whole: gathered from their shards, on every process). A rollout
        running ahead finishes first: it samples with the weights of the step before."""
        if self.backend is None:
            return  # made from the current weights on first use
        unwrapped = self.accelerator.unwrap_model(model)
        if self.ahead is not None:
            self.ahead.wait()
        if self.ahead is not None and not self.backend.copies_weights:
            copy_trained_weights(unwrapped, self.backend.model)  # the background copy
        elif self.backend.copies_weights:
            with whole_weights(model, self.accelerator):
                self.backend.sync_weights(unwrapped)
        else:
            self.backend.sync_weights(unwrapped)

    def on_stop_signal(self, name: str) -> None:
        """SIGTERM / SIGINT (finetune.engine.loop.StopFlag, in the signal handler): a reward or tool call
        waiting in its worker ends now, and later ones answer at once (as timeouts), so the step ends
        soon and the run checkpoints; the loop then stops."""
        runners = [getattr(r.fn, "runner", None) for r in self.rewards]
        runners.append(self.toolbox.runner if self.toolbox is not None else None)
        for runner in runners:
            if runner is not None:
                runner.stop()

    # --------------------------------------------------------------------------------- rollout

    def rollout(self, model, items: list, *, step: int) -> tuple[list[dict], dict[str, float]]:
        """The window's micro-batches from this process's prompts (see the module docstring)."""
        prompts, upcoming = split_lookahead(items[0]) if self.ahead is not None else (items[0], [])
        key = [int(row["row_index"]) for row in prompts]
        reused = self.buffer.take(key, self.settings.num_iterations)
        if reused is not None:
            return reused, {}
        settings = self.settings
        made = self.ahead.take(key) if self.ahead is not None else None
        if made is None:  # synchronous: the first step of a run or an epoch, or without async_rollouts
            with self._generation_weights(model):
                made = self._sample(prompts, step)
        if upcoming:  # the next step's prompts, sampled while this step trains (with these weights)
            later = [int(row["row_index"]) for row in upcoming]
            self.ahead.start(later, lambda: self._sample(upcoming, step + 1))
        batches = made["batches"]
        self._fill_log_probs(model, batches)
        kl = None  # RLOO's KL term: each completion's sum of log(old / ref), paid out of its reward
        if settings.kl_in_reward and settings.beta > 0:
            kl = ro.completion_sums(batches, lambda b: b["old_logps"] - b["ref_logps"])
        # A reward that timed out left NaN (grpo.reward_timeout_s): those completions' groups train no
        # advantage this step (set to 0 after the estimator), and they count as 0 in the reward means.
        failed = made["total"].isnan()
        total = made["total"].nan_to_num(0.0)
        per_reward = made["per_reward"].nan_to_num(0.0)
        trained_reward = total if kl is None else total - settings.beta * kl
        tokens = None  # an estimator weighing completions by their trained tokens gets their counts
        if self.estimator in pg.TOKEN_WEIGHTED:
            tokens = ro.completion_sums(batches, lambda b: (b["labels"] != IGNORE_INDEX).float())
        advantages, flat_groups = self._advantages(trained_reward, tokens)
        if failed.any():
            group = settings.num_generations
            advantages = advantages.masked_fill(failed.view(-1, group).any(1).repeat_interleave(group), 0.0)
        ro.set_advantages(batches, advantages)
        if settings.num_iterations > 1:  # reused on the next steps (and checkpointed)
            self.buffer.keep(key, batches)
        self._keep_samples(
            prompts, made["texts"], per_reward, total, step, made.get("calls"), made.get("prompts")
        )
        tools = made.get("tools") or {}
        stats = self._rollout_stats(
            per_reward, total, flat_groups, made["lengths"], made["finished"], kl,
            tools | {"reward_timeouts_sum": float(failed.sum())},
        )  # fmt: skip
        if self.ahead is not None:  # the time training waited for the background rollout since the last step
            stats["rollout_wait_seconds"] = self.ahead.wait_seconds - self._waits_logged
            self._waits_logged = self.ahead.wait_seconds
        return batches, stats

    def _sample(self, prompts: list[dict], step: int) -> dict[str, Any]:
        """Sample, score and pack one step's completions (no collective: it may run in the background).
        With async_rollouts the old log-probs are the sampling copy's, in eval mode as it sampled (the
        policy the completions came from); the result holds tensors, texts and numbers only (it is
        checkpointed when it was made ahead)."""
        settings, group, backend = self.settings, self.settings.num_generations, self._backend()
        params = SamplingParams(
            max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
            top_p=settings.top_p, top_k=settings.top_k, num_return_sequences=group,
        )  # fmt: skip
        how = {"seed": self.train.seed, "step": step, "batch_size": settings.generation_batch_size}
        tools = {}  # with tools in the loop: the step's tool figures
        if self.toolbox is None:
            completions = ro.sample(backend, prompts, params, **how)
        else:
            completions, tools = tr.sample(
                backend, prompts, params, toolbox=self.toolbox, fields=self.message_fields, **how
            )
        rows = [json.loads(row["row"]) for row in prompts for _ in range(group)]
        texts, per_reward, total = ro.score(self.rewards, backend, completions, rows)
        sequences = [  # a completion made with tools carries its prompt (an environment's makes a new one)
            (list(getattr(c, "prompt", None) or prompts[k // group]["input_ids"]), c.ids, c.finished, 0.0)
            for k, c in enumerate(completions)
        ]
        batches = ro.pack_completions(
            sequences,
            per_batch=self.train.micro_batch_size,
            pad_token_id=self._pad_id(),
            pad_to_multiple_of=self.data.pad_to_multiple_of,
            mask_truncated=settings.mask_truncated_completions,
            sampling_logps=self._sampling_logps(completions),
            own=[getattr(c, "own", None) for c in completions],
            share_prompts=self._share_prompts(),
        )
        if self.processor is not None:  # each micro-batch's pixels: its sequences' prompts' images
            per_prompt = ro.prompt_images(prompts) or [[] for _ in prompts]
            ro.add_pixels(batches, [per_prompt[k // group] for k in range(len(completions))], self.processor)
        if self.ahead is not None:
            sampler = backend.model
            with eval_mode(sampler):
                for batch in batches:
                    inputs = ro.logp_inputs(batch, self.accelerator.device)
                    batch["old_logps"] = self._token_logps(sampler, inputs).cpu()
        return {
            "batches": batches,
            "texts": texts,
            "per_reward": per_reward,
            "total": total,
            "lengths": torch.tensor([len(c.ids) for c in completions], dtype=torch.float32),
            "finished": torch.tensor([c.finished for c in completions]),
            "tools": tools,
            "calls": tr.samples(completions[: self.settings.log_completions]) if tools else [],
            # with tools, the prompt each logged completion continued (an environment's first message)
            "prompts": [
                self.tokenizer.decode(c.prompt, skip_special_tokens=True)
                for c in completions[: self.settings.log_completions]
            ]
            if tools
            else [],
        }

    def _share_prompts(self) -> bool:
        """grpo.share_prompts where the model's attention takes the tree mask (rollout.shares_prompts);
        a vision-language model's rows keep a prompt copy (and its pixels) per completion."""
        model = getattr(self, "model", None)  # None before on_prepared (and in unit tests without a build)
        return self.settings.share_prompts and self.processor is None and ro.shares_prompts(model)

    def _sampling_logps(self, completions) -> list[list[float]] | None:
        """The engine's sampling log-probs, kept for the importance-sampling correction (vLLM, or the
        transformers backend's copy in grpo.generation_dtype); None where the training model sampled
        (its log-probs are the trainer's) or the correction is off."""
        corrected = getattr(self.settings, "vllm_importance_sampling_correction", False)
        if not corrected or any(c.logprobs is None for c in completions):
            return None
        return [c.logprobs for c in completions]

    def _pad_id(self) -> int:
        from finetune.model.build import pad_token_id

        return pad_token_id(self.tokenizer)

    def _advantages(
        self, rewards: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator's advantages of this process's completions (`tokens`: their trained-token counts,
        for an estimator that weighs by them). With scale_rewards batch, over the step's rewards on all
        processes (gathered in process order, every process's share equal: a sync point), then this
        process's slice."""
        settings, acc = self.settings, self.accelerator
        everyone = settings.scale_rewards == "batch" and acc.num_processes > 1

        def gathered(values: torch.Tensor) -> torch.Tensor:
            return acc.gather(values.to(acc.device)).float().cpu() if everyone else values

        extra = {} if tokens is None else {"tokens": gathered(tokens)}
        advantages, flat = self.estimator(
            gathered(rewards), num_generations=settings.num_generations, scale_rewards=settings.scale_rewards,
            **extra,
        )  # fmt: skip
        if everyone:
            mine = slice(acc.process_index * len(rewards), (acc.process_index + 1) * len(rewards))
            advantages, flat = advantages[mine], flat[mine]
        return advantages, flat

    def _fill_log_probs(self, model, batches: list[dict]) -> None:
        """The reference's log-probs (beta > 0) and the sampling policy's (num_iterations > 1, or a KL
        term in the reward; async_rollouts made them with the sampling copy) of every completion token,
        without gradient, before any update on this rollout."""
        settings, acc = self.settings, self.accelerator
        old_needed = self.ahead is None and (
            settings.num_iterations > 1 or (settings.kl_in_reward and settings.beta > 0)
        )
        if settings.beta == 0 and not old_needed:
            return
        for batch in batches:
            inputs = ro.logp_inputs(batch, acc.device)
            if old_needed:
                with torch.no_grad():
                    batch["old_logps"] = self._token_logps(model, inputs).detach().cpu()
            if settings.beta > 0:
                with self.reference.model(model, acc) as reference:
                    batch["ref_logps"] = self._token_logps(reference, inputs).detach().cpu()

    def _token_logps(self, model, batch: dict) -> torch.Tensor:
        return ro.token_logps_at(model, batch, temperature=self.settings.temperature)

    def _rollout_stats(
        self, per_reward, total, flat_groups, lengths, finished, kl=None, tools=None
    ) -> dict[str, float]:
        """Sums over all processes (one reduce): the logging interval averages them in log_fields. The
        tool figures' counts are summed too; their seconds are this process's (as rollout_seconds)."""
        group = self.settings.num_generations
        local = {
            "completions": float(len(lengths)),
            "reward_sum": float(total.sum()),
            "reward_sq_sum": float((total**2).sum()),
            "groups": float(len(lengths) // group),
            "zero_std_groups": float(flat_groups[::group].sum()),
            "completion_length_sum": float(lengths.sum()),
            "clipped_completions": float((~finished).sum()),
        }
        if kl is not None:
            local["reward_kl_sum"] = float(kl.sum())
        tools = tools or {}
        local |= {k: v for k, v in tools.items() if k.endswith("_sum")}
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
        stats |= {k: v for k, v in tools.items() if k.endswith("_seconds")}
        return stats

    def _keep_samples(self, prompts, texts, per_reward, total, step: int, calls=None, shown=None) -> None:
        """The first log_completions completions with their rewards (and, with tools, each call with the
        result inserted), for progress.jsonl and the trackers (this process's; the main process logs)."""
        count = self.settings.log_completions
        if not count:
            return
        group = self.settings.num_generations
        self.samples = [
            {
                "prompt": shown[k]
                if shown
                else self.tokenizer.decode(prompts[k // group]["input_ids"], skip_special_tokens=True),
                "completion": texts[k],
                "reward": float(total[k]),
                **{f"reward/{r.name}": float(per_reward[k, i]) for i, r in enumerate(self.rewards)},
                **({"tool_calls": calls[k]} if calls else {}),
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
            return (batch["labels"] != IGNORE_INDEX).sum()
        return torch.ones((), dtype=torch.long)

    def loss(self, model, batch: dict, num_units: torch.Tensor) -> tuple[torch.Tensor, dict]:
        settings = self.settings
        mask = batch["labels"] != IGNORE_INDEX
        logps = self._token_logps(model, batch)[mask]
        stale = (
            settings.num_iterations > 1 or self.ahead is not None
        )  # sampled by another policy than this one
        old = batch["old_logps"][mask] if stale else logps.detach()
        weights, sampling_metrics = self._sampling_weights(batch, mask, old)
        index, num_sequences = batch["seq_index"][mask], int(batch["num_sequences"].sum())
        if settings.loss_type == "rloo":  # one ratio per completion, no KL term in the loss
            out = pg.sequence_loss(
                logps, old, batch["advantages"][mask], index, num_sequences,
                epsilon_low=settings.epsilon, epsilon_high=settings.epsilon_high or settings.epsilon,
                sampling_weights=weights,
            )  # fmt: skip
        else:
            beta = 0.0 if settings.kl_in_reward else settings.beta  # kl_in_reward: paid in the reward
            out = pg.per_token_loss(
                logps, old, batch["advantages"][mask],
                epsilon_low=settings.epsilon, epsilon_high=settings.epsilon_high or settings.epsilon,
                beta=beta, ref_logps=batch["ref_logps"][mask] if beta else None,
                kl_bias_correction=settings.kl_bias_correction, sampling_weights=weights,
            )  # fmt: skip
        total = pg.policy_loss_sums(
            out.losses, index, num_sequences,
            loss_type=settings.loss_type, max_completion_length=settings.max_new_tokens,
        )  # fmt: skip
        clip_units = out.low_clipped.new_tensor(float(out.low_clipped.numel()), dtype=torch.float)
        metrics = {  # over tokens, or over completions for a sequence-level loss
            "clip_ratio/low": out.low_clipped.float().sum(),
            "clip_ratio/high": out.high_clipped.float().sum(),
            "count:clip_ratio/low": clip_units,
            "count:clip_ratio/high": clip_units,
        }
        if out.kl is not None:
            metrics |= {"kl": out.kl.sum(), "count:kl": mask.sum().float()}
        return total / num_units, metrics | sampling_metrics

    def _sampling_weights(self, batch: dict, mask: torch.Tensor, old: torch.Tensor) -> tuple:
        """The importance weights that correct sampling with another engine's numerics (vLLM's
        log-probs in the batch), and the mismatch logged every step (means over the completion tokens):
        the absolute log-prob gap between the trainer and the sampler, the weights, and the share of
        tokens whose weight the cap changed (truncated, or 0 in a *_mask mode)."""
        if "sampling_logps" not in batch:
            return None, {}
        settings = self.settings
        sampled = batch["sampling_logps"][mask].to(old.dtype)
        index, num_sequences = batch["seq_index"][mask], int(batch["num_sequences"].sum())
        mode = settings.vllm_importance_sampling_mode
        weights = pg.importance_weights(
            old.detach(), sampled, index, num_sequences, mode=mode, cap=settings.vllm_importance_sampling_cap
        )
        raw = pg.importance_weights(old.detach(), sampled, index, num_sequences, mode=mode, cap=None)
        known = ~torch.isnan(sampled)
        tokens = torch.tensor(float(weights.numel()), device=weights.device)
        return weights, {
            "sampling/logp_gap": (old.detach() - sampled).abs()[known].sum(),
            "count:sampling/logp_gap": known.sum().float(),
            "sampling/importance_weight": weights.sum(),
            "count:sampling/importance_weight": tokens,
            "sampling/capped": (~torch.isclose(weights, raw)).float().sum(),
            "count:sampling/capped": tokens,
        }

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
        if "rollout_wait_seconds" in interval:  # async_rollouts: training waiting for the background rollout
            fields["rollout_wait_seconds"] = interval["rollout_wait_seconds"]
        return (
            fields
            | ro.rollout_fields(interval, self.rewards)
            | ({"completions_sample": self.samples} if self.samples else {})
        )

    # ------------------------------------------------------------------------------------ eval

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """The rewards of greedy completions of the held-out prompts (main process), and the
        generation sets' scores."""
        return lm.evaluate_lm(self, model, step, self._eval_rewards if self.eval_rows else None)

    def _generation_weights(self, model):
        """The context the backend generates in: whole weights on every process for a sharded model
        (grpo.sharded_generation: gather), or its layers gathered one at a time (layerwise, with the
        processes' generate loops kept in step); nothing for whole weights. The transformers backend
        generates with the training model; an engine with its own copy (vLLM) needs neither."""
        if self.sharding is None or self._backend().copies_weights:
            return contextlib.nullcontext()
        layerwise = self.settings.sharded_generation == "layerwise"
        self._backend().synced_processes = layerwise and self.accelerator.num_processes > 1
        return whole_weights(model, self.accelerator, gather=not layerwise)

    def _eval_rewards(self, model, step: int) -> dict[str, Any]:
        acc, metrics = self.accelerator, {}
        # A sharded model generates on every process together (the gathers are collectives); the main
        # process logs. Whole weights: the main process alone.
        if acc.is_main_process or self.sharding is not None:
            with self._generation_weights(model):
                metrics = ro.eval_rewards(
                    self._backend(), self.eval_rows, self.rewards,
                    max_new_tokens=self.settings.max_new_tokens, batch_size=self.eval_settings.batch_size,
                    complete=self._completer(self._backend(), self.toolbox, self.eval_settings.batch_size),
                )  # fmt: skip
            trackers.log_scalars(acc, metrics, step)
        acc.wait_for_everyone()
        return metrics

    def _completer(self, backend, toolbox, batch_size: int):
        """The held-out completions' maker with the tools in the loop (None: plain greedy generation)."""
        if toolbox is None:
            return None
        return tr.completer(backend, toolbox, batch_size=batch_size, fields=self.message_fields)

    @staticmethod
    def held_out(recipe, prepared) -> dict[str, Any]:
        """`finetune eval`'s score of the held-out prompts: greedy completions of every model, scored by
        the recipe's rewards (transformers generation: evaluation has no training model to sync from)."""
        from finetune.model.inference import inference_device

        section = OBJECTIVES[recipe.train.objective].section
        settings, rows = getattr(recipe, section), list(prepared.eval)
        processor = None  # a vision-language model's: the prompts' images become pixels, as in training
        if recipe.model.kind == "vlm":
            from finetune.model.vlm import load_processor

            processor = load_processor(recipe.model)

        def score(model_name: str, model, tokenizer) -> dict[str, Any]:
            tokenizer = processor.tokenizer if processor is not None else tokenizer
            rewards = ro.rewards_for(
                settings, tokenizer, recipe_path=_recipe_path(recipe), device=inference_device(),
                prompt_fields=ro.prompt_fields(recipe.data), section=section,
            )  # fmt: skip
            backend = backend_for("transformers", model, tokenizer, processor=processor)
            toolbox = tr.toolbox_for(settings, tokenizer, recipe_path=_recipe_path(recipe), section=section)
            complete = None
            if toolbox is not None:  # the tools in the loop, as in training
                fields = tr.message_fields(recipe.data.datasets, toolbox)
                complete = tr.completer(backend, toolbox, batch_size=recipe.eval.batch_size, fields=fields)
            try:
                figures = ro.eval_rewards(
                    backend, rows, rewards, max_new_tokens=settings.max_new_tokens,
                    batch_size=recipe.eval.batch_size, complete=complete,
                )  # fmt: skip
            finally:
                if toolbox is not None:
                    toolbox.close()
            return {"rewards": figures}

        return {"score": score}

    # ------------------------------------------------------------------------------------ save

    def save(self, model, metrics: dict[str, Any]) -> list[Path]:
        """The adapter (or full model) in Hugging Face format, tokenizer and model card."""
        lm.save_final_lm(self, model, metrics, {"objective": self.name, "completions": metrics["units"]})
        return []


def _check_packable(model) -> None:
    """The rollout packs a micro-batch's completions in one row: a vision-language family whose positions
    come from the images (a multimodal RoPE: Qwen2-VL) would need each sequence's positions computed apart,
    which the rollout does not do yet."""
    from finetune.model.families import family_for

    family = family_for(getattr(model, "config", model))
    if family.rope_per_row:
        raise FinetuneError(
            f"model.kind vlm: online RL packs each micro-batch's completions in one row, and {family.name}'s "
            "multimodal RoPE takes its positions from the whole row's images, which packed sequences would get "
            "wrong; this family trains with sft, the preference objectives and kto for now"
        )


def _recipe_path(recipe) -> str | None:
    """The recipe file's path, if known (relative reward files are looked up beside it)."""
    return getattr(recipe, "source_path", None)
