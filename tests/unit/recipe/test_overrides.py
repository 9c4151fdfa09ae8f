"""Command-line overrides: `--section.field value`, YAML-typed values, schema-checked paths."""

from __future__ import annotations

import copy
import typing
from pathlib import Path

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe
from finetune.recipe.overrides import (
    apply_overrides,
    check_path,
    override_paths,
    parse_override_args,
    parse_value,
)

BASE = {
    "model": {"model_path": "org/base"},
    "data": {
        "datasets": [
            {"path": "a.jsonl", "type": "alpaca"},
            {"path": "b.jsonl", "type": "chat_template", "role_map": {"human": "user"}},
        ]
    },
    "train": {"output_dir": "out", "seed": 1},
}


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False))
    return path


def apply(*args: str, data: dict | None = None) -> dict:
    return apply_overrides(copy.deepcopy(BASE if data is None else data), list(args), Recipe)


# ------------------------------------------------------------------------------------------ parsing


def test_parse_both_spellings() -> None:
    args = ["--train.lr", "3e-5", "--lora.enable_lora=true", "--data.datasets.0.path", "x.jsonl"]
    assert parse_override_args(args) == [
        ("train.lr", "3e-5"),
        ("lora.enable_lora", "true"),
        ("data.datasets.0.path", "x.jsonl"),
    ]


def test_parse_keeps_everything_after_the_first_equals_sign() -> None:
    assert parse_override_args(["--model.chat_template={{ a == b }}"]) == [
        ("model.chat_template", "{{ a == b }}")
    ]
    assert parse_override_args(["--train.output_dir="]) == [("train.output_dir", "")]


def test_parse_negative_number_is_a_value() -> None:
    assert parse_override_args(["--train.seed", "-1"]) == [("train.seed", "-1")]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--train.lr"], "has no value"),
        (["--lora.enable_lora", "--train.lr", "1"], "--lora.enable_lora has no value"),
        (["train.lr", "1"], "unexpected argument 'train.lr'"),
        (["--"], "unexpected argument '--'"),
        (["--train.lr", "1", "stray"], "unexpected argument 'stray'"),
    ],
)
def test_parse_errors(args: list[str], expected: str) -> None:
    with pytest.raises(RecipeError, match=expected):
        parse_override_args(args)


# ------------------------------------------------------------------------------------- typed values


@pytest.mark.parametrize(
    ("args", "path", "expected"),
    [
        (["--lora.enable_lora", "true"], ("lora", "enable_lora"), True),
        (["--lora.enable_lora=false"], ("lora", "enable_lora"), False),
        (["--train.max_steps", "null"], ("train", "max_steps"), None),
        (["--train.max_steps", "100"], ("train", "max_steps"), 100),
        (["--train.lr", "3e-5"], ("train", "lr"), 3e-5),
        (["--train.lr=1.5E-4"], ("train", "lr"), 1.5e-4),
        (["--lora.lora_target_modules", "[q_proj, v_proj]"], ("lora", "lora_target_modules"), ["q_proj", "v_proj"]),
        (["--lora.lora_target_modules", "all-linear"], ("lora", "lora_target_modules"), "all-linear"),
        (["--model.config_path", "{model_type: llama, hidden_size: 64}"], ("model", "config_path"),
         {"model_type": "llama", "hidden_size": 64}),
        (["--data.val_set_size", "0.05"], ("data", "val_set_size"), 0.05),
        (["--data.val_set_size", "10"], ("data", "val_set_size"), 10),
        (["--train.output_dir", "runs/x y"], ("train", "output_dir"), "runs/x y"),
    ],
)  # fmt: skip
def test_values_are_parsed_as_yaml(args: list[str], path: tuple, expected) -> None:
    data = apply(*args)
    value = data
    for key in path:
        value = value[key]
    assert value == expected and type(value) is type(expected)


