"""Recipe error messages: every problem at once, with YAML path, line, bad value, allowed values.

Also the YAML layer they rest on (finetune.recipe.yaml_io): exponent floats, syntax errors with line and
column, duplicate keys, key line numbers.
"""

from __future__ import annotations

import copy
import random
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe, validate_recipe
from finetune.recipe.errors import format_validation_error, split_path, yaml_path
from finetune.recipe.yaml_io import dump_yaml, key_lines, parse_yaml, read_yaml

# Eleven problems of every kind across all sections; the comment says what each line breaks.
MANY_PROBLEMS = textwrap.dedent(
    """\
    model:
      model_path: org/base
      torch_dtyp: bf16                   # 3: unknown key (misspelled)
      attn_implementation: flash         # 4: bad enum
    data:
      datasets:
        - path: a.jsonl
          type: alpaca
        - path: b.jsonl
          type: chat                     # 10: bad enum in a list item
          shards: 4                      # 11: shards without shards_idx
      sequence_len: 512
      sample_packing_sequence_len: 256   # 13: shorter than sequence_len
    train:                               # output_dir is missing
      seed: abc                          # 15: wrong type
      lr: 1e-4
      adam_eps: .inf                     # 17: not finite
    lora:
      enable_qlora: true
      enable_lora: false                 # 20: contradicts enable_qlora
      lora_rank: many                    # 21: wrong type
    hub:
      strategy: every_save               # 23: no model_id
    """
)
# (start of the line, text the line must hold), in recipe order.
EXPECTED = [
    ("model.torch_dtyp (line 3)", "unknown key (value 'bf16'); did you mean 'torch_dtype'? Allowed keys: model_path"),
    ("model.attn_implementation (line 4)", "got 'flash'; allowed: 'eager', 'sdpa', 'flash_attention_2' or "
     "'flex_attention'"),
    ("data.datasets[1].shards_idx (not set; data.datasets[1] at line 9)", "got None: set shards and shards_idx"),
    ("data.datasets[1].type (line 10)", "got 'chat'; allowed: 'completion', 'alpaca', 'input_output', "
     "'chat_template', 'tokenized', 'preference', 'kto', 'prompt', 'images' or 'dreambooth'"),
    ("data.sample_packing_sequence_len (line 13)", "got 256: must be >= sequence_len (512)"),
    ("train.output_dir (not set; train at line 14)", "required field is missing (Checkpoints, logs, final weights.)"),
    ("train.seed (line 15)", "got 'abc': Input should be a valid integer"),
    ("train.adam_eps (line 17)", "got inf: Input should be a finite number"),
    ("lora.enable_lora (line 20)", "got False: enable_qlora trains LoRA adapters"),
    ("lora.lora_rank (line 21)", "got 'many': Input should be a valid integer"),
    ("hub.strategy (line 23)", "got 'every_save': set hub.model_id to push checkpoints"),
]  # fmt: skip

MINIMAL = textwrap.dedent(
    """\
    model:
      model_path: org/base
    data:
      datasets:
        - path: a.jsonl
          type: alpaca
    train:
      output_dir: out
    """
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def error_lines(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides or [])
    return str(info.value).splitlines()


def test_every_problem_is_reported_once_in_recipe_order(tmp_path: Path) -> None:
    path = write(tmp_path, MANY_PROBLEMS)
    lines = error_lines(path)
    assert lines[0] == f"{path}: {len(EXPECTED)} problem(s) in the recipe:"
    problems = lines[1:]
    assert len(problems) == len(EXPECTED), "\n".join(lines)
    for line, (where, text) in zip(problems, EXPECTED, strict=True):
        assert line.startswith(f"  - {where}: "), line
        assert text in line, line


def test_cli_prints_all_problems_exit_2_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, MANY_PROBLEMS)
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: {path}: {len(EXPECTED)} problem(s)")
    for where, text in EXPECTED:
        assert where in err and text in err
    assert "Traceback" not in err


