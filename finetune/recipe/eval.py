"""The `eval` section: generation sets that answer "did the model get better?" (`finetune eval`, and
every train.eval_steps during training), beside the eval loss on the data section's eval split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field

from finetune.recipe.base import Problem, Regex, _Section
from finetune.recipe.tools import (
    ToolSpec,
    max_tool_calls_field,
    tool_timeout_field,
    tools_field,
    tools_problems,
)

# GSM8K answers end with "#### <number>" (finetune.generation.metrics.GSM8K_ANSWER_PATTERN).
DEFAULT_ANSWER_PATTERN = r"####\s*\$?\s*(-?[\d,.]+)"


class GenerationSet(_Section):
    """Prompts answered by greedy decoding and scored against expected answers."""

    name: str = Field(description="Short name, used in logs and eval.json (e.g. gsm8k).")
    path: str = Field(description="A local json/jsonl/csv/parquet file or a Hub dataset id.")
    split: str = Field("train", description="Split to read (Hub datasets and multi-split files).")
    field_prompt: str = Field(
        "prompt",
        description="Column with the prompt (a string or a list of messages). A vision-language model's "
        "(model.kind vlm) prompts may carry images as its SFT data does: image parts "
        "({type: image, image: PATH relative to the set's file}), or <image> placeholders with the images "
        "in field_images.",
    )
    field_images: str = Field(
        "images",
        description="model.kind vlm: column with each row's images (paths relative to the set's file, or "
        "Parquet / datasets Image bytes), one per <image> placeholder in the prompt; read when present.",
    )
    field_expected: str | None = Field(
        "expected", description="Column with the expected answer; null with metric none."
    )
    metric: Literal["exact_match", "math_verify", "contains", "none"] = Field(
        "exact_match",
        description="exact_match: the answer extracted with answer_pattern (else the last number) equals "
        "the expected one's; math_verify: Hugging Face's math-verify finds the answers mathematically "
        "equal (\\frac{1}{2} = 0.5, x=2 = 2; needs pip install math-verify); contains: the expected text "
        "occurs in the output; none: samples only.",
    )
    answer_pattern: Regex | None = Field(
        DEFAULT_ANSWER_PATTERN,
        description="exact_match: regex whose first group is the answer (default: GSM8K's `#### 42`); "
        "null = the last number.",
    )
    case_sensitive: bool = Field(False, description="contains: compare case-sensitively.")
    num_rows: int | None = Field(None, ge=1, description="Use the first N rows only (null = all).")
    max_new_tokens: int = Field(256, ge=1, description="Longest answer generated.")
    use_chat_template: bool = Field(
        True, description="Render prompts with the tokenizer's chat template (false: plain text prompts)."
    )
    num_samples: int = Field(3, ge=0, description="Sample answers shown and logged.")
    tools: list[ToolSpec] = tools_field("its answers (greedy)")
    max_tool_calls: int = max_tool_calls_field()
    tool_timeout_s: float = tool_timeout_field()

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = tools_problems(self.tools, self.max_tool_calls, self.tool_timeout_s, ok)
        if ok("metric", "field_expected") and self.metric != "none" and self.field_expected is None:
            problems.append(
                ("field_expected", None, f"metric {self.metric} needs the expected answers' column")
            )
        return problems


class LmEvalSection(_Section):
    """Standard benchmarks through lm-evaluation-harness (finetune.evaluation.harness; pip install
    'finetune[eval]'), scored by `finetune eval` for the base and each tuned model."""

    tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval task or group names (gsm8k, arc_easy, hellaswag, or a task of include_path), "
        "or paths of task YAMLs; --lm-eval gsm8k,arc_easy sets it.",
    )
    include_path: list[str] = Field(
        default_factory=list,
        description="Folders of lm-eval task YAMLs (relative to the working directory, as data paths), e.g. tasks on local "
        "files: dataset_path: json with dataset_kwargs.data_files.",
    )
    data_files: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Point a task at local files: {task: {split: FILE}} (json/jsonl/csv/parquet, relative to "
        "the working directory; the splits the task reads, e.g. test and train for few-shot examples). "
        "The task's own config is used with its dataset replaced.",
    )
    limit: int | None = Field(
        None, ge=1, description="Score the first N examples of each task only (null = all); --lm-eval-limit."
    )
    num_fewshot: int | None = Field(
        None, ge=0, description="Few-shot examples per prompt (null = each task's own default)."
    )
    batch_size: int = Field(8, ge=1, description="Requests per forward pass (lm-eval's batch_size).")
    max_length: int | None = Field(
        None, ge=1, description="Longest context in tokens (null = the model's max_position_embeddings)."
    )
    max_gen_toks: int | None = Field(
        None,
        ge=1,
        description="Longest answer of generation tasks, in tokens (null = the task's own, else lm-eval's 256).",
    )
    apply_chat_template: bool = Field(
        False,
        description="Render prompts with the tokenizer's chat template (lm-eval's apply_chat_template).",
    )
    bootstrap_iters: int = Field(
        1000,
        ge=0,
        description="Bootstrap resamples for the stderr of metrics without a closed form (0 = none).",
    )
    download: bool = Field(
        False,
        description="Let datasets download tasks' Hub datasets (needs the network). false: offline, so a task "
        "whose data is not local or cached fails at once, saying how to point it at local files.",
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        # A data_files entry for a task that is not run would be ignored: a typo there must not pass.
        if not (ok("tasks", "data_files") and self.tasks):
            return []
        unused = sorted(set(self.data_files) - set(self.tasks))
        if unused:
            return [
                (
                    "data_files",
                    unused,
                    f"no such task in eval.lm_eval.tasks {self.tasks}: name the tasks the files are for "
                    "(data_files keys must be task names that are run)",
                )
            ]
        return []


class EvalSection(_Section):
    generation_sets: list[GenerationSet] = Field(
        default_factory=list, description="Generation sets scored by `finetune eval` and during training."
    )
    batch_size: int = Field(8, ge=1, description="Prompts generated together (left-padded).")
    during_training: bool = Field(
        True, description="Also score the generation sets every train.eval_steps (and at the end)."
    )
    lm_eval: LmEvalSection = Field(
        default_factory=LmEvalSection,
        description="Standard benchmarks (lm-evaluation-harness) scored by `finetune eval`.",
    )

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if ok("generation_sets"):
            names = [s.name for s in self.generation_sets if s is not None]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                problems.append(("generation_sets", duplicates, "names must be unique: they key the results"))
        return problems