def test_typed_values_reach_the_recipe(recipe_file: Path) -> None:
    recipe = load_recipe(
        recipe_file,
        [
            "--train.lr", "3e-5",
            "--train.max_steps", "20",
            "--lora.enable_lora", "true",
            "--lora.lora_target_modules", "[q_proj,v_proj]",
            "--train.report_to=[tensorboard]",
            "--model.special_tokens", "{pad_token: <pad>}",
            "--lora.modules_to_save", "[embed_tokens, lm_head]",
        ],
    )  # fmt: skip
    assert recipe.train.lr == 3e-5 and recipe.train.max_steps == 20
    assert recipe.lora.enable_lora is True and recipe.lora.lora_target_modules == ["q_proj", "v_proj"]
    assert recipe.train.report_to == ["tensorboard"]
    assert recipe.model.special_tokens.pad_token == "<pad>"


@pytest.mark.parametrize(
    ("args", "path", "expected"),
    [
        # YAML 1.1 reads `no` as false; mixed_precision only takes text, so the text is meant.
        (["--train.mixed_precision", "no"], ("train", "mixed_precision"), "no"),
        (["--model.revision", "1234"], ("model", "revision"), "1234"),
        (["--model.revision", "null"], ("model", "revision"), None),
        (["--data.datasets.1.role_map.human", "yes"], ("data", "datasets", 1, "role_map", "human"), "yes"),
        # Jinja is not valid YAML: a text-only field takes it as typed.
        (["--model.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}"], ("model", "chat_template"),
         "{% for m in messages %}{{ m.content }}{% endfor %}"),
        (["--model.chat_template", "{{ bos_token }}"], ("model", "chat_template"), "{{ bos_token }}"),
    ],
)  # fmt: skip
def test_text_only_fields_keep_the_text(args: list[str], path: tuple, expected) -> None:
    value = apply(*args)
    for key in path:
        value = value[key]
    assert value == expected


def test_non_text_fields_still_reject_bad_yaml() -> None:
    with pytest.raises(RecipeError, match=r"--model.config_path:1:\d+: invalid YAML"):
        apply("--model.config_path", "{model_type: [llama")


def test_parse_value_doc_examples() -> None:
    assert parse_value("3e-5", float, source="x") == 3e-5
    assert parse_value("no", typing.Literal["bf16", "fp16", "no"], source="x") == "no"
    assert parse_value("no", bool, source="x") is False
    assert parse_value("", str, source="x") == ""


def test_override_wins_over_the_file_and_input_is_not_mutated() -> None:
    data = copy.deepcopy(BASE)
    out = apply_overrides(data, ["--train.seed", "7"], Recipe)
    assert out["train"]["seed"] == 7
    assert data == BASE


def test_later_override_wins() -> None:
    assert apply("--train.seed", "7", "--train.seed=8")["train"]["seed"] == 8


def test_override_creates_missing_sections() -> None:
    out = apply("--hub.model_id", "org/name", "--lora.lora_rank", "8")
    assert out["hub"] == {"model_id": "org/name"} and out["lora"] == {"lora_rank": 8}


# --------------------------------------------------------------------------------------- list items


def test_list_item_field() -> None:
    out = apply("--data.datasets.0.path", "x.jsonl", "--data.datasets.1.type=completion")
    assert out["data"]["datasets"][0] == {"path": "x.jsonl", "type": "alpaca"}
    assert out["data"]["datasets"][1]["type"] == "completion"


def test_list_item_field_reaches_the_recipe(recipe_file: Path) -> None:
    overrides = [
        "--data.datasets.1.path",
        "c.jsonl",
        "--data.datasets.0.shards=2",
        "--data.datasets.0.shards_idx=1",
    ]
    recipe = load_recipe(recipe_file, overrides)
    assert recipe.data.datasets[1].path == "c.jsonl"
    assert (recipe.data.datasets[0].shards, recipe.data.datasets[0].shards_idx) == (2, 1)


def test_whole_list_item_and_append_at_the_end() -> None:
    out = apply("--data.datasets.2", "{path: c.jsonl, type: completion}")
    assert out["data"]["datasets"][2] == {"path": "c.jsonl", "type": "completion"}
    # A list the file does not set starts empty: index 0 appends to it.
    out = apply("--train.no_decay_params.0", "ln", "--train.iterations_to_skip.0", "5")
    assert out["train"]["no_decay_params"] == ["ln"] and out["train"]["iterations_to_skip"] == [5]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data.datasets.5.path", "x"], r"list data.datasets has 2 item\(s\); index 5 does not exist"),
        (["--data.datasets.3", "{path: x, type: alpaca}"], r"has 2 item\(s\); index 3 does not exist"),
        (["--train.no_decay_params.1", "ln"], r"has 0 item\(s\); index 1 does not exist"),
    ],
)
def test_out_of_range_index(args: list[str], expected: str) -> None:
    with pytest.raises(RecipeError, match=expected):
        apply(*args)