def test_problems_from_overrides_name_the_flag(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace("output_dir: out", "output_dir: out\n  seed: 1"))
    problems = error_lines(
        path,
        ["--hub.strategy", "every_save", "--train.seed", "1.5", "--data.datasets.0", "{path: x, type: txt}"],
    )[1:]
    # Overrides come after the file's problems, in command-line order.
    assert problems[0].startswith("  - hub.strategy (from --hub.strategy): got 'every_save'")
    assert problems[1].startswith("  - train.seed (from --train.seed): got 1.5")
    assert problems[2].startswith("  - data.datasets[0].type (from --data.datasets.0): got 'txt'")
    assert not any("(line" in line for line in problems)


def test_file_problems_come_before_override_problems(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "  lr: -1\n")
    problems = error_lines(path, ["--train.micro_batch_size", "0"])[1:]
    assert problems[0].startswith("  - train.lr (line 9): got -1: Input should be greater than 0")
    assert problems[1].startswith("  - train.micro_batch_size (from --train.micro_batch_size): got 0")


@pytest.mark.parametrize(
    ("extra", "where", "text"),
    [
        ("lora:\n  lora_target_modules: 5\n", "lora.lora_target_modules (line 10)",
         "got 5; expected a valid list or 'all-linear'"),
        ("lora:\n  lora_target_modules: [q_proj, 3]\n", "lora.lora_target_modules (line 10)",
         "got ['q_proj', 3]; expected [1]: a valid string or 'all-linear'"),
        ("lora:\n  quant_type: nf5\n", "lora.quant_type (line 10)", "got 'nf5'; allowed: 'nf4' or 'fp4'"),
    ],
)  # fmt: skip
def test_union_problem_is_one_line(tmp_path: Path, extra: str, where: str, text: str) -> None:
    problems = error_lines(write(tmp_path, MINIMAL + extra))[1:]
    assert problems == [f"  - {where}: {text}"]


def test_union_problems_of_model_and_data_fields(tmp_path: Path) -> None:
    text = MINIMAL.replace("model_path: org/base", "model_path: org/base\n  config_path: 5")
    text = text.replace("train:", "  val_set_size: lots\ntrain:")
    problems = error_lines(write(tmp_path, text))[1:]
    assert problems == [
        "  - model.config_path (line 3): got 5; expected a valid string or a valid dictionary",
        "  - data.val_set_size (line 8): got 'lots'; expected a valid integer or a valid number",
    ]


def test_yaml_boolean_for_an_enum_gets_a_hint(tmp_path: Path) -> None:
    problems = error_lines(write(tmp_path, MINIMAL + "  mixed_precision: no\n"))[1:]
    assert len(problems) == 1
    assert "got False; allowed: 'bf16', 'fp16' or 'no'" in problems[0]
    assert "quote the value" in problems[0]


def test_misspelled_section_and_dataset_key(tmp_path: Path) -> None:
    text = MINIMAL.replace("train:", "trian:").replace("type: alpaca", "type: alpaca\n      feild_text: body")
    problems = "\n".join(error_lines(write(tmp_path, text)))
    assert (
        "data.datasets[0].feild_text (line 7): unknown key (value 'body'); did you mean 'field_text'?"
        in problems
    )
    assert "trian (line 8): unknown key" in problems and "did you mean 'train'?" in problems
    assert "train: required field is missing" in problems


def test_unknown_key_without_close_match_lists_allowed_keys(tmp_path: Path) -> None:
    problems = error_lines(write(tmp_path, MINIMAL + "hub:\n  zzz: 1\n"))[1:]
    assert problems == [
        "  - hub.zzz (line 10): unknown key (value 1) Allowed keys: model_id, private, strategy",
    ]


def test_long_values_are_shortened(tmp_path: Path) -> None:
    problems = error_lines(write(tmp_path, MINIMAL + f"  seed: {'x' * 300}\n"))[1:]
    assert "got 'xxxx" in problems[0] and "..." in problems[0] and len(problems[0]) < 250


