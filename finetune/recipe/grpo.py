"""The `grpo` section: online RL with verifiable rewards (train.objective grpo).

The model samples `num_generations` completions per prompt, the rewards score them, each completion's
advantage is its reward against its group's, and a clipped policy-gradient loss (finetune.losses.
policy_gradient, TRL's loss types) trains on them. Every field shapes what is sampled or trained,
so all are fixed on resume.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from finetune.recipe.base import Problem, Regex, _Section
from finetune.recipe.tools import (
    ToolSpec,
    max_tool_calls_field,
    tool_timeout_field,
    tools_field,
    tools_problems,
)

BUILTIN_REWARDS = ("exact_match", "math_verify", "format", "length")
# What each built-in reward reads besides the completion: the recipe fields it needs, and those it
# may take (a field set for a reward that does not read it is an error, never ignored).
_REWARD_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "exact_match": (("field_expected",), ("answer_pattern",)),
    "math_verify": (("field_expected",), ()),
    "format": (("pattern",), ()),
    "length": ((), ("soft_cache",)),
}
_OPTIONAL = ("field_expected", "answer_pattern", "pattern", "soft_cache")
_MODEL_FIELDS = ("batch_size", "field_prompt")  # read by reward models only


class RewardSpec(_Section):
    """One reward: a built-in by `name`, any importable function by `function`, or a trained reward model
    by `model`, and its weight."""

    name: Literal["exact_match", "math_verify", "format", "length"] | None = Field(
        None,
        description="A built-in reward: exact_match (1 when the answer extracted from the completion equals "
        "the row's field_expected, as the eval metric extracts it), math_verify (1 when Hugging Face's "
        "math-verify finds them equal; pip install math-verify), format (1 when the completion matches "
        "`pattern`, a regex searched in the whole completion), length (DAPO's soft overlong penalty: 0 up to "
        "max_new_tokens - soft_cache tokens, then falling linearly to -1 at max_new_tokens).",
    )
    function: str | None = Field(
        None,
        description="A reward function `module:function` (importable, e.g. from the recipe's folder) or "
        "`path/to/file.py:function`, called as function(completions, rows) -> list of floats: completions "
        "are the decoded texts, rows the prompt rows (every column of the data) they answer.",
    )
    model: str | None = Field(
        None,
        description="A trained reward model: a train.objective reward run's output_dir (the model, or its LoRA "
        "adapter), or a Hub id of a one-label sequence-classification model. It scores the prompt and the "
        "completion as text, rendered with its own tokenizer's chat template when it has one (the prompt as a "
        "user turn, the completion as the assistant's), else as prompt + completion; so its tokenizer may "
        "differ from the policy's. It runs on the rollout's device; logged as reward/<its folder name>.",
    )
    weight: float = Field(
        1.0, description="Weight of this reward in the total (the advantages use the total)."
    )
    batch_size: int = Field(8, ge=1, description="model: completions scored per forward of the reward model.")
    field_prompt: str | None = Field(
        None,
        description="model: the prompt rows' column holding the prompt the reward model reads (a string or a "
        "list of messages; default: the prompt entries' field_prompt).",
    )
    field_expected: str | None = Field(
        None, description="exact_match, math_verify: the data column holding the expected answer."
    )
    answer_pattern: Regex | None = Field(
        None,
        description="exact_match: regex whose first group is the answer (default: GSM8K's `#### 42`, else the "
        "last number in the text).",
    )
    pattern: Regex | None = Field(None, description="format: the regex a well-formed completion matches.")
    soft_cache: int | None = Field(
        None,
        ge=1,
        description="length: tokens before max_new_tokens where the penalty starts (DAPO's L_cache).",
    )

    @property
    def label(self) -> str:
        """How the reward is named in logs: the built-in's name, the function's name (`digits` for
        rewards.py:digits), or the reward model's folder name (`rm` for outputs/rm)."""
        if self.model is not None:
            return self.model.rstrip("/").rpartition("/")[2] or self.model
        return self.name or str(self.function).rpartition(":")[2]

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if not ok("name", "function", "model"):
            return problems
        if [self.name, self.function, self.model].count(None) != 2:
            problems.append(
                (
                    "name",
                    self.name,
                    "give exactly one of name (a built-in reward), function or model (a trained reward model)",
                )
            )
            return problems
        if self.model is None:
            for field in _MODEL_FIELDS:
                if ok(field) and getattr(self, field) != type(self).model_fields[field].default:
                    problems.append((field, getattr(self, field), "is read by model rewards only; remove it"))
        if self.model is not None or self.function is not None:
            set_fields = [f for f in _OPTIONAL if ok(f) and getattr(self, f) not in (None, False)]
            problems += [
                (f, getattr(self, f), "is read by built-in rewards only; remove it") for f in set_fields
            ]
        if self.model is not None:
            return problems
        if self.function is not None:
            module, _, attr = self.function.rpartition(":")
            if not module or not attr.isidentifier():
                problems.append(
                    ("function", self.function, "write it as module:function or path/to/file.py:function")
                )
            return problems
        needed, allowed = _REWARD_FIELDS[self.name]
        for name in needed:
            if ok(name) and getattr(self, name) is None:
                problems.append((name, None, f"the {self.name} reward needs it"))
        for name in _OPTIONAL:
            if name not in needed + allowed and ok(name) and getattr(self, name) not in (None, False):
                problems.append(
                    (name, getattr(self, name), f"the {self.name} reward does not read it; remove it")
                )
        return problems