def test_list_needs_a_numeric_index() -> None:
    with pytest.raises(RecipeError, match=r"data.datasets is a list; use an index like data.datasets.0"):
        apply("--data.datasets.first.path", "x")


# ------------------------------------------------------------------------------------- dict-typed keys


def test_dict_field_keys(recipe_file: Path) -> None:
    data = copy.deepcopy(BASE)
    data["model"] = {"config_path": {"model_type": "llama", "hidden_size": 128}, "tokenizer_path": "tok"}
    out = apply(
        "--model.config_path.hidden_size", "64",
        "--model.config_path.rope_scaling.factor", "2.0",
        "--data.datasets.1.role_map.gpt", "assistant",
        "--data.datasets.1.role_map.human=person",
        data=data,
    )  # fmt: skip
    assert out["model"]["config_path"] == {
        "model_type": "llama",
        "hidden_size": 64,
        "rope_scaling": {"factor": 2.0},
    }
    assert out["data"]["datasets"][1]["role_map"] == {"human": "person", "gpt": "assistant"}
    recipe_file.write_text(yaml.safe_dump(data))
    recipe = load_recipe(
        recipe_file, ["--model.config_path.hidden_size", "64", "--data.datasets.1.role_map.gpt=bot"]
    )
    assert recipe.model.config_path["hidden_size"] == 64
    assert recipe.data.datasets[1].role_map == {"human": "user", "gpt": "bot"}


def test_dict_key_of_a_text_value_is_an_error() -> None:
    data = copy.deepcopy(BASE)
    data["model"]["config_path"] = "org/config"
    with pytest.raises(RecipeError, match=r"model.config_path is not a mapping"):
        apply("--model.config_path.hidden_size", "64", data=data)


# ------------------------------------------------------------------------------------- unknown paths


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("train.lrr", "'lrr' is not a field of train; did you mean 'train.lr'?"),
        ("trian.lr", "'trian' is not a field of the recipe; did you mean 'train'?"),
        (
            "data.datasets.0.pth",
            "'pth' is not a field of data.datasets.0; did you mean 'data.datasets.0.path'?",
        ),
        ("model.special_tokens.pad", "did you mean 'model.special_tokens.pad_token'?"),
        ("lora.enable_qlora_now", "did you mean 'lora.enable_qlora'?"),
        ("train.lr.peak", "train.lr is a single value, it has no field 'peak'"),
        ("train..lr", "empty part"),
        (
            "zzz",
            "'zzz' is not a field of the recipe (fields: model, data, train, lora, hub, eval, preference, reward, grpo, diffusion)",
        ),
    ],
)
def test_unknown_path_is_an_error(key: str, expected: str) -> None:
    with pytest.raises(RecipeError) as info:
        apply(f"--{key}", "1")
    assert f"unknown override --{key}" in str(info.value)
    assert expected in str(info.value)


def test_all_bad_overrides_are_reported_together(recipe_file: Path) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe_file, ["--trian.lr", "1", "--train.lrr", "2", "--data.datasets.9.path", "x"])
    message = str(info.value)
    assert message.startswith("3 bad overrides")
    assert "--trian.lr" in message and "--train.lrr" in message and "index 9 does not exist" in message


def test_check_path() -> None:
    assert check_path("data.datasets.0.path", Recipe) == ["data", "datasets", 0, "path"]
    assert check_path("model.config_path.hidden_size", Recipe) == ["model", "config_path", "hidden_size"]
    assert check_path("lora.lora_target_modules.2", Recipe) == ["lora", "lora_target_modules", 2]


def test_override_paths() -> None:
    assert override_paths(["--train.seed", "1", "--data.datasets.0.path=x"], Recipe) == {
        ("train", "seed"): "--train.seed",
        ("data", "datasets", 0, "path"): "--data.datasets.0.path",
    }