def test_format_validation_error_without_lines() -> None:
    with pytest.raises(ValidationError) as info:
        validate_recipe({"model": {"model_path": "m"}, "data": {"datasets": [{"path": "a"}]}, "train": {}})
    message = format_validation_error(info.value, Recipe, source="inline")
    assert message.splitlines() == [
        "inline: 2 problem(s) in the recipe:",
        "  - data.datasets[0].type: required field is missing (How rows are formatted into prompt and trained "
        "text.)",
        "  - train.output_dir: required field is missing (Checkpoints, logs, final weights.)",
    ]


def test_format_validation_error_extra_problems() -> None:
    with pytest.raises(ValidationError) as info:
        validate_recipe({"model": {"model_path": "m"}, "data": {"datasets": [{"path": "a", "type": "x"}]}})
    message = format_validation_error(
        info.value, Recipe, extra=[("data.datasets.0.shards_idx", 9, "too big")], lines={("data",): 3}
    )
    assert "  - data.datasets[0].shards_idx (not set; data at line 3): got 9: too big" in message


def test_yaml_path_and_split_path() -> None:
    assert yaml_path(("data", "datasets", 1, "type")) == "data.datasets[1].type"
    assert yaml_path(()) == "<recipe>"
    assert split_path("data.datasets.1.type") == ("data", "datasets", 1, "type")
    assert split_path("") == ()


# ------------------------------------------------------------------------------------ files and YAML


def test_missing_recipe_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"error: recipe file not found: {tmp_path / 'nope.yaml'}" in err and "Traceback" not in err


def test_invalid_yaml_names_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, MINIMAL.replace("type: alpaca", "type: alpaca\n     - bad: [x"))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}:7:" in err and "invalid YAML" in err and "Traceback" not in err


def test_invalid_yaml_unclosed_bracket(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"recipe.yaml:\d+:\d+: invalid YAML"):
        load_recipe(write(tmp_path, "model: {model_path: x\ndata: 1\n"))


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(
        RecipeError, match=r"recipe.yaml:10:1: invalid YAML: duplicate key 'train' \(first at line 7\)"
    ):
        load_recipe(write(tmp_path, MINIMAL + "lora: {}\ntrain:\n  seed: 1\n"))
    with pytest.raises(RecipeError, match="duplicate key 'a'"):
        parse_yaml("{a: 1, a: 2}")


def test_yaml_merge_keys_still_work() -> None:
    assert parse_yaml("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n") == {
        "base": {"x": 1},
        "other": {"x": 1, "y": 2},
    }


def test_unreadable_recipe_is_a_recipe_error(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"model:\n  model_path: \xff\xfe\n")
    with pytest.raises(RecipeError, match="cannot read recipe file"):
        read_yaml(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3e-5", 3e-5),
        ("1E+4", 1e4),
        ("-2e-3", -2e-3),
        (".5e3", 500.0),
        ("3.0e-5", 3e-5),
        ("1_000", 1000),
        ("7", 7),
        ("1.0.0", "1.0.0"),
        ("e5", "e5"),
        ("1e", "1e"),
        ("true", True),
        ("null", None),
    ],
)
def test_scalars(text: str, expected) -> None:
    value = parse_yaml(text)
    assert value == expected and type(value) is type(expected)


def test_key_lines() -> None:
    lines = key_lines(MANY_PROBLEMS)
    assert lines[("model",)] == 1
    assert lines[("model", "torch_dtyp")] == 3
    assert lines[("data", "datasets", 1)] == 9
    assert lines[("data", "datasets", 1, "type")] == 10
    assert lines[("hub", "strategy")] == 23
    assert list(lines)[:3] == [("model",), ("model", "model_path"), ("model", "torch_dtyp")]
    assert key_lines("a: [") == {} and key_lines("") == {}


def test_recursive_alias_does_not_loop(tmp_path: Path) -> None:
    assert key_lines("a: &x\n  b: *x\n") == {("a",): 1, ("a", "b"): 2}
    problems = error_lines(write(tmp_path, MINIMAL + "hub: &h\n  private: *h\n"))[1:]
    assert len(problems) == 1 and problems[0].startswith("  - hub.private (line 10): got {'private': {...}}")


