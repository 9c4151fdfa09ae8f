"""The recipe models: fields and defaults (docs/RECIPE.md), descriptions, extra keys, cross-field rules."""

from __future__ import annotations

import copy
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import finetune.recipe.schema as schema
from finetune.errors import RecipeError
from finetune.recipe import (
    DataSection,
    HubSection,
    LoraSection,
    ModelSection,
    Recipe,
    TrainSection,
    load_recipe,
    recipe_to_dict,
    validate_recipe,
)
from finetune.recipe.data import CHAT_RENDERABLE_TYPES, IMAGE_DATASET_TYPES, PREFERENCE_DATASET_TYPES
from finetune.recipe.formats import ENTRY_CLASSES, ENTRY_TYPES, _UnknownTypeEntry, dataset_entry

MINIMAL = {
    "model": {"model_path": "org/base"},
    "data": {"datasets": [{"path": "data/a.jsonl", "type": "alpaca"}]},
    "train": {"output_dir": "out"},
}
SECTIONS = [Recipe, ModelSection, DataSection, *ENTRY_CLASSES, TrainSection, LoraSection, HubSection]


def write(tmp_path: Path, data: dict | str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def recipe_with(**sections: dict) -> dict:
    """MINIMAL with the given section keys merged in (`data_entry` updates datasets[0])."""
    data = copy.deepcopy(MINIMAL)
    entry = sections.pop("data_entry", {})
    data["data"]["datasets"][0].update(entry)
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return data


def load(tmp_path: Path, data: dict, overrides: list[str] | None = None) -> Recipe:
    return load_recipe(write(tmp_path, data), overrides or [])


def error_of(tmp_path: Path, data: dict, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load(tmp_path, data, overrides)
    return str(info.value)


def all_models(root: type[BaseModel] = Recipe) -> set[type[BaseModel]]:
    """Every model class reachable from `root` (sections, dataset entries, special tokens)."""
    seen: set[type[BaseModel]] = set()

    def visit(annotation) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in seen:
            seen.add(annotation)
            for field in annotation.model_fields.values():
                visit(field.annotation)
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(root)
    return seen


# ------------------------------------------------------------------------------- fields and defaults

# (section, field, default) from docs/RECIPE.md.
DEFAULTS = [
    ("model", "model_path", "org/base"),  # set by MINIMAL; the rest are defaults
    ("model", "config_path", None),
    ("model", "tokenizer_path", None),
    ("model", "gguf_file", None),
    ("model", "revision", None),
    ("model", "trust_remote_code", False),
    ("model", "torch_dtype", "auto"),
    ("model", "attn_implementation", "sdpa"),
    ("model", "chat_template", None),
    ("model", "enable_liger_kernel", False),
    ("model", "enable_compile", False),
    ("model", "train_vision_tower", False),
    ("model", "train_projector", False),
    ("data", "test_datasets", []),
    ("data", "val_set_size", None),
    ("data", "dataset_prepared_path", "prepared"),
    ("data", "skip_prepare_dataset", False),
    ("data", "push_dataset_to_hub", None),
    ("data", "dataset_num_proc", None),
    ("data", "num_dataset_shards_to_save", None),
    ("data", "sequence_len", 2048),
    ("data", "excess_length_strategy", "drop"),
    ("data", "on_bad_row", "raise"),
    ("data", "sample_packing", True),
    ("data", "sample_packing_method", "multipack"),
    ("data", "sample_packing_sequence_len", None),
    ("data", "sample_packing_group_size", 100_000),
    ("data", "eval_sample_packing", True),
    ("data", "pad_to_multiple_of", 64),
    ("data", "shuffle_merged_datasets", True),
    ("data", "shuffle_before_merging_datasets", True),
    ("data", "image_max_pixels", None),
    ("data", "dataloader_num_workers", 2),
    ("data", "dataloader_prefetch_factor", None),
    ("data", "dataloader_pin_memory", True),
    ("data", "dataloader_drop_last", True),
    ("train", "seed", 42),
    ("train", "micro_batch_size", 1),
    ("train", "gradient_accumulation_steps", 1),
    ("train", "num_train_epochs", 1.0),
    ("train", "max_steps", None),
    ("train", "mixed_precision", "bf16"),
    ("train", "gradient_checkpointing", False),
    ("train", "loss_chunk_size", None),
    ("train", "optimizer", "adamw"),
    ("train", "lr", 5e-5),
    ("train", "lr_min", 0.0),
    ("train", "lr_warmup_ratio", 0.0),
    ("train", "lr_decay_style", "cosine"),
    ("train", "weight_decay", 0.0),
    ("train", "no_decay_params", ["bias", "norm"]),
    ("train", "adam_beta1", 0.9),
    ("train", "adam_beta2", 0.999),
    ("train", "adam_eps", 1e-8),
    ("train", "max_grad_norm", 1.0),
    ("train", "save_steps", 0),
    ("train", "save_epochs", 1.0),
    ("train", "save_total_limit", None),
    ("train", "save_hf_weights", True),
    ("train", "load_checkpoint_path", None),
    ("train", "eval_steps", None),
    ("train", "log_steps", 1),
    ("train", "log_format", "progress_bar"),
    ("train", "report_to", []),
    ("train", "accelerate_config", None),
    ("train", "exit_duration_in_mins", None),
    ("train", "iterations_to_skip", []),
    ("train", "max_consecutive_nonfinite", 5),
    ("train", "enable_profiling", False),
    ("train", "profile_start_step", 1),
    ("train", "profile_end_step", 2),
    ("train", "profile_trace_dir", "trace"),
    ("train", "enable_full_determinism", False),
    ("train", "empty_cache_steps", 0),
    ("train", "gc_steps", 0),
    ("train", "eval_on_start", False),
    ("train", "objective", "sft"),
    ("preference", "beta", 0.1),
    ("preference", "label_smoothing", 0.0),
    ("preference", "dpo_smoothing", "conservative"),
    ("preference", "simpo_gamma", 0.5),
    ("preference", "orpo_nll_reduction", "sequence"),
    ("preference", "kto_desirable_weight", 1.0),
    ("preference", "kto_undesirable_weight", 1.0),
    ("preference", "precompute_ref_log_probs", False),
    ("reward", "center_rewards_coefficient", 0.0),
    ("lora", "enable_lora", False),
    ("lora", "lora_rank", 16),
    ("lora", "lora_alpha", 16.0),
    ("lora", "lora_dropout", 0.0),
    ("lora", "lora_target_modules", "all-linear"),
    ("lora", "modules_to_save", []),
    ("lora", "use_rslora", False),
    ("lora", "use_dora", False),
    ("lora", "save_lora_only", True),
    ("lora", "enable_qlora", False),
    ("lora", "quant_type", "nf4"),
    ("lora", "double_quant", True),
    ("hub", "model_id", None),
    ("hub", "private", True),
    ("hub", "strategy", "end"),
    ("eval", "generation_sets", []),
    ("eval", "batch_size", 8),
    ("eval", "during_training", True),
]
ENTRY_DEFAULTS = {
    "name": None,
    "split": "train",
    "revision": None,
    "data_files": None,
    "ds_type": None,
    "shards": None,
    "shards_idx": None,
    "max_seq_len": None,
    "trust_remote_code": False,
    "weight": 1.0,
    "field_text": "text",
    "field_instruction": "instruction",
    "field_input": "input",
    "field_output": "output",
    "field_prompt": "prompt",
    "field_completion": "completion",
    "field_chosen": "chosen",
    "field_rejected": "rejected",
    "field_label": "label",
    "field_messages": "messages",
    "field_images": "images",
    "field_margin": None,
    "field_tools": "tools",
    "message_field_role": "role",
    "message_field_content": "content",
    "role_map": {},
    "train_on_inputs": False,
    "roles_to_train": ["assistant"],
    "train_on_eos": "turn",
    "apply_chat_template": False,
}


@pytest.fixture(scope="module")
def minimal_recipe() -> Recipe:
    return validate_recipe(MINIMAL)


@pytest.mark.parametrize(("section", "field", "default"), DEFAULTS, ids=[f"{s}.{f}" for s, f, _ in DEFAULTS])
def test_recipe_md_fields_and_defaults(minimal_recipe: Recipe, section: str, field: str, default) -> None:
    value = getattr(getattr(minimal_recipe, section), field)
    assert value == default
    assert type(value) is type(default)  # 1 is not 1.0, False is not 0


def test_dataset_entry_defaults(minimal_recipe: Recipe) -> None:
    entry = minimal_recipe.data.datasets[0]
    assert {name: getattr(entry, name) for name in type(entry).model_fields if name in ENTRY_DEFAULTS} == {
        name: default for name, default in ENTRY_DEFAULTS.items() if name in type(entry).model_fields
    }
    # A field several types read has one default (the fingerprint of every type hashes it).
    for cls in ENTRY_CLASSES:
        for name, field in cls.model_fields.items():
            if name not in ("path", "type"):
                assert field.get_default(call_default_factory=True) == ENTRY_DEFAULTS[name], (cls, name)


def test_documented_fields_are_all_present() -> None:
    documented = {f"{section}.{field}" for section, field, _ in DEFAULTS} | {
        "data.datasets",
        "train.output_dir",
        "model.special_tokens",
    }
    actual = {
        f"{section}.{field}"
        for section, section_field in Recipe.model_fields.items()
        # Optional sections (diffusion) are `Section | None`: look at the section's class.
        for field in next(
            a
            for a in (section_field.annotation, *typing.get_args(section_field.annotation))
            if a and hasattr(a, "model_fields")
        ).model_fields
    }
    assert documented <= actual, documented - actual
    entry_fields = {name for cls in ENTRY_CLASSES for name in cls.model_fields}
    assert set(ENTRY_DEFAULTS) | {"path", "type"} == entry_fields


def test_type_lists_come_from_the_entry_classes() -> None:
    assert IMAGE_DATASET_TYPES == ("images", "dreambooth")
    assert PREFERENCE_DATASET_TYPES == ("preference", "kto")
    assert CHAT_RENDERABLE_TYPES == ("alpaca", "input_output", "preference", "kto", "prompt")
    assert [type(dataset_entry(path="a", type=name)) for name in ENTRY_TYPES] == list(ENTRY_CLASSES)


def test_path_defaults_chain_model_config_tokenizer(minimal_recipe: Recipe) -> None:
    model = minimal_recipe.model
    assert (model.config_source, model.tokenizer_source) == ("org/base", "org/base")
    model = ModelSection(model_path="org/base", config_path="org/cfg")
    assert (model.config_source, model.tokenizer_source) == ("org/cfg", "org/cfg")
    model = ModelSection(config_path={"model_type": "llama"}, tokenizer_path="tok")
    assert (model.config_source, model.tokenizer_source) == ({"model_type": "llama"}, "tok")


def test_packing_len_defaults_to_sequence_len() -> None:
    data = DataSection(datasets=[{"path": "a", "type": "alpaca"}], sequence_len=128)
    assert data.packing_len == 128
    assert data.model_copy(update={"sample_packing_sequence_len": 512}).packing_len == 512


def test_named_chat_template_expands(minimal_recipe: Recipe) -> None:
    assert ModelSection(model_path="m", chat_template="chatml").resolved_chat_template.startswith("{% for")
    assert ModelSection(model_path="m", chat_template="{{ x }}").resolved_chat_template == "{{ x }}"
    assert minimal_recipe.model.resolved_chat_template is None


@pytest.mark.parametrize("cls", sorted(all_models(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_field_has_a_description(cls: type[BaseModel]) -> None:
    missing = [name for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{cls.__name__} fields without description: {missing}"


@pytest.mark.parametrize("cls", sorted(all_models(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_model_forbids_extra_keys(cls: type[BaseModel]) -> None:
    # Entries without a valid type judge no key but path and type (which keys are allowed depends on it).
    assert cls.model_config.get("extra") == ("ignore" if cls is _UnknownTypeEntry else "forbid")


@pytest.mark.parametrize(
    ("where", "extra"),
    [
        ("model", {"torch_dtyp": "bf16"}),
        ("data", {"sequence_length": 8}),
        ("train", {"learning_rate": 1e-4}),
        ("lora", {"rank": 8}),
        ("hub", {"repo": "a/b"}),
    ],
)
def test_unknown_key_in_any_section_is_an_error(tmp_path: Path, where: str, extra: dict) -> None:
    message = error_of(tmp_path, recipe_with(**{where: extra}))
    key = next(iter(extra))
    assert f"{where}.{key}" in message and "unknown key" in message


def test_unknown_key_in_dataset_entry_and_top_level(tmp_path: Path) -> None:
    data = recipe_with(data_entry={"pth": "x"})
    data["trainer"] = {}
    message = error_of(tmp_path, data)
    assert "data.datasets[0].pth" in message and "did you mean 'path'" in message
    assert "trainer" in message and "did you mean 'train'" in message


@pytest.mark.parametrize(
    ("drop", "path"),
    [
        (("model",), "model"),
        (("data",), "data"),
        (("train",), "train"),
        (("data", "datasets"), "data.datasets"),
        (("train", "output_dir"), "train.output_dir"),
    ],
)
def test_required_fields(tmp_path: Path, drop: tuple, path: str) -> None:
    data = copy.deepcopy(MINIMAL)
    node = data
    for key in drop[:-1]:
        node = node[key]
    del node[drop[-1]]
    message = error_of(tmp_path, data)
    assert f"{path}" in message and "required field is missing" in message


def test_dataset_entry_requires_path_and_type(tmp_path: Path) -> None:
    data = copy.deepcopy(MINIMAL)
    data["data"]["datasets"] = [{"split": "train"}]
    message = error_of(tmp_path, data)
    assert "data.datasets[0].path" in message and "data.datasets[0].type" in message


def test_lora_and_hub_sections_are_optional(minimal_recipe: Recipe) -> None:
    assert minimal_recipe.lora == LoraSection()
    assert minimal_recipe.hub == HubSection()


def test_empty_dataset_list_is_an_error(tmp_path: Path) -> None:
    data = copy.deepcopy(MINIMAL)
    data["data"]["datasets"] = []
    assert "data.datasets" in error_of(tmp_path, data)


# ---------------------------------------------------------------------------------- cross-field rules

# (case id, sections to merge into MINIMAL, path in the message, text in the message)
BAD_COMBINATIONS = [
    ("qlora-lora-off", {"lora": {"enable_qlora": True, "enable_lora": False}}, "lora.enable_lora", "enable_qlora"),
    ("fp16-on-bf16", {"model": {"torch_dtype": "bf16"}, "train": {"mixed_precision": "fp16"}},
     "train.mixed_precision", "bf16 weights"),
    ("bf16-on-fp16", {"model": {"torch_dtype": "fp16"}, "train": {"mixed_precision": "bf16"}},
     "train.mixed_precision", "fp16 weights"),
    ("fp16-full-ft", {"model": {"torch_dtype": "fp16"}, "train": {"mixed_precision": "fp16"}},
     "model.torch_dtype", "loss scaling"),
    ("qlora-fp32", {"model": {"torch_dtype": "fp32"}, "lora": {"enable_qlora": True}},
     "model.torch_dtype", "16-bit"),
    ("shards-alone", {"data_entry": {"shards": 4}}, "data.datasets[0].shards_idx", "together"),
    ("shards-idx-alone", {"data_entry": {"shards_idx": 1}}, "data.datasets[0].shards_idx", "together"),
    ("shards-idx-too-big", {"data_entry": {"shards": 4, "shards_idx": 4}}, "data.datasets[0].shards_idx",
     "below shards (4)"),
    ("packing-len-short", {"data": {"sequence_len": 512, "sample_packing_sequence_len": 256}},
     "data.sample_packing_sequence_len", "sequence_len (512)"),
    ("prefetch-no-workers", {"data": {"dataloader_num_workers": 0, "dataloader_prefetch_factor": 4}},
     "data.dataloader_prefetch_factor", "must be null"),
    ("lr-not-finite", {"train": {"lr": float("inf")}}, "train.lr", "finite number"),
    ("alpha-not-finite", {"lora": {"lora_alpha": float("nan")}}, "lora.lora_alpha", "finite number"),
    ("every-save-no-id", {"hub": {"strategy": "every_save"}}, "hub.strategy", "hub.model_id"),
    ("skip-prepare-push", {"data": {"skip_prepare_dataset": True, "push_dataset_to_hub": "org/ds"}},
     "data.push_dataset_to_hub", "prepare-dataset --push"),
    ("chat-no-roles", {"data_entry": {"type": "chat_template", "roles_to_train": []}},
     "data.datasets[0].roles_to_train", "at least one role"),
    ("no-model-source", {"model": {"model_path": None}}, "model.model_path", "config_path"),
    ("inline-no-model-type", {"model": {"config_path": {"hidden_size": 8}, "tokenizer_path": "t"}},
     "model.config_path", "model_type"),
    ("inline-no-tokenizer", {"model": {"model_path": None, "config_path": {"model_type": "llama"}}},
     "model.tokenizer_path", "tokenizer_path must be set"),
    ("gguf-file-no-folder",
     {"model": {"model_path": None, "config_path": {"model_type": "llama"}, "tokenizer_path": "t",
                "gguf_file": "m.gguf"}},
     "model.gguf_file", "names a file inside model_path"),
    ("gguf-file-twice", {"model": {"model_path": "models/m.gguf", "gguf_file": "n.gguf"}},
     "model.gguf_file", "already names a GGUF file"),
    ("gguf-file-not-gguf", {"model": {"gguf_file": "model.safetensors"}}, "model.gguf_file", ".gguf"),
    ("gguf-package-missing", {"model": {"model_path": "package://no_such_package_xyz/m.gguf"}},
     "model.model_path", "no installed Python package 'no_such_package_xyz'"),
    ("weight-zero", {"data_entry": {"weight": 0}}, "data.datasets[0].weight", "remove its entry"),
    ("weight-negative", {"data_entry": {"weight": -0.5}}, "data.datasets[0].weight", "must be a number > 0"),
    ("weight-not-finite", {"data_entry": {"weight": float("inf")}}, "data.datasets[0].weight", "finite number"),
    ("weight-nan", {"data_entry": {"weight": float("nan")}}, "data.datasets[0].weight", "finite number"),
    ("weight-on-eval", {"data": {"test_datasets": [{"path": "t.jsonl", "type": "alpaca", "weight": 2}]}},
     "data.test_datasets[0].weight", "evaluation data is not weighted"),
    ("weight-on-images", {"model": {"kind": "diffusion", "model_path": "org/sd"},
                          "data": {"datasets": [{"path": "imgs", "type": "images", "weight": 0.5}]}},
     "data.datasets[0].weight", "image sources are not weighted"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sections", "path", "text"), [c[1:] for c in BAD_COMBINATIONS], ids=[c[0] for c in BAD_COMBINATIONS]
)
def test_bad_combination_is_an_error(tmp_path: Path, sections: dict, path: str, text: str) -> None:
    message = error_of(tmp_path, recipe_with(**copy.deepcopy(sections)))
    line = next((ln for ln in message.splitlines() if f"- {path} " in ln or f"- {path}:" in ln), None)
    assert line is not None, message
    assert text in line and "got " in line
    assert "1 problem(s)" in message


GOOD_COMBINATIONS = [
    ("qlora-implies-lora", {"lora": {"enable_qlora": True}}),
    ("qlora-with-lora", {"lora": {"enable_qlora": True, "enable_lora": True}}),
    ("qlora-fp32-no-mixed", {"model": {"torch_dtype": "fp32"}, "lora": {"enable_qlora": True},
                             "train": {"mixed_precision": "no"}}),
    ("fp16-lora", {"model": {"torch_dtype": "fp16"}, "train": {"mixed_precision": "fp16"}, "lora": {"enable_lora": True}}),
    ("fp16-on-fp32", {"model": {"torch_dtype": "fp32"}, "train": {"mixed_precision": "fp16"}}),
    ("save-equals-max", {"train": {"max_steps": 10, "save_steps": 10}}),
    ("save-without-max", {"train": {"save_steps": 1000}}),
    ("lr-min-equals-lr", {"train": {"lr": 1e-4, "lr_min": 1e-4}}),
    ("shards-pair", {"data_entry": {"shards": 4, "shards_idx": 3}}),
    ("packing-off", {"data": {"sequence_len": 512, "sample_packing_sequence_len": 256, "sample_packing": False}}),
    ("packing-len-equal", {"data": {"sequence_len": 512, "sample_packing_sequence_len": 512}}),
    ("no-workers-no-prefetch", {"data": {"dataloader_num_workers": 0, "dataloader_prefetch_factor": None}}),
    ("no-workers-default-prefetch", {"data": {"dataloader_num_workers": 0}}),
    ("special-tokens-modules", {"model": {"special_tokens": {"pad_token": "<pad>"}},
                                "lora": {"enable_lora": True, "modules_to_save": ["embed_tokens", "lm_head"]}}),
    ("special-tokens-full-ft", {"model": {"special_tokens": {"pad_token": "<pad>"}}}),
    ("every-save-with-id", {"hub": {"strategy": "every_save", "model_id": "org/name"}}),
    ("profile-window-off", {"train": {"profile_start_step": 5, "profile_end_step": 2}}),
    ("inline-config", {"model": {"model_path": None, "config_path": {"model_type": "llama"}, "tokenizer_path": "t"}}),
    ("weights", {"data": {"datasets": [{"path": "a.jsonl", "type": "alpaca", "weight": 0.25},
                                       {"path": "b.jsonl", "type": "completion", "weight": 3}],
                          "test_datasets": [{"path": "t.jsonl", "type": "alpaca", "weight": 1.0}]}}),
]  # fmt: skip


@pytest.mark.parametrize("sections", [c[1] for c in GOOD_COMBINATIONS], ids=[c[0] for c in GOOD_COMBINATIONS])
def test_good_combination_is_accepted(tmp_path: Path, sections: dict) -> None:
    load(tmp_path, recipe_with(**copy.deepcopy(sections)))


def test_enable_qlora_implies_enable_lora_only_when_omitted(tmp_path: Path) -> None:
    recipe = load(tmp_path, recipe_with(lora={"enable_qlora": True}))
    assert recipe.lora.enable_lora is True
    # The implied value is written out, so the resolved recipe validates again unchanged.
    again = validate_recipe(recipe_to_dict(recipe))
    assert again == recipe
    message = error_of(tmp_path, recipe_with(lora={"enable_qlora": True, "enable_lora": False}))
    assert "lora.enable_lora" in message and "got False" in message


@pytest.mark.parametrize(
    ("value", "ok"),
    [(0.1, True), (100, True), (1, True), (1.5, False), (1.0, False), (True, False), (False, False),
     (-3, False), (-0.5, False)],
)  # fmt: skip
def test_val_set_size_is_rows_or_fraction(tmp_path: Path, value, ok: bool) -> None:
    data = recipe_with(data={"val_set_size": value})
    if ok:
        recipe = load(tmp_path, data)
        assert recipe.data.val_set_size == value and type(recipe.data.val_set_size) is type(value)
    else:
        assert "data.val_set_size" in error_of(tmp_path, data)


@pytest.mark.parametrize("zero", [0, 0.0, None])
def test_val_set_size_zero_means_no_validation_split_as_null(tmp_path: Path, zero) -> None:
    """Axolotl recipes write 0 for "no validation split": it resolves to null, as written there."""
    recipe = load(tmp_path, recipe_with(data={"val_set_size": zero}))
    assert recipe.data.val_set_size is None
    assert recipe_to_dict(recipe)["data"]["val_set_size"] is None


@pytest.mark.parametrize("model_id", ["name-only", "a/b/c", "/name", "org/"])
def test_hub_model_id_must_be_org_name(tmp_path: Path, model_id: str) -> None:
    message = error_of(tmp_path, recipe_with(hub={"model_id": model_id}))
    assert "hub.model_id" in message and "org/name" in message


def test_several_bad_combinations_of_one_section_are_all_reported(tmp_path: Path) -> None:
    data = recipe_with(
        data={"sequence_len": 512, "sample_packing_sequence_len": 256, "skip_prepare_dataset": True,
              "push_dataset_to_hub": "org/ds"}
    )  # fmt: skip
    message = error_of(tmp_path, data)
    assert "2 problem(s)" in message
    assert "data.sample_packing_sequence_len" in message and "data.push_dataset_to_hub" in message


WARNINGS = [
    ("save-after-max", {"train": {"max_steps": 10, "save_steps": 20}}, "train.save_steps", "max_steps (10)"),
    ("eval-after-max", {"train": {"max_steps": 10, "eval_steps": 20}}, "train.eval_steps", "only the final"),
    ("lr-min-above-lr", {"train": {"lr": 1e-4, "lr_min": 1e-3}}, "train.lr_min", "rises instead of decaying"),
    ("special-tokens-lora", {"model": {"special_tokens": {"pad_token": "<pad>"}}, "lora": {"enable_lora": True}},
     "lora.modules_to_save", "special_tokens"),
    ("profile-window", {"train": {"enable_profiling": True, "profile_start_step": 5, "profile_end_step": 2}},
     "train.profile_end_step", "profile_start_step (5)"),
    ("skip-step-zero", {"train": {"iterations_to_skip": [0, 3]}}, "train.iterations_to_skip", "from 1"),
    ("sgd-betas", {"train": {"optimizer": "sgd", "adam_beta1": 0.8}}, "train.optimizer", "sgd ignores"),
    ("extend-without-resume", {"train": {"extend_run": True}}, "train.extend_run", "load_checkpoint_path: auto"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sections", "path", "text"), [c[1:] for c in WARNINGS], ids=[c[0] for c in WARNINGS]
)
def test_useless_settings_are_warnings_not_errors(
    tmp_path: Path, sections: dict, path: str, text: str
) -> None:
    from finetune.recipe import recipe_warnings

    recipe = load(tmp_path, recipe_with(**copy.deepcopy(sections)))  # loads: it can run
    (warning,) = recipe_warnings(recipe)
    assert warning.startswith(f"{path} (") and text in warning


def test_good_recipes_have_no_warnings(minimal_recipe: Recipe) -> None:
    from finetune.recipe import recipe_warnings

    assert recipe_warnings(minimal_recipe) == []


@pytest.mark.parametrize(
    ("field", "off", "canonical"),
    [("save_steps", None, 0), ("save_epochs", None, 0), ("eval_steps", 0, None), ("gc_steps", None, 0),
     ("empty_cache_steps", None, 0)],
)  # fmt: skip
def test_zero_and_null_both_turn_a_cadence_off(tmp_path: Path, field: str, off, canonical) -> None:
    recipe = load(tmp_path, recipe_with(train={field: off}))
    assert getattr(recipe.train, field) == canonical


# ------------------------------------------------------------ rules run despite other errors


def test_combination_is_reported_with_field_errors_of_its_own_section(tmp_path: Path) -> None:
    # pydantic skips a model's after-validators when a field failed; the loader runs them anyway.
    data = recipe_with(
        data={"dataset_num_proc": "abc", "sequence_len": 512, "sample_packing_sequence_len": 256}
    )
    message = error_of(tmp_path, data)
    assert "data.dataset_num_proc" in message and "data.sample_packing_sequence_len" in message
    assert "2 problem(s)" in message


def test_recipe_level_rules_run_when_a_section_has_errors(tmp_path: Path) -> None:
    data = recipe_with(
        data_entry={"type": "chat"},
        model={"torch_dtype": "bf16", "attn_implementation": "flash"},
        train={"mixed_precision": "fp16"},
        hub={"strategy": "every_save"},
    )
    message = error_of(tmp_path, data)
    for expected in (
        "data.datasets[0].type",
        "model.attn_implementation",
        "train.mixed_precision",
        "hub.strategy",
    ):
        assert expected in message, message
    assert "4 problem(s)" in message


def test_dataset_entry_rules_run_when_the_entry_has_other_errors(tmp_path: Path) -> None:
    message = error_of(tmp_path, recipe_with(data_entry={"shards": 4, "ds_type": "xml"}))
    assert "data.datasets[0].ds_type" in message and "data.datasets[0].shards_idx" in message


def test_rules_that_read_an_invalid_field_are_skipped(tmp_path: Path) -> None:
    # lr is invalid: comparing lr_min with the default lr would be a made-up problem.
    message = error_of(tmp_path, recipe_with(train={"lr": "fast", "lr_min": 1e-3}))
    assert "train.lr " in message and "lr_min" not in message
    assert "1 problem(s)" in message
    # torch_dtype is invalid: no precision rule may fire on its default.
    message = error_of(
        tmp_path, recipe_with(model={"torch_dtype": "half"}, train={"mixed_precision": "fp16"})
    )
    assert "model.torch_dtype" in message and "mixed_precision" not in message


def test_a_rule_already_reported_is_not_repeated(tmp_path: Path) -> None:
    data = recipe_with(
        data={"sequence_len": 512, "sample_packing_sequence_len": 256}, model={"torch_dtyp": "x"}
    )
    message = error_of(tmp_path, data)
    assert message.count("data.sample_packing_sequence_len") == 1
    assert "2 problem(s)" in message


# ---------------------------------------------------------------------------------- NOT_SUPPORTED_YET


def test_not_supported_yet_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        schema,
        "NOT_SUPPORTED_YET",
        {
            "model.enable_compile": "compile lands in 0.2",
            "data.datasets.*.max_seq_len": "per-dataset lengths land later",
            "model.special_tokens.unk_token": "unk handling",
        },
    )
    data = recipe_with(model={"enable_compile": True, "special_tokens": {"unk_token": "<unk>"}})
    data["data"]["datasets"].append({"path": "b.jsonl", "type": "completion", "max_seq_len": 64})
    message = error_of(tmp_path, data)
    assert "3 problem(s)" in message
    for path, reason in [
        ("model.enable_compile", "compile lands in 0.2"),
        ("data.datasets[1].max_seq_len", "per-dataset lengths land later"),
        ("model.special_tokens.unk_token", "unk handling"),
    ]:
        line = next(ln for ln in message.splitlines() if f"- {path} " in ln)
        assert f"not supported yet ({reason})" in line
    assert "datasets[0].max_seq_len" not in message  # left at its default
    # Defaults are fine.
    load(tmp_path, MINIMAL)


def test_not_supported_yet_is_reported_with_other_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schema, "NOT_SUPPORTED_YET", {"data.datasets.*.shards": "later"})
    data = recipe_with(data_entry={"shards": 2, "shards_idx": 0}, train={"seed": "x"})
    message = error_of(tmp_path, data)
    assert "data.datasets[0].shards" in message and "not supported yet (later)" in message
    assert "train.seed" in message


# ------------------------------------------------------------------------------------------ loading


def test_load_recipe_reads_exponent_floats(tmp_path: Path) -> None:
    text = yaml.safe_dump(MINIMAL, sort_keys=False) + "lora:\n  lora_dropout: 5e-2\n"
    text = text.replace("output_dir: out", "output_dir: out\n  lr: 3e-5\n  adam_eps: 1E-6")
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.train.lr == 3e-5 and recipe.train.adam_eps == 1e-6 and recipe.lora.lora_dropout == 0.05


def test_load_recipe_accepts_path_objects_and_strings(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    assert load_recipe(path) == load_recipe(str(path))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "a recipe is a mapping"),
        ("- model\n- data\n", "a recipe is a mapping"),
        ("model: [\n", "invalid YAML"),
        ("train:\n  lr: 1\n  lr: 2\n", "duplicate key 'lr'"),
    ],
)
def test_load_recipe_file_errors(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(RecipeError, match=expected):
        load_recipe(write(tmp_path, text))


def test_load_recipe_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="it is a directory"):
        load_recipe(tmp_path)


def test_recipe_to_dict_round_trips(tmp_path: Path) -> None:
    data = recipe_with(
        model={"special_tokens": {"pad_token": "<pad>"}},
        lora={"enable_lora": True, "modules_to_save": ["lm_head"], "lora_target_modules": ["q_proj"]},
        data={"val_set_size": 0.1},
    )
    recipe = load(tmp_path, data)
    resolved = recipe_to_dict(recipe)
    assert resolved["train"]["seed"] == 42 and resolved["data"]["datasets"][0]["split"] == "train"
    again = load_recipe(write(tmp_path, resolved, "resolved.yaml"))
    assert again == recipe