VLLM_FIELDS = (
    "vllm_gpu_memory_utilization", "vllm_max_model_len", "vllm_enable_sleep_mode",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
)  # fmt: skip


class GrpoSection(_Section):
    fixed_on_resume: ClassVar[bool] = True

    num_generations: int = Field(
        8,
        ge=2,
        description="Completions sampled per prompt (the group whose rewards make the advantages). A step "
        "trains on train.micro_batch_size x gradient_accumulation_steps completions per process, which must "
        "be a multiple of it.",
    )
    max_new_tokens: int = Field(
        256, ge=1, description="Longest completion; longer ones are cut (and counted)."
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature (also applied to the trained log-probs)."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens holding top_p."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0 = all).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "rloo"] = Field(
        "dapo",
        description="TRL's loss types: grpo (per-completion token means), dr_grpo (token sums over "
        "max_new_tokens), dapo (token mean over the step's completion tokens), bnpo (token mean per micro-batch), "
        "rloo (one clipped ratio per completion, the exp of its summed token log-ratios, averaged over "
        "completions: TRL's RLOOTrainer; the default of train.objective rloo).",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL term to the reference (the base with adapters disabled, or a frozen copy "
        "for full fine-tuning); 0 = no reference forward at all.",
    )
    kl_bias_correction: bool = Field(
        True, description="Multiply the KL estimate by the importance ratio (TRL's use_bias_correction_kl)."
    )
    kl_in_reward: bool = Field(
        False,
        description="Pay beta x each completion's KL to the reference (the sum of its tokens' log(policy / "
        "reference), at sampling time) out of its reward before the advantages, instead of a per-token KL term "
        "in the loss (RLOO, Ahmadian et al. 2024; the default of train.objective rloo).",
    )
    epsilon: float = Field(
        0.2, gt=0, lt=1, description="Clipping of the probability ratio below (and above)."
    )
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clipping (DAPO's clip-higher, e.g. 0.28); null = epsilon."
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps on each batch of rollouts (GRPO's mu); >1 computes old log-probs.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide advantages by the std of the group's rewards, of the step's rewards (batch), or not "
        "(none, Dr. GRPO).",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_new_tokens out of the loss (DAPO)."
    )
    generation_backend: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="transformers (CPU and GPU; the training model generates) or vllm (CUDA GPUs: one vLLM engine "
        "per process sharing its GPU, synced with the trained weights after every update; pip install -e "
        '".[vllm]").',
    )
    share_prompts: bool = Field(
        True,
        description="Pack each prompt once per micro-batch with its completions after it, each completion attending "
        "to the prompt's one copy through a tree-shaped attention mask, instead of one prompt copy per completion: "
        "the same log-probs (tested equal to the copy-per-completion rows and to TRL's padded batches) for fewer "
        "tokens through the model in the training and log-prob passes (about half on the SmolLM2 word problems: "
        "benchmarks/RESULTS.md). Used with SDPA and eager attention on text models; flash attention (which reads "
        "only sequence boundaries) and vision-language models keep a copy per completion. (Generation is apart: "
        "the transformers backend always computes a prompt's KV cache once for its num_generations completions.)",
    )
    merged_generation: bool | None = Field(
        None,
        description="transformers: with LoRA, generate from the adapters merged into a copy of the adapted weights "
        "(PEFT's safe merge; the original weights are put back bit for bit after every generate call): decoding "
        "runs the plain layers, for one more copy of the adapted weights while it samples (the planner counts it) "
        "and a pass over them per call. null (default): merged where the model is on the CPU, where the rollout "
        "took 7-21% less time in GRPO runs on 2 cores (benchmarks/RESULTS.md, GRPO step time), not on a GPU, "
        "for the memory of the copy; true / false: always / never. Ignored where PEFT cannot merge that way "
        "(QLoRA's 4-bit base, DoRA, sharded weights).",
    )
    generation_dtype: Literal["bfloat16", "float16"] | None = Field(
        None,
        description="transformers: sample the rollouts (and the in-run held-out answers) from a copy of the "
        "weights in this dtype, the adapters merged in, made for every generate call while training keeps its "
        "own dtype: on a CPU with AVX-512 BF16 the decode step reads half the bytes (benchmarks/RESULTS.md, GRPO "
        "step time). The sampler's log-probs are kept and the gap to the trainer's is corrected by the "
        "vllm_importance_sampling_* settings, as for vLLM (logged as sampling/logp_gap). A copy of every weight "
        "in this dtype while sampling; refused for QLoRA's 4-bit base and for weights sharded by ZeRO-3 / FSDP. "
        "null: sample with the training weights' own dtype.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        description="vllm: the share of each GPU the vLLM engine takes for its weights and KV cache (the rest is "
        "training's).",
    )
    vllm_max_model_len: int | None = Field(
        None,
        ge=1,
        description="vllm: the longest prompt + completion the engine holds; null = data.sequence_len + "
        "max_new_tokens.",
    )
    vllm_enable_sleep_mode: bool = Field(
        False,
        description="vllm: free the engine's KV cache while training steps run (slower generation starts, more "
        "memory for training).",
    )
    vllm_importance_sampling_correction: bool = Field(
        True,
        description="vllm: correct the gap between vLLM's sampling log-probs and the trainer's with importance "
        "weights (TRL's vllm_importance_sampling_correction).",
    )
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = Field(
        "token_truncate",
        description="vllm: the importance weight per token or per completion, truncated at the cap or set to 0 "
        "above it (TRL's vllm_importance_sampling_mode).",
    )
    vllm_importance_sampling_cap: float = Field(
        3.0,
        gt=0,
        description="vllm: the largest importance weight (TRL's vllm_importance_sampling_clip_max).",
    )
    sharded_generation: Literal["gather", "layerwise"] = Field(
        "gather",
        description="A model sharded by ZeRO-3 or FSDP generates with its weights gathered whole on every process "
        "for the rollout (gather: one whole copy per process while it samples, at full speed), or one layer at a "
        "time (layerwise: for weights that do not fit whole; every generated token gathers every layer, so it is "
        "slow).",
    )
    async_rollouts: bool = Field(
        False,
        description="Sample the next step's completions in the background while this step trains, on a copy of "
        "the policy one step old (one more copy of the weights in memory); the clipped ratio to the sampling "
        "copy's log-probs corrects the staleness. The first step of a run and of each epoch samples in step.",
    )
    generation_batch_size: int = Field(
        8, ge=1, description="Prompts per generate call (each with its num_generations completions)."
    )
    log_completions: int = Field(
        2,
        ge=0,
        description="Sampled completions with their rewards written to progress.jsonl per logged step.",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="The rewards, summed by weight (at least one, unless an environment gives the reward).",
    )
    reward_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="Seconds a reward function (`function:`) may take on a step's completions. The functions run "
        "in a worker process (as tools do): a hung one is stopped, its completions' groups get no advantage that "
        "step, and it is counted (reward_timeouts) and named in a warning; SIGTERM stops a pending call at once. "
        "null: the functions run in the training process, without a timeout (a reward that keeps state there).",
    )
    tools: list[ToolSpec] = tools_field(
        "its completions (the same tools for rloo and every online objective)"
    )
    max_tool_calls: int = max_tool_calls_field()
    tool_timeout_s: float = tool_timeout_field()
    environment: str | None = Field(
        None,
        description="A multi-turn task: `path/to/file.py:Class` (or module:Class), one object made per completion; "
        "reset(row) -> the first user message (null: the row's prompt), then step(assistant_text) -> "
        "(observation, reward, done) after every assistant turn: the observation is the next user turn (not "
        "trained), the rewards add up to the reward `environment` (weight 1, beside grpo.rewards); at most "
        "max_tool_calls turns.",
    )

    @property
    def backend_options(self) -> dict:
        """The generation backend's own settings (finetune.generation.backends.backend_for)."""
        if self.generation_backend != "vllm":
            return {"merge_adapters": self.merged_generation, "dtype": self.generation_dtype}
        return {
            "gpu_memory_utilization": self.vllm_gpu_memory_utilization,
            "max_model_len": self.vllm_max_model_len,
            "enable_sleep_mode": self.vllm_enable_sleep_mode,
        }

    def _tool_problems(self, ok: Callable[..., bool]) -> list[Problem]:
        """What tools and environments cannot do yet: the vLLM backend, and chat tools beside an
        environment (both answer an assistant turn)."""
        problems: list[Problem] = []
        if not ok("tools", "environment", "generation_backend"):
            return problems
        if (self.tools or self.environment) and self.generation_backend == "vllm":
            field = "tools" if self.tools else "environment"
            problems.append(
                (
                    field,
                    getattr(self, field),
                    "with generation_backend vllm is not built yet: use transformers",
                )
            )
        if self.environment is not None and any(t is not None and t.trigger is None for t in self.tools):
            problems.append(
                ("environment", self.environment, "beside chat tools is not built yet (both answer the assistant's "
                 "turns): keep inline tools (with a trigger) only, or no environment")
            )  # fmt: skip
        if self.environment is not None:
            module, _, attr = self.environment.rpartition(":")
            if not module or not attr.isidentifier():
                problems.append(
                    ("environment", self.environment, "write it as path/to/file.py:Class or module:Class")
                )
        labels = [r.label for r in self.rewards if r is not None] if ok("rewards") else []
        if self.environment is not None and "environment" in labels:
            problems.append(
                ("rewards", "environment", "is the environment's reward's name; rename the function")
            )
        return problems

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if ok("generation_backend") and self.generation_backend != "vllm":
            # generation_dtype samples with other numerics than the trainer's: the correction applies
            corrected = ok("generation_dtype") and self.generation_dtype is not None
            for name in VLLM_FIELDS:
                if corrected and name.startswith("vllm_importance_sampling"):
                    continue
                value, default = getattr(self, name), type(self).model_fields[name].default
                if ok(name) and value != default:
                    problems.append(
                        (
                            name,
                            value,
                            "is read by generation_backend: vllm only; remove it or set that backend",
                        )
                    )
        vllm = self.generation_backend == "vllm"
        if ok("generation_dtype", "generation_backend") and vllm and self.generation_dtype is not None:
            problems.append(
                (
                    "generation_dtype",
                    self.generation_dtype,
                    "is read by generation_backend: transformers only (vLLM loads the weights in its own "
                    "dtype); remove it",
                )
            )
        if ok("merged_generation", "generation_backend") and vllm and self.merged_generation:
            problems.append(
                (
                    "merged_generation",
                    True,
                    "is read by generation_backend: transformers only (vllm is synced with merged weights "
                    "always); remove it",
                )
            )
        problems += tools_problems(
            self.tools, self.max_tool_calls, self.tool_timeout_s, ok, environment=self.environment
        )
        problems += self._tool_problems(ok)
        if ok("rewards", "environment") and not self.rewards and self.environment is None:
            problems.append(
                ("rewards", [], "give at least one reward (or an environment, whose rewards count)")
            )
        if ok("rewards"):
            labels = [r.label for r in self.rewards if r is not None]
            for label in sorted({x for x in labels if labels.count(x) > 1}):
                problems.append(
                    (
                        "rewards",
                        label,
                        "two rewards log under the same name; use functions (or reward model folders) with "
                        "different names",
                    )
                )
        rloo_kl = ok("loss_type", "beta", "kl_in_reward") and self.loss_type == "rloo" and self.beta > 0
        if rloo_kl and not self.kl_in_reward:
            problems.append(
                ("kl_in_reward", False, "loss_type rloo has no per-token KL term: set kl_in_reward: true")
            )
        if (
            ok("loss_type", "generation_backend", "generation_dtype", "vllm_importance_sampling_mode")
            and self.loss_type == "rloo"
            and (self.generation_backend == "vllm" or self.generation_dtype is not None)
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode.startswith("token")
        ):
            problems.append(
                (
                    "vllm_importance_sampling_mode",
                    self.vllm_importance_sampling_mode,
                    "loss_type rloo weighs whole completions: use sequence_truncate or sequence_mask",
                )
            )
        if ok("async_rollouts", "num_iterations") and self.async_rollouts and self.num_iterations > 1:
            problems.append(
                (
                    "async_rollouts",
                    True,
                    "reuses no rollout: set num_iterations: 1 (or async_rollouts: false)",
                )
            )
        if (
            ok("async_rollouts", "generation_backend")
            and self.async_rollouts
            and self.generation_backend == "vllm"
        ):
            problems.append(
                (
                    "async_rollouts",
                    True,
                    "with generation_backend vllm is not built yet (the staleness and vLLM's own numerics would "
                    "need one correction, not two): use async_rollouts with the transformers backend, or vllm in step",
                )
            )
        if (
            ok("epsilon", "epsilon_high")
            and self.epsilon_high is not None
            and self.epsilon_high < self.epsilon
        ):
            problems.append(("epsilon_high", self.epsilon_high, f"is below epsilon ({self.epsilon})"))
        return problems


def function_file_problems(section: GrpoSection | None, folder: Path, *, name: str = "grpo") -> list[str]:
    """`path: problem` lines for each reward `function: file.py:fn` whose file is neither beside the recipe
    (`folder`) nor in the current folder, as finetune.generation.rewards looks for it: said by
    `finetune validate`, without importing anything (importing would run the user's code)."""
    if section is None:
        return []
    problems = []
    for i, reward in enumerate(section.rewards):
        module = str(reward.function or "").rpartition(":")[0]
        if not module.endswith(".py"):
            continue
        candidates = [Path(module)] if Path(module).is_absolute() else [folder / module, Path.cwd() / module]
        if not any(c.is_file() for c in candidates):
            looked = " or ".join(str(c) for c in dict.fromkeys(candidates))
            problems.append(
                f"{name}.rewards[{i}].function: got {reward.function!r}: the file {module} does not exist (looked "
                f"for {looked}); give the path relative to the recipe's folder"
            )
    return problems
