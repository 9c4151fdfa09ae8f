"""The whole recipe: its sections and the rules that span several of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr

from finetune.recipe.base import Problem, _Section
from finetune.recipe.data import IMAGE_DATASET_TYPES, DataSection
from finetune.recipe.diffusion import DiffusionSection
from finetune.recipe.eval import EvalSection, GenerationSet
from finetune.recipe.grpo import GrpoSection
from finetune.recipe.hub import HubSection
from finetune.recipe.lora import DATA_DRIVEN, LoraSection, modifies_base
from finetune.recipe.model import ModelSection
from finetune.recipe.objectives import (
    OBJECTIVES,
    describe,
    objective_settings,
    readers,
    sharing_section,
    trained_on,
)
from finetune.recipe.parallel import parallel_problems
from finetune.recipe.preference import PreferenceSection
from finetune.recipe.reward import RewardSection, reward_problems
from finetune.recipe.streaming import streaming_problems
from finetune.recipe.train import TrainSection

# Fields whose behaviour has not landed yet: a non-default value is rejected with this reason, so
# an accepted field always works (never silently ignored). Paths use `*` for list items.
NOT_SUPPORTED_YET: dict[str, str] = {}


class Recipe(_Section):
    model: ModelSection = Field(description="Base model, tokenizer and attention backend.")
    data: DataSection = Field(description="Datasets, formatting, packing and caching.")
    train: TrainSection = Field(description="Optimisation, checkpoints, evaluation and logging.")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA / QLoRA adapters.")
    hub: HubSection = Field(
        default_factory=HubSection, description="Pushing the result to the Hugging Face Hub."
    )
    eval: EvalSection = Field(
        default_factory=EvalSection,
        description="Generation sets scored by `finetune eval` and during training.",
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection,
        description="Settings of the preference objectives (train.objective dpo, ipo, simpo, orpo, kto).",
    )
    reward: RewardSection = Field(
        default_factory=RewardSection,
        description="Settings of train.objective reward (a reward model trained on preference pairs).",
    )
    grpo: GrpoSection | None = Field(
        None,
        description="Online RL settings (train.objective grpo): sampling, rewards, loss; null otherwise.",
    )
    diffusion: DiffusionSection | None = Field(
        None, description="Diffusion fine-tuning settings (model.kind: diffusion); null for LLM recipes."
    )
    # Notes on settings read from where they used to live (finetune.recipe.moved): said as warnings.
    _moved_settings: list[str] = PrivateAttr(default_factory=list)
    # The YAML file the recipe was read from (files it names, like reward functions, are found beside it).
    _source_path: str | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        # Two recipes are equal when they say the same: where one was read from and which settings it
        # wrote at their old place (the private notes above) do not count.
        return isinstance(other, Recipe) and self.model_dump() == other.model_dump()

    __hash__ = None  # mutable, like every pydantic model

    @property
    def source_path(self) -> str | None:
        """The recipe file this recipe was loaded from (None when built in memory)."""
        return self._source_path

    @property
    def moved_settings(self) -> list[str]:
        """`old moved to new` notes for settings this recipe wrote at their old place."""
        return self._moved_settings

    @moved_settings.setter
    def moved_settings(self, notes: list[str]) -> None:
        self._moved_settings = list(notes)

    def _warnings(self) -> list[Problem]:
        found: list[Problem] = []
        settings = self.preference
        if (
            self.train.objective == "dpo"
            and settings.dpo_smoothing != "conservative"
            and not settings.label_smoothing
        ):
            found.append(
                (
                    "preference.dpo_smoothing",
                    settings.dpo_smoothing,
                    "has no effect without label_smoothing > 0",
                )
            )
        if (
            not self.model.special_tokens.is_empty()
            and self.lora.enable_lora
            and not self.lora.modules_to_save
        ):
            found.append(
                (
                    "lora.modules_to_save",
                    [],
                    "special_tokens resize the embeddings, which LoRA alone does not train (the new tokens "
                    "keep their initial vectors): add the embedding and output layers, e.g. "
                    "[embed_tokens, lm_head]",
                )
            )
        if self.model.kind == "diffusion":
            for path, reason in _IRRELEVANT_FOR_DIFFUSION.items():
                section, name = path.split(".")
                owner = getattr(self, section)
                value = getattr(owner, name)
                if value != type(owner).model_fields[name].get_default(call_default_factory=True):
                    found.append((path, value, f"does nothing in a diffusion recipe ({reason})"))
            if self.diffusion is not None and self.diffusion.adapter == "full":
                for name in ("lora_rank", "lora_alpha", "lora_dropout"):
                    value = getattr(self.lora, name)
                    if value != type(self.lora).model_fields[name].get_default():
                        found.append(
                            (f"lora.{name}", value, "does nothing with diffusion.adapter: full (no adapter)")
                        )
        return found

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems = list(_unsupported_problems(self, ok))
        problems += diffusion_problems(self, ok)
        problems += vision_problems(self, ok)
        problems += objective_problems(self, ok)
        problems += objective_setting_problems(self, ok)
        problems += online_problems(self, ok)
        problems += data_init_problems(self, ok)
        problems += residual_reference_problems(self, ok)
        problems += streaming_problems(self, ok)
        problems += parallel_problems(self, ok)
        problems += reward_problems(self, ok)
        if ok("model.torch_dtype", "train.mixed_precision", "lora.enable_lora", "lora.enable_qlora"):
            problems += _precision_problems(self.model.torch_dtype, self.train.mixed_precision, self.lora)
        if ok("hub.strategy", "hub.model_id") and self.hub.strategy == "every_save" and not self.hub.model_id:
            problems.append(("hub.strategy", "every_save", "set hub.model_id to push checkpoints"))
        return problems


def _precision_problems(dtype: str, precision: str, lora: LoraSection) -> list[Problem]:
    problems: list[Problem] = []
    if precision == "fp16" and dtype == "bf16":
        problems.append(
            ("train.mixed_precision", precision, "fp16 mixed precision with bf16 weights: use bf16 for both")
        )
    if precision == "bf16" and dtype == "fp16":
        problems.append(
            ("train.mixed_precision", precision, "bf16 mixed precision with fp16 weights: use fp16 for both")
        )
    if precision == "fp16" and dtype == "fp16" and not lora.enable_lora:
        problems.append(
            (
                "model.torch_dtype",
                dtype,
                "full fine-tuning with fp16 weights cannot use loss scaling (fp16 gradients); "
                "use torch_dtype: fp32 (or auto) with mixed_precision: fp16",
            )
        )
    if lora.enable_qlora and dtype == "fp32" and precision != "no":
        problems.append(("model.torch_dtype", dtype, "QLoRA computes in 16-bit: use auto, bf16 or fp16"))
    return problems


def _unsupported_problems(recipe: Recipe, ok: Callable[..., bool]) -> Iterator[Problem]:
    """A problem for every NOT_SUPPORTED_YET field set to something other than its default."""
    for pattern, reason in NOT_SUPPORTED_YET.items():
        *owner_parts, name = pattern.split(".")
        for parts, owner in _expand(recipe, owner_parts, ()):
            path = ".".join(map(str, (*parts, name)))
            if not ok(path) or name not in type(owner).model_fields:  # a field of another entry type
                continue
            value = getattr(owner, name)
            if value != type(owner).model_fields[name].get_default(call_default_factory=True):
                yield (path, value, f"not supported yet ({reason}); remove it or use the default")


def _expand(node: Any, parts: list[str], prefix: tuple) -> Iterator[tuple[tuple, BaseModel]]:
    """Follow a dotted pattern (`*` = every list item) from `node`; yield (concrete path, owner)."""
    if node is None:  # a section or item that did not validate (see _salvage)
        return
    if not parts:
        yield prefix, node
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        for i, item in enumerate(node):
            yield from _expand(item, rest, (*prefix, i))
    else:
        yield from _expand(getattr(node, head, None), rest, (*prefix, head))


# Text-only settings: in a diffusion recipe they change nothing, so they are warnings, not errors.
_IRRELEVANT_FOR_DIFFUSION: dict[str, str] = {
    "model.chat_template": "LLM only",
    "model.enable_liger_kernel": "LLM only",
    "data.sequence_len": "LLM only",
    "data.excess_length_strategy": "LLM only",
    "data.sample_packing": "LLM only",
    "data.sample_packing_method": "LLM only",
    "data.sample_packing_sequence_len": "LLM only",
    "data.eval_sample_packing": "LLM only",
    "data.pad_to_multiple_of": "LLM only",
    "eval.generation_sets": "LLM only; diffusion uses diffusion.validation_prompts",
}

# Settings a diffusion recipe cannot honour (a different model part, an unsupported feature, an eval
# split it has no use for): a non-default value is an error, so nothing the user asked for is
# quietly not done. The reason says what to use instead where there is something.
_NOT_FOR_DIFFUSION: dict[str, str] = {
    "model.config_path": "the pipeline folder or Hub id goes in model.model_path",
    "model.tokenizer_path": "the tokenizer comes from the pipeline's tokenizer/ folder",
    "model.trust_remote_code": "diffusion pipelines load without repository code",
    "model.attn_implementation": "the UNet uses diffusers' attention processors",
    "model.enable_compile": "not supported yet for diffusion",
    "data.test_datasets": "no evaluation split for diffusion; use diffusion.validation_prompts",
    "data.val_set_size": "no evaluation split for diffusion; use diffusion.validation_prompts",
    "data.push_dataset_to_hub": "pushing cached latents is not supported yet",
    "lora.modules_to_save": "diffusion trains LoRA adapters only",
    "lora.enable_qlora": "not supported for diffusion",
    "lora.use_dora": "not supported yet for diffusion",
    "lora.use_rslora": "not supported yet for diffusion",
    "lora.init_adapter": "not supported yet for diffusion",
    "lora.save_lora_only": "diffusion saves the LoRA weights (pytorch_lora_weights.safetensors)",
    "train.eval_steps": "no evaluation split for diffusion; use diffusion.validation_steps",
    "train.iterations_to_skip": "not supported yet for diffusion",
    "train.enable_profiling": "not supported yet for diffusion",
}


def diffusion_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """Combinations of model.kind, the diffusion section and the data entries.

    A diffusion recipe without a `diffusion` section gets one with every default, LoRA is implied
    (enable_lora) and the LoRA targets default to the UNet's attention projections: finetune.recipe.
    defaults fills these in before validation (they show in the resolved recipe), so an explicit
    contrary value is what is left here, and it is an error.
    """
    problems: list[Problem] = []
    if not ok("model.kind"):
        return problems
    diffusion = recipe.model.kind == "diffusion"
    for i, entry in enumerate(recipe.data.datasets if ok("data.datasets") else []):
        if entry is None:
            continue
        if diffusion and entry.type not in IMAGE_DATASET_TYPES:
            problems.append(
                (
                    f"data.datasets.{i}.type",
                    entry.type,
                    "a diffusion recipe trains on image sources: use images (captions from metadata.jsonl"
                    "/.csv, .txt sidecars or a Hub dataset column) or dreambooth (diffusion.instance_prompt)",
                )
            )
        if not diffusion and entry.type in IMAGE_DATASET_TYPES:
            problems.append(
                (f"data.datasets.{i}.type", entry.type, "image sources need model.kind: diffusion")
            )
        if entry.type in IMAGE_DATASET_TYPES and entry.weight != 1:
            problems.append(
                (
                    f"data.datasets.{i}.weight",
                    entry.weight,
                    "image sources are not weighted yet (weights draw mixtures of text datasets): remove it",
                )
            )
    if not diffusion:
        if ok("diffusion") and recipe.diffusion is not None:
            problems.append(
                ("diffusion", "...", "set model.kind: diffusion to use this section, or remove it")
            )
        return problems
    if ok("model.model_path") and not recipe.model.model_path:
        problems.append(
            ("model.model_path", None, "name the diffusers pipeline to fine-tune (a folder or a Hub id)")
        )
    for path, reason in _NOT_FOR_DIFFUSION.items():
        section, name = path.split(".")
        owner = getattr(recipe, section)
        if ok(path) and owner is not None:
            value = getattr(owner, name)
            if value != type(owner).model_fields[name].get_default(call_default_factory=True):
                problems.append((path, value, f"does not apply to a diffusion recipe ({reason}); remove it"))
    if ok("lora.enable_lora") and not recipe.lora.enable_lora:
        problems.append(("lora.enable_lora", False, "diffusion recipes train LoRA adapters: set true"))
    problems += _full_finetune_problems(recipe, ok)
    if ok("diffusion", "data.datasets") and recipe.diffusion is not None:
        types = {e.type for e in recipe.data.datasets if e is not None}
        settings = recipe.diffusion
        if "dreambooth" in types and not settings.instance_prompt:
            problems.append(
                ("diffusion.instance_prompt", None, "dreambooth datasets need the prompt of their images")
            )
        if settings.instance_prompt and "dreambooth" not in types:
            problems.append(
                (
                    "diffusion.instance_prompt",
                    settings.instance_prompt,
                    "is used by dreambooth datasets only; the images type takes captions from the data",
                )
            )
    return problems


def _full_finetune_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """diffusion.adapter full trains the denoiser's own weights, which stay fp32 (mixed precision
    computes in 16-bit). (LoRA sizes it does not read are warnings: Recipe._warnings.)"""
    problems: list[Problem] = []
    if not ok("diffusion", "model.torch_dtype") or recipe.diffusion is None:
        return problems
    if recipe.diffusion.adapter != "full":
        return problems
    if recipe.model.torch_dtype not in ("auto", "fp32"):
        problems.append(
            (
                "model.torch_dtype",
                recipe.model.torch_dtype,
                "diffusion.adapter full keeps the trained denoiser in fp32 (train.mixed_precision computes in "
                "16-bit): use auto or fp32",
            )
        )
    return problems


# Why vision-language rows are not packed: finetune.defaults turns packing off for model.kind vlm.
VLM_NO_PACKING = (
    "rows with images are not packed: the models place image features by their tokens across the whole "
    "batch and Qwen2-VL's multimodal RoPE derives positions from the whole row, so packed sequences would "
    "need per-sequence image and position handling that finetune does not do yet; set it false (each row "
    "is then one conversation, padded per batch)"
)


def vision_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """What a vision-language recipe (model.kind vlm) cannot do yet: packing, another data type than
    chat_template (sft), preference (the paired preference objectives) or kto, online objectives,
    a generation set without its chat template; and image settings in a recipe without images
    (data.image_max_pixels, a generation set's field_images)."""
    problems: list[Problem] = []
    if not ok("model.kind"):
        return problems
    if recipe.model.kind != "vlm":
        if ok("data.image_max_pixels") and recipe.data.image_max_pixels is not None:
            problems.append(
                ("data.image_max_pixels", recipe.data.image_max_pixels, "applies to model.kind: vlm")
            )
        for i, gen_set in enumerate(recipe.eval.generation_sets if ok("eval.generation_sets") else []):
            # Compared with the default, not "was it set": a resolved recipe spells every default out.
            if (
                gen_set is not None
                and gen_set.field_images != GenerationSet.model_fields["field_images"].default
            ):
                problems.append(
                    (
                        f"eval.generation_sets.{i}.field_images",
                        gen_set.field_images,
                        "images are read by vision-language models only: set model.kind: vlm, or remove "
                        "field_images (a text model's prompts cannot carry images)",
                    )
                )
        return problems
    for name in ("sample_packing", "eval_sample_packing"):
        if ok(f"data.{name}") and getattr(recipe.data, name):
            problems.append((f"data.{name}", True, VLM_NO_PACKING))
    for key in ("datasets", "test_datasets"):
        for i, entry in enumerate(getattr(recipe.data, key) if ok(f"data.{key}") else []):
            if entry is not None and entry.type not in VLM_DATASET_TYPES:
                problems.append(
                    (
                        f"data.{key}.{i}.type",
                        entry.type,
                        "a vision-language recipe reads chat_template rows (messages with image parts, or "
                        "<image> placeholders and field_images), preference pairs or kto examples whose "
                        "prompt holds the images, or prompts (online RL); other types are not supported yet",
                    )
                )
    if ok("train.objective"):
        problems += _vision_objective_problems(recipe.train.objective)
        problems += _vision_online_problems(recipe, ok)
    for i, gen_set in enumerate(recipe.eval.generation_sets if ok("eval.generation_sets") else []):
        if gen_set is not None and not gen_set.use_chat_template:
            reason = "a vision-language model's prompts are rendered with its chat template (where the images go); remove it"
            problems.append((f"eval.generation_sets.{i}.use_chat_template", False, reason))
    return problems


VLM_DATASET_TYPES = ("chat_template", "preference", "kto", "prompt")
"""Data types a vision-language recipe reads: chats for sft, pairs for the paired preference objectives,
labelled examples for kto, prompts for online RL."""


def _vision_objective_problems(name: str) -> list[Problem]:
    """sft, the offline preference objectives (paired, and kto) and online RL train vision-language
    models; the reward model (a sequence-classification head) does not."""
    spec = OBJECTIVES[name]
    if spec.name == "sft" or spec.kind in ("paired", "unpaired", "online"):
        return []
    reason = "vision-language models train with sft, dpo, ipo, simpo, orpo, kto or an online objective (grpo, ...) for now"
    return [("train.objective", name, reason)]


def _vision_online_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """What online RL of a vision-language model does not do yet: generation with another backend than
    transformers (vLLM would need the images in its requests), and tools or environments in the loop
    (their inserted turns would need the images re-rendered around them)."""
    spec = OBJECTIVES[recipe.train.objective]
    if spec.kind != "online" or not ok(spec.section) or getattr(recipe, spec.section) is None:
        return []
    settings, section, problems = getattr(recipe, spec.section), spec.section, []
    if settings.generation_backend != "transformers":
        reason = "a vision-language model's rollouts generate with the transformers backend for now: set transformers"
        problems.append((f"{section}.generation_backend", settings.generation_backend, reason))
    for name in ("tools", "environment"):
        if getattr(settings, name, None):
            reason = "tools and environments in the loop are for text models for now; remove it"
            problems.append((f"{section}.{name}", "...", reason))
    return problems


def objective_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """Dataset types that do not fit train.objective (the objective table says what each trains on),
    and kto's packing.

    sft trains on any text type; every other objective on its own data type (dpo, ipo, simpo and orpo
    on `preference` pairs, kto on `kto` examples, packed: its KL reference point comes from mismatched
    completions within each packed row; a vision-language model's kto rows are never packed, their KL
    rows are built over the split instead, finetune.data.batching.vision).
    """
    if not ok("train.objective", "model.kind"):
        return []
    spec = OBJECTIVES[recipe.train.objective]
    if recipe.model.kind == "diffusion":
        if spec.name != "sft":
            return [("train.objective", spec.name, "preference objectives train LLMs, not diffusion models")]
        return []
    owned = {o.data_type for o in OBJECTIVES.values() if o.data_type is not None}
    problems: list[Problem] = []
    for key in ("datasets", "test_datasets"):
        for i, entry in enumerate(getattr(recipe.data, key) if ok(f"data.{key}") else []):
            if entry is None or not ok(f"data.{key}.{i}.type") or entry.type in IMAGE_DATASET_TYPES:
                continue
            if spec.data_type is None and entry.type in owned:
                problems.append(
                    (
                        f"data.{key}.{i}.type",
                        entry.type,
                        f"needs train.objective {describe(trained_on(entry.type))}",
                    )
                )
            elif spec.data_type is not None and entry.type != spec.data_type:
                problems.append(
                    (
                        f"data.{key}.{i}.type",
                        entry.type,
                        f"train.objective {spec.name} trains on {_DATA_SHAPES[spec.data_type]}: use type "
                        f"{spec.data_type}",
                    )
                )
    packing = ("data.sample_packing", "data.eval_sample_packing", "data.test_datasets", "data.val_set_size")
    if spec.kind == "unpaired" and recipe.model.kind != "vlm" and ok(*packing):
        has_eval = bool(recipe.data.test_datasets) or bool(recipe.data.val_set_size)
        for name in ("sample_packing", "eval_sample_packing"):
            if not getattr(recipe.data, name) and (name == "sample_packing" or has_eval):
                problems.append(
                    (
                        f"data.{name}",
                        False,
                        f"{spec.name} estimates its KL reference point from mismatched completions within each "
                        "packed row (as TRL does within a batch): set it true",
                    )
                )
    return problems


_DATA_SHAPES = {
    "preference": "pairs (prompt, chosen, rejected)",
    "kto": "examples (prompt, completion, label)",
    "prompt": "prompts (the model samples the completions; other columns feed the rewards)",
}


def objective_setting_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """An objective's setting (objective table: `settings`) changed from its default under another
    objective: an error naming the objectives that read it (never silently ignored)."""
    if not ok("train.objective"):
        return []
    objective = recipe.train.objective
    problems: list[Problem] = []
    for path in objective_settings():
        section_name, name = path.split(".")
        section = getattr(recipe, section_name, None)
        if section is None or not ok(path) or objective in readers(path):
            continue
        value = getattr(section, name)
        if value == type(section).model_fields[name].get_default(call_default_factory=True):
            continue
        problems.append(
            (
                path,
                value,
                f"belongs to train.objective {' / '.join(readers(path))}, not {objective!r}; remove it or "
                "change the objective",
            )
        )
    return problems


def data_init_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """EVA and CorDA read token rows of the training data before training (finetune.model.lora_init): a
    diffusion recipe (images) and an online objective (prompts only, completions come later) have none."""
    init = recipe.lora.init_lora_weights if ok("lora.init_lora_weights") else None
    if init not in DATA_DRIVEN or not ok("model.kind", "train.objective"):
        return []
    if recipe.model.kind == "diffusion":
        reason = "a diffusion recipe trains on images"
    elif recipe.model.kind == "vlm":
        reason = "a vision-language recipe's batches carry pixels, which finetune's init does not feed yet"
    elif OBJECTIVES[recipe.train.objective].kind == "online":
        reason = f"train.objective {recipe.train.objective} trains on completions sampled during training"
    else:
        return []
    return [
        (
            "lora.init_lora_weights",
            init,
            f"computes the adapter from token rows of the training data, and {reason}: use true, gaussian, "
            "pissa or olora",
        )
    ]


def residual_reference_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """PiSSA, OLoRA and CorDA move part of each base weight into the adapter, so the model with its
    adapters disabled (the LoRA reference of DPO, IPO, KTO and GRPO's KL term) is the residual base,
    not the initial model: the reference would be wrong. Precomputed reference log-probs are taken
    before the first step, with the adapters on, when the policy still is the initial model."""
    if not ok("lora.enable_lora", "lora.init_lora_weights", "train.objective", "model.kind"):
        return []
    if recipe.model.kind == "diffusion" or not modifies_base(recipe.lora):
        return []
    spec = OBJECTIVES[recipe.train.objective]
    online = getattr(recipe, spec.section) if spec.kind == "online" and ok(spec.section) else None
    if online is not None and online.beta > 0:
        fix = f"set {spec.section}.beta: 0 (no KL term)"
    elif spec.reference and spec.kind != "online" and not recipe.preference.precompute_ref_log_probs:
        fix = "set preference.precompute_ref_log_probs: true (taken before the first step, adapters on)"
    else:
        return []
    return [
        (
            "lora.init_lora_weights",
            recipe.lora.init_lora_weights,
            f"rewrites the base weights, so train.objective {spec.name}'s reference (the model with its "
            f"adapters disabled) would be the residual base, not the initial model: {fix}, or use init "
            "true, gaussian or eva",
        )
    ]


def online_problems(recipe: Recipe, ok: Callable[..., bool]) -> list[Problem]:
    """An objective's own section present exactly when an objective that reads it is chosen (the
    online objectives share one), and what sampling groups need of the batch: each process's
    completions per step hold whole groups."""
    if not ok("train.objective"):
        return []
    spec, problems = OBJECTIVES[recipe.train.objective], []
    for section in dict.fromkeys(other.section for other in OBJECTIVES.values() if other.section):
        if not ok(section):
            continue
        present = getattr(recipe, section) is not None
        if section == spec.section and not present:
            problems.append(
                (
                    section,
                    None,
                    f"train.objective {spec.name} needs a {section} section (at least its rewards)",
                )
            )
        elif section != spec.section and present:
            readers_of = describe(sharing_section(section))
            problems.append(
                (
                    section,
                    "...",
                    f"is read by train.objective {readers_of} only; remove it or set that objective",
                )
            )
    settings = getattr(recipe, spec.section) if spec.kind == "online" else None
    if settings is None:
        return problems
    group = f"{spec.section}.num_generations"
    per_step = recipe.train.micro_batch_size * recipe.train.gradient_accumulation_steps
    if ok("train.micro_batch_size", "train.gradient_accumulation_steps", group) and (
        per_step % settings.num_generations
    ):
        problems.append(
            (
                group,
                settings.num_generations,
                f"must divide the completions each process trains on per step, train.micro_batch_size x "
                f"gradient_accumulation_steps = {per_step} (every prompt's group is sampled and trained on one "
                "process): change one of them",
            )
        )
    if ok("data.excess_length_strategy") and recipe.data.excess_length_strategy == "truncate":
        problems.append(
            (
                "data.excess_length_strategy",
                "truncate",
                "a cut prompt loses its end (the question and the generation prompt): use drop or raise",
            )
        )
    return problems
