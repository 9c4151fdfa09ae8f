"""The rollout of online RL, shared by every online objective (finetune.objectives.online) and open to
any objective that trains on sampled completions.

One step's rollout, in the order the objective runs it:

1. `sample`: `num_return_sequences` completions per prompt through a generation backend
   (finetune.generation.protocol), each from a generator seeded by `completion_seed(train.seed, step,
   prompt row, index)`: a resumed run samples the same completions, whatever the batching;
2. `score`: the rewards (finetune.generation.rewards) of every completion, and their weighted total;
3. advantages: an estimator of finetune.losses.policy_gradient (`ESTIMATORS`) on the totals;
4. `pack_completions`: the window's micro-batches, each one padding-free packed row with per-token
   advantages and the completion each token belongs to, a group's prompt once with its completions after
   it where the attention takes a tree mask (grpo.share_prompts, `shares_prompts`); a vision-language
   model's prompts' images go with them (`add_pixels`: each row's pixels, its sequences' images in order);
5. `token_logps_at`: log-probs of every trained token of a packed row (the reference's, the sampling
   policy's), without gradient, before any update on the rollout; only the positions that predict a
   completion token go through the output layer.

Around it: the prompts' loader (`prompt_loader`), the rewards of a recipe (`rewards_for`), the
held-out rewards of greedy completions (`eval_rewards`), the logged figures (`rollout_fields`), and
the buffer that keeps a rollout for grpo.num_iterations steps (`RolloutBuffer`, checkpointed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from finetune.constants import IGNORE_INDEX
from finetune.generation.protocol import Completion, GenerationBackend, SamplingParams
from finetune.generation.rewards import build_rewards, score_rewards
from finetune.generation.tools import completion_text, environment_reward, with_environment_rewards
from finetune.losses.causal_lm import forward
from finetune.losses.preference import label_logps, token_logps
from finetune.model.forward import attention_implementation, keeps_logits


def completion_seed(seed: int, step: int, row: int, index: int) -> int:
    """The seed of completion `index` of prompt row `row` at optimizer step `step` (63 bits).

    >>> completion_seed(42, 3, 17, 0) == completion_seed(42, 3, 17, 0) != completion_seed(42, 3, 17, 1)
    True
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{row}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample(
    backend: GenerationBackend,
    prompts: Sequence[dict],
    params: SamplingParams,
    *,
    seed: int,
    step: int,
    batch_size: int,
) -> list[Completion]:
    """`params.num_return_sequences` completions of each prompt row (its `input_ids` and `row_index`, and
    a vision-language prompt's `images`), flat, group after group, each drawn with its `completion_seed`."""
    group = params.num_return_sequences
    seeds = [[completion_seed(seed, step, int(row["row_index"]), j) for j in range(group)] for row in prompts]
    completions = backend.generate(
        [list(row["input_ids"]) for row in prompts], params, seeds=seeds, batch_size=batch_size,
        images=prompt_images(prompts),
    )  # fmt: skip
    return [c for row in completions for c in row]


def prompt_images(rows: Sequence[dict]) -> list[list[bytes]] | None:
    """Each prompt row's images (bytes, in order), or None when no row has any (a text model's prompts).

    >>> prompt_images([{"images": [b"a"]}, {"images": []}]), prompt_images([{"input_ids": [1]}])
    ([[b'a'], []], None)
    """
    per_row = [list(row.get("images") or []) for row in rows]
    return per_row if any(per_row) else None