def test_dump_yaml_keeps_order_and_round_trips() -> None:
    data = {"train": {"seed": 1, "lr": 3e-5}, "model": {"config_path": {"b": 1, "a": 2}}, "x": ["é"]}
    text = dump_yaml(data)
    assert text.index("train") < text.index("model") and text.index("b:") < text.index("a:")
    assert "é" in text
    assert parse_yaml(text) == data


# ---------------------------------------------------------------------------------------- robustness

VALUES = [None, True, False, 0, -1, 5, 1.5, "x", "no", [], [1], ["a"], {}, {"k": 1}, "every_save", "fp16"]


def _key_paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key)
            yield from _key_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*prefix, i)
            yield from _key_paths(value, (*prefix, i))


def test_random_corruptions_give_recipe_errors_only(tmp_path: Path) -> None:
    """Whatever is wrong, the loader answers with a RecipeError listing problems, never a crash."""
    base = yaml.safe_load(MINIMAL)
    base["data"]["datasets"].append({"path": "b", "type": "chat_template", "shards": 2, "shards_idx": 1})
    base["model"]["special_tokens"] = {"pad_token": "<pad>"}
    base["lora"] = {"enable_lora": True, "modules_to_save": ["lm_head"]}
    base["train"]["max_steps"] = 10
    rng = random.Random(1234)
    path = tmp_path / "recipe.yaml"
    for _ in range(150):
        data = copy.deepcopy(base)
        for _ in range(rng.randint(1, 5)):
            *parents, last = rng.choice(list(_key_paths(data)))
            node = data
            for key in parents:
                node = node[key]
            if isinstance(node, dict) and rng.random() < 0.2:
                node.pop(last)
            else:
                node[last] = copy.deepcopy(rng.choice(VALUES))
        path.write_text(yaml.safe_dump(data))
        try:
            load_recipe(path)
        except RecipeError as exc:
            lines = str(exc).splitlines()
            assert lines[0].endswith("problem(s) in the recipe:") and len(lines) > 1
            assert all(line.startswith("  - ") for line in lines[1:])


# ------------------------------------------------------------------ dataset entries: a schema per type


def entry_problems(tmp_path: Path, entry: str, overrides: list[str] | None = None) -> list[str]:
    """The problems of MINIMAL with its dataset entry's lines (after `- path: a.jsonl`) replaced."""
    text = MINIMAL.replace("      type: alpaca\n", textwrap.indent(textwrap.dedent(entry), " " * 6))
    return error_lines(write(tmp_path, text), overrides)[1:]


def test_a_field_of_another_type_names_the_types_that_read_it(tmp_path: Path) -> None:
    [problem] = entry_problems(tmp_path, "type: completion\nfield_chosen: better\n")
    assert problem.startswith(
        "  - data.datasets[0].field_chosen (line 7): unknown key (value 'better'): only type preference read it, "
        "not completion. Allowed keys: path, type, name, split,"
    )
    assert problem.endswith("trust_remote_code, weight, field_text, train_on_eos")
    [problem] = entry_problems(tmp_path, "type: alpaca\nfield_prompt: question\n")
    assert "only type input_output, preference, kto, prompt read it, not alpaca." in problem


def test_a_field_another_type_reads_keeps_the_reason_it_does_not_apply(tmp_path: Path) -> None:
    [problem] = entry_problems(tmp_path, "type: preference\ntrain_on_inputs: true\n")
    assert problem.startswith(
        "  - data.datasets[0].train_on_inputs (line 7): unknown key (value True): only type"
    )
    assert (
        "not preference (it scores only completions, given their prompt, which is never trained)" in problem
    )
    [problem] = entry_problems(tmp_path, "type: chat_template\napply_chat_template: true\n")
    assert "not chat_template (chat rows are always rendered with the template)" in problem


