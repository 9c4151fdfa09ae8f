"""The whole recipe: its sections and the rules that span several of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, Field

from finetune.recipe.base import Problem, _Section
from finetune.recipe.data import DataSection
from finetune.recipe.diffusion import DiffusionSection, diffusion_problems
from finetune.recipe.hub import HubSection
from finetune.recipe.lora import LoraSection
from finetune.recipe.model import ModelSection
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
    diffusion: DiffusionSection | None = Field(
        None, description="Diffusion fine-tuning settings (model.kind: diffusion); null for LLM recipes."
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems = list(_unsupported_problems(self, ok))
        problems += diffusion_problems(self, ok)
        if ok("model.torch_dtype", "train.mixed_precision", "lora.enable_lora", "lora.enable_qlora"):
            problems += _precision_problems(self.model.torch_dtype, self.train.mixed_precision, self.lora)
        if (
            ok("model.special_tokens", "lora.enable_lora", "lora.modules_to_save")
            and not self.model.special_tokens.is_empty()
            and self.lora.enable_lora
            and not self.lora.modules_to_save
        ):
            problems.append(
                (
                    "lora.modules_to_save",
                    [],
                    "special_tokens resize the embeddings, which LoRA alone does not train: "
                    "add the embedding and output layers (e.g. [embed_tokens, lm_head])",
                )
            )
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
            if not ok(path):
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