def score(
    rewards: list, backend: GenerationBackend, completions: Sequence[Completion], rows: Sequence[dict]
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(decoded texts, every reward of every completion [N, R], their weighted totals [N]); `rows` are
    the data rows the completions answer, one per completion."""
    texts = [completion_text(backend.tokenizer, c, stops=backend.stops) for c in completions]
    with_environment_rewards(rows, completions)  # an environment's rewards, for the reward `environment`
    per_reward = score_rewards(rewards, texts, list(rows))
    total = per_reward @ torch.tensor([r.weight for r in rewards])
    return texts, per_reward, total


def pack_completions(
    sequences: list[tuple[list[int], list[int], bool, float]],
    *,
    per_batch: int,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
    mask_truncated: bool = False,
    sampling_logps: list[list[float]] | None = None,
    own: Sequence[list[bool] | None] | None = None,
    share_prompts: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of `per_batch` (prompt ids, completion ids, finished, advantage) sequences, each
    one packed row: position_ids restart at every sequence, labels are the completion tokens (-100 on
    prompts, on padding, and on truncated completions with `mask_truncated`), and per token the
    completion's advantage and index in the micro-batch (-1 outside completions). Padding up to a
    multiple of pad_to_multiple_of forms its own segment. `sampling_logps` (one list per sequence: the
    log-prob each completion token was sampled with by an engine with its own weights) become the
    per-token `sampling_logps` (NaN elsewhere). `own` (one mask per sequence, or None: all) marks the
    completion tokens the model sampled: the others, inserted by tools (finetune.generation.tools), keep
    their place in the row but get label -100 and no completion index, so no loss and no log-prob of the
    ratio covers them.

    Every row also says where each completion token's logits come from (`logit_source`: the row position
    whose output predicts it, -1 elsewhere), so the log-prob passes project only those positions on the
    vocabulary (`token_logps_at`). With `share_prompts`, a sequence whose prompt equals the one before it
    in the micro-batch (a group's completions) does not repeat it: its completion follows the others, at
    the positions it would have after its prompt, and attends to the prompt's one copy through a
    tree-shaped mask (`segment`: each token's span; `segment_prompt`: the span of its prompt, which it
    also sees; `tree_mask`). The log-probs are the ones of a copy per sequence, for fewer tokens through
    the model.

    >>> b = pack_completions([([1, 2], [3, 4], True, 0.5), ([1], [5], False, -1.0)], per_batch=2, pad_token_id=0)
    >>> b[0]["labels"].tolist(), b[0]["seq_index"].tolist(), b[0]["position_ids"].tolist()
    ([[-100, -100, 3, 4, -100, 5]], [[-1, -1, 0, 0, -1, 1]], [[0, 1, 2, 3, 0, 1]])
    >>> b[0]["logit_source"].tolist()
    [[-1, -1, 1, 2, -1, 4]]
    >>> s = pack_completions([([1, 2], [3, 4], True, 0.5), ([1, 2], [5], True, -1.0)], per_batch=2, pad_token_id=0,
    ...                      share_prompts=True)[0]
    >>> s["input_ids"].tolist(), s["position_ids"].tolist(), s["logit_source"].tolist()
    ([[1, 2, 3, 4, 5]], [[0, 1, 2, 3, 2]], [[-1, -1, 1, 2, 1]])
    >>> s["segment"].tolist(), s["segment_prompt"].tolist()
    ([[0, 0, 1, 1, 2]], [[0, 0, 0, 0, 0]])
    """
    batches = []
    for start in range(0, len(sequences), per_batch):
        ids, labels, positions, advantages, owners, sampled = [], [], [], [], [], []
        sources, segments, segment_prompts = [], [], []
        prompt_tokens = completion_tokens = 0
        chunk = sequences[start : start + per_batch]
        shared = None  # (prompt ids, its segment, the row position of its last token) when sharing
        for k, (prompt, completion, finished, advantage) in enumerate(chunk):
            trained = finished or not mask_truncated
            mine = (own[start + k] if own is not None else None) or [True] * len(completion)
            if not (share_prompts and shared is not None and shared[0] == prompt):
                segment = len(segments) and segments[-1] + 1
                shared = (prompt, segment, len(ids) + len(prompt) - 1)
                ids += prompt
                labels += [IGNORE_INDEX] * len(prompt)
                positions += list(range(len(prompt)))
                advantages += [0.0] * len(prompt)
                owners += [-1] * len(prompt)
                sources += [-1] * len(prompt)
                segments += [segment] * len(prompt)
                segment_prompts += [segment] * len(prompt)
                if sampling_logps is not None:
                    sampled += [math.nan] * len(prompt)
                prompt_tokens += len(prompt)
            if sampling_logps is not None:
                sampled += list(sampling_logps[start + k])
            first = len(ids)
            ids += completion
            labels += [t if trained and m else IGNORE_INDEX for t, m in zip(completion, mine, strict=True)]
            positions += list(range(len(prompt), len(prompt) + len(completion)))
            advantages += [advantage if m else 0.0 for m in mine]
            owners += [k if trained and m else -1 for m in mine]
            sources += [shared[2], *range(first, first + len(completion) - 1)][: len(completion)]
            segments += [segments[-1] + 1] * len(completion)
            segment_prompts += [shared[1]] * len(completion)
            completion_tokens += len(completion)
        pad = -len(ids) % pad_to_multiple_of
        ids += [pad_token_id] * pad
        labels += [IGNORE_INDEX] * pad
        positions += list(range(pad))
        advantages += [0.0] * pad
        owners += [-1] * pad
        sources += [-1] * pad
        segments += [(segments[-1] + 1) if segments else 0] * pad
        segment_prompts += segments[len(segment_prompts) :]
        batch = {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "advantages": torch.tensor([advantages]),
            "seq_index": torch.tensor([owners]),
            "num_sequences": torch.tensor([len(chunk)]),
            "prompt_tokens": torch.tensor([prompt_tokens]),
            "completion_tokens": torch.tensor([completion_tokens]),
            "logit_source": torch.tensor([sources]),
        }
        if share_prompts:
            batch["segment"], batch["segment_prompt"] = (
                torch.tensor([segments]),
                torch.tensor([segment_prompts]),
            )
        batch["old_logps"] = torch.zeros_like(batch["advantages"])
        batch["ref_logps"] = torch.zeros_like(batch["advantages"])
        if sampling_logps is not None:
            batch["sampling_logps"] = torch.tensor([sampled + [math.nan] * pad])
        batches.append(batch)
    return batches


# What pack_completions puts in a micro-batch besides the model's inputs (everything else of a micro-batch,
# input_ids, position_ids and the pixels of `add_pixels`, goes to the model's forward: `model_inputs`).
ROLLOUT_KEYS = frozenset(
    ("labels", "advantages", "seq_index", "num_sequences", "prompt_tokens", "completion_tokens", "old_logps",
     "ref_logps", "sampling_logps", "logit_source", "segment", "segment_prompt")
)  # fmt: skip


def model_inputs(batch: dict) -> dict:
    """The model's inputs of a packed micro-batch: its ids and positions, and a vision-language model's
    pixels (whatever the processor made: pixel_values, pixel_attention_mask, image_grid_thw, ...).

    >>> b = pack_completions([([1], [2], True, 0.0)], per_batch=1, pad_token_id=0)[0]
    >>> sorted(model_inputs(b))
    ['input_ids', 'position_ids']
    """
    return {k: v for k, v in batch.items() if k not in ROLLOUT_KEYS}


# The keys of a micro-batch that `token_logps_at` reads besides the model's inputs.
LOGP_KEYS = ("labels", "logit_source", "segment", "segment_prompt")


def logp_inputs(batch: dict, device) -> dict:
    """What `token_logps_at` needs of a micro-batch (the model's inputs, the labels and the row's layout),
    on `device`.

    >>> b = pack_completions([([1], [2], True, 0.0)], per_batch=1, pad_token_id=0)[0]
    >>> sorted(logp_inputs(b, "cpu"))
    ['input_ids', 'labels', 'logit_source', 'position_ids']
    """
    keys = {**model_inputs(batch), **{k: batch[k] for k in LOGP_KEYS if k in batch}}
    return {k: v.to(device) for k, v in keys.items()}


def add_pixels(batches: list[dict], per_sequence: Sequence[Sequence[bytes]], processor) -> None:
    """Each micro-batch's pixels (in place): the images of its sequences (`per_sequence`, in rollout
    order: each completion's prompt's images, bytes), in order, as one row's images, through the
    processor's image processor as training's collate makes them (finetune.data.batching.vision.image_inputs).
    A packed row holds several sequences: the models place the image features at the image tokens in
    order, so sequence k's features land on sequence k's tokens (a family whose positions come from the
    images, a multimodal RoPE, is refused before: finetune.objectives.online)."""
    from finetune.data.batching.vision import image_inputs
    from finetune.generation.prompts import pictures_of

    start = 0
    for batch in batches:
        n = int(batch["num_sequences"].sum())
        pictures = pictures_of([b for images in per_sequence[start : start + n] for b in images])
        start += n
        batch |= image_inputs(processor, [pictures], batch["input_ids"])


def completion_sums(batches: list[dict], values) -> torch.Tensor:
    """Per completion, in rollout order over the micro-batches, the sum of `values(batch)` (a per-token
    tensor) over its trained tokens.

    >>> b = pack_completions([([1], [3, 4], True, 0.0), ([1], [5], True, 0.0)], per_batch=1, pad_token_id=0)
    >>> completion_sums(b, lambda batch: batch["input_ids"].float()).tolist()
    [7.0, 5.0]
    """
    sums = []
    for batch in batches:
        owners, n = batch["seq_index"], int(batch["num_sequences"].sum())
        trained = owners >= 0
        tokens = values(batch)[trained].double()
        sums.append(torch.zeros(n, dtype=torch.float64).index_add(0, owners[trained], tokens.cpu()))
    return torch.cat(sums).float()


def set_advantages(batches: list[dict], advantages: torch.Tensor) -> None:
    """Write each completion's advantage (rollout order over the micro-batches) on its tokens."""
    start = 0
    for batch in batches:
        n = int(batch["num_sequences"].sum())
        owners = batch["seq_index"]
        mine = advantages[start : start + n].to(batch["advantages"].dtype)
        batch["advantages"] = torch.where(owners >= 0, mine[owners.clamp(min=0)], torch.zeros_like(mine[:1]))
        start += n


def token_logps_at(model, batch: dict, *, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) of every position of a packed row (input_ids, position_ids, labels, and a
    vision-language model's pixels: `model_inputs`) at the sampling temperature, 0 where the label is -100.

    With the row's `logit_source` (pack_completions) and a model that takes transformers' `logits_to_keep`,
    only the positions that predict a scored token go through the output layer (a completion's tokens are
    a fraction of a row that holds its prompt: the vocabulary projection and its softmax are the largest
    single cost of the pass on a small model); a row with shared prompts attends through its `tree_mask`.
    """
    labels = batch["labels"]
    if "logit_source" not in batch or not keeps_logits(model):
        logits = forward(model, model_inputs(batch)).logits
        if temperature != 1.0:
            logits = logits / temperature
        return token_logps(logits, labels)
    scored = labels != IGNORE_INDEX
    inputs = model_inputs(batch)
    if "segment" in batch:
        inputs["attention_mask"] = tree_mask(batch["segment"], batch["segment_prompt"], model)
    sources = batch["logit_source"][scored].view(1, -1)
    logits = forward(model, {**inputs, "logits_to_keep": sources}).logits.view(sources.shape[1], -1)
    if temperature != 1.0:
        logits = logits / temperature
    picked = label_logps(logits, labels[scored])
    out = torch.zeros(labels.shape, dtype=picked.dtype, device=picked.device)
    return out.masked_scatter(scored, picked)


def tree_mask(segment: torch.Tensor, segment_prompt: torch.Tensor, model) -> torch.Tensor:
    """The 4-D attention mask (batch x 1 x T x T) of packed rows with shared prompts: a token sees the
    tokens before it in its own span and in its prompt's span (`pack_completions(share_prompts=True)`).
    Boolean for SDPA (True: attend); eager attention adds its mask, so it gets 0 / the dtype's minimum.

    >>> tree_mask(torch.tensor([[0, 0, 1, 2]]), torch.tensor([[0, 0, 0, 0]]), None)[0, 0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """
    length = segment.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment.device).tril()
    same = segment[:, :, None] == segment[:, None, :]
    prompt = segment_prompt[:, :, None] == segment[:, None, :]
    mask = ((same | prompt) & causal)[:, None]
    if attention_implementation(model) == "eager":
        dtype = getattr(model, "dtype", torch.float32)
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask


def shares_prompts(model) -> bool:
    """Whether a model's packed rows can share their prompts (`tree_mask`): a text causal LM whose attention
    takes a 4-D mask (SDPA, eager) and whose forward takes `logits_to_keep` (the first token of each
    completion is predicted from its prompt's last position, not the row position before it).
    Flash attention reads only sequence boundaries, which a tree does not have."""
    return attention_implementation(model) in ("sdpa", "eager") and keeps_logits(model)


def rollout_fields(interval: dict[str, float], rewards) -> dict[str, float]:
    """Means and stds of an interval's rollout sums (see OnlineObjective._rollout_stats).

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
    if "reward_kl_sum" in interval:  # kl_in_reward: the mean KL each completion's reward paid
        fields["reward_kl"] = interval["reward_kl_sum"] / n
    if interval.get("reward_timeouts_sum"):  # completions a reward timed out on (grpo.reward_timeout_s)
        fields["reward_timeouts"] = interval["reward_timeouts_sum"]
    if "tool_calls_sum" in interval:  # tools in the loop: calls per completion, failures, time apart
        fields["tool_calls"] = interval["tool_calls_sum"] / n
        fields["tool_errors"] = interval["tool_errors_sum"]
        fields["tool_timeouts"] = interval["tool_timeouts_sum"]
        fields["tool_seconds"] = interval["tool_seconds"]
        fields["generation_seconds"] = interval["generation_seconds"]
    return fields


def _std(total: float, squares: float, n: float) -> float:
    """Sample std (Bessel-corrected, as torch.std) from a sum and a sum of squares."""
    if n < 2:
        return 0.0
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


def eval_rewards(
    backend: GenerationBackend,
    rows: list[dict],
    rewards,
    *,
    max_new_tokens: int,
    batch_size: int,
    complete=None,
) -> dict[str, float]:
    """Greedy completions of held-out prompt rows scored by the rewards: eval_reward (weighted total),
    eval_reward/<name> and eval_completion_length, averaged over the rows. `complete(rows, params) ->
    (one completion per row, figures)` makes them another way (tools in the loop:
    finetune.objectives.tool_rollout, whose calls per completion are eval_tool_calls)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    figures = {}
    if complete is None:
        completions = backend.generate(
            [list(r["input_ids"]) for r in rows], params, batch_size=batch_size, images=prompt_images(rows)
        )
        flat = [c[0] for c in completions]
    else:
        flat, figures = complete(rows, params)
    _, per_reward, total = score(rewards, backend, flat, [json.loads(r["row"]) for r in rows])
    # A reward that timed out gave NaN (finetune.generation.rewards.score_rewards): the means are over
    # the completions it scored, and the others are counted.
    fields = {"eval_reward": _mean_known(total)}
    fields |= {f"eval_reward/{r.name}": _mean_known(per_reward[:, i]) for i, r in enumerate(rewards)}
    if total.isnan().any():
        fields["eval_reward_timeouts"] = int(total.isnan().sum())
    fields["eval_completion_length"] = sum(len(c.ids) for c in flat) / max(len(flat), 1)
    fields["eval_prompts"] = len(rows)
    if "tool_calls_sum" in figures:
        fields["eval_tool_calls"] = figures["tool_calls_sum"] / max(len(flat), 1)
    return fields


def _mean_known(values: torch.Tensor) -> float:
    """The mean of the values that are not NaN (0.0 when none is)."""
    known = values[~values.isnan()]
    return float(known.mean()) if len(known) else 0.0


def prompt_loader(
    rows,
    *,
    prompts_per_step: int,
    repeat: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
    accelerator,
    lookahead: bool = False,
):
    """Loader items of this process's prompts for one step (a list of prepared prompt rows), each
    given `repeat` times in a row (grpo.num_iterations: the rollout is reused); with `lookahead`
    (async_rollouts) each item also holds the next step's rows after a None (objectives.ahead)."""
    from finetune.data.batching.sampler import RankBatchSampler, RepeatBatchSampler
    from finetune.objectives.ahead import LookaheadBatchSampler, MarkedRows
    from finetune.objectives.lm import with_row_index

    sampler = RankBatchSampler(
        len(rows),
        micro_batch_size=prompts_per_step,
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    # A vision-language model's prompts bring their images (bytes) along.
    kept = ["input_ids", "row", "row_index", *(["images"] if "images" in rows.column_names else [])]
    dataset = with_row_index(rows).select_columns(kept)
    batches = LookaheadBatchSampler(sampler) if lookahead else RepeatBatchSampler(sampler, repeat)
    return torch.utils.data.DataLoader(
        MarkedRows(dataset) if lookahead else dataset,
        batch_sampler=batches,
        collate_fn=list,
        generator=torch.Generator().manual_seed(seed),
    )


def check_reward_columns(specs, rows, *, section: str = "grpo") -> None:
    """Each built-in reward's field_expected is a column of the prompt rows, and no row leaves it empty
    (a reward would score that row 0 without a word): an error naming the field, the count and the first
    rows."""
    from finetune.errors import FinetuneError

    if len(rows) == 0:
        return
    parsed = [json.loads(row) for row in rows["row"]]
    columns = set(parsed[0])
    for i, spec in enumerate(specs):
        field = spec.field_expected
        if field is None:
            continue
        if field not in columns:
            raise FinetuneError(
                f"{section}.rewards.{i}.field_expected: the prompt data has no column {field!r} "
                f"(columns: {', '.join(sorted(columns))})"
            )
        empty = [k for k, row in enumerate(parsed) if row.get(field) in (None, "")]
        if empty:
            raise FinetuneError(
                f"{section}.rewards.{i}.field_expected: {len(empty)} of {len(parsed)} prompt rows have no "
                f"{field!r} (empty or null; prepared rows {', '.join(map(str, empty[:5]))}"
                f"{', ...' if len(empty) > 5 else ''}), which {spec.label} would score 0 without a word: fill "
                "them in or remove those rows, and prepare again"
            )


def check_lengths(rows, max_new_tokens: int, limit: int | None, *, section: str = "grpo") -> None:
    """The longest prompt plus max_new_tokens fits the model's positions (max_position_embeddings)."""
    from finetune.errors import FinetuneError

    if not limit or len(rows) == 0:
        return
    longest = max(len(ids) for ids in rows["input_ids"])
    if longest + max_new_tokens > limit:
        raise FinetuneError(
            f"{section}.max_new_tokens {max_new_tokens}: the longest prompt ({longest} tokens) plus it exceeds "
            f"the model's {limit} positions (max_position_embeddings): lower max_new_tokens to "
            f"{limit - longest} or less, or keep prompts shorter (data.sequence_len)"
        )


def rewards_for(
    settings, tokenizer, *, recipe_path: str | None, device="cpu", prompt_fields=(), section: str = "grpo"
) -> list:
    """An online section's rewards, ready to score: functions imported (beside the recipe file at
    `recipe_path` first), the length reward counting tokens with `tokenizer`, reward models loaded on
    `device` (reading the prompt from `prompt_fields`, see `prompt_fields`); with an environment, its
    summed rewards as the reward `environment` (weight 1)."""
    from finetune.generation.rewards import Reward

    rewards = build_rewards(
        settings.rewards,
        max_new_tokens=settings.max_new_tokens,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        base=Path(recipe_path).parent if recipe_path else None,
        device=device,
        prompt_fields=prompt_fields,
        section=section,
        timeout_s=getattr(settings, "reward_timeout_s", None),
    )
    if getattr(settings, "environment", None) is not None:
        rewards.append(Reward("environment", 1.0, environment_reward))
    return rewards


def prompt_fields(data) -> tuple[str, ...]:
    """The prompt columns of the data section's prompt entries, in order: where a reward model finds the
    prompt of a row (which keeps every column of its source)."""
    entries = (*data.datasets, *data.test_datasets)
    return tuple(dict.fromkeys(e.field_prompt for e in entries if e.type == "prompt"))


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