def test_a_misspelled_field_of_another_type_is_suggested_with_its_type(tmp_path: Path) -> None:
    [problem] = entry_problems(tmp_path, "type: alpaca\nfield_chosn: c\n")
    assert (
        "unknown key (value 'c'); did you mean 'field_chosen'? (only type preference read it, not alpaca)"
        in problem
    )
    [problem] = entry_problems(tmp_path, "type: alpaca\nfield_outptu: c\n")
    assert "did you mean 'field_output'? Allowed keys" in problem  # a field of its own type: no note


def test_an_unknown_type_lists_the_valid_ones_and_judges_no_other_key(tmp_path: Path) -> None:
    problems = entry_problems(tmp_path, "type: sharegpt\nfield_messages: conversations\n")
    assert problems == [
        "  - data.datasets[0].type (line 6): got 'sharegpt'; allowed: 'completion', 'alpaca', 'input_output', "
        "'chat_template', 'tokenized', 'preference', 'kto', 'prompt', 'images' or 'dreambooth'"
    ]


def test_a_missing_type_is_reported_with_the_entry_line(tmp_path: Path) -> None:
    problems = entry_problems(tmp_path, "field_prompt: question\n")
    assert problems == [
        "  - data.datasets[0].type (not set; data.datasets[0] at line 5): required field is missing (How rows "
        "are formatted into prompt and trained text.)"
    ]


def test_an_entry_that_is_not_a_mapping(tmp_path: Path) -> None:
    text = MINIMAL.replace("    - path: a.jsonl\n      type: alpaca\n", "    - a.jsonl\n")
    assert error_lines(write(tmp_path, text))[1:] == [
        "  - data.datasets[0] (line 5): got 'a.jsonl': Input should be a mapping (a dataset entry: path, type "
        "and that type's fields)"
    ]


def test_entry_rules_run_beside_a_field_of_another_type(tmp_path: Path) -> None:
    problems = entry_problems(
        tmp_path, "type: chat_template\nroles_to_train: []\nfield_chosen: c\nshards: 2\n"
    )
    assert [p.split(":")[0] for p in problems] == [
        "  - data.datasets[0].shards_idx (not set; data.datasets[0] at line 5)",
        "  - data.datasets[0].roles_to_train (line 7)",
        "  - data.datasets[0].field_chosen (line 8)",
    ]


def test_an_override_of_another_types_field_names_the_flag(tmp_path: Path) -> None:
    problems = entry_problems(tmp_path, "type: alpaca\n", ["--data.datasets.0.field_chosen", "c"])
    assert problems == [
        "  - data.datasets[0].field_chosen (from --data.datasets.0.field_chosen): unknown key (value 'c'): only "
        "type preference read it, not alpaca. Allowed keys: path, type, name, split, revision, data_files, "
        "ds_type, shards, shards_idx, max_seq_len, trust_remote_code, weight, field_instruction, field_input, "
        "field_output, train_on_inputs, train_on_eos, apply_chat_template, roles_to_train"
    ]
    # A field no type has is refused as an override, with a did-you-mean over every type's fields.
    with pytest.raises(RecipeError, match=r"did you mean 'data\.datasets\.0\.field_chosen'\?"):
        load_recipe(write(tmp_path, MINIMAL), ["--data.datasets.0.field_chosn", "c"])


def test_lm_eval_data_files_for_a_task_not_run_is_named(tmp_path: Path):
    raw = {
        "model": {"model_path": "org/base"},
        "data": {"datasets": [{"path": "a.jsonl", "type": "alpaca"}]},
        "train": {"output_dir": "out"},
        "eval": {"lm_eval": {"tasks": ["gsm8k"], "data_files": {"gsm8kk": {"test": "t.jsonl"}}}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError, match=r"eval\.lm_eval\.data_files(.|\n)*gsm8kk(.|\n)*no such task"):
        load_recipe(path)
    raw["eval"]["lm_eval"]["data_files"] = {"gsm8k": {"test": "t.jsonl"}}
    path.write_text(yaml.safe_dump(raw))
    assert load_recipe(path).eval.lm_eval.data_files == {"gsm8k": {"test": "t.jsonl"}}
