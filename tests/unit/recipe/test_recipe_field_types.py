"""Field types the whole recipe shares: regular expressions compile at validate time, and a boolean is
never taken as a number (pydantic's lax mode reads `true` as 1)."""

from __future__ import annotations

import re
import textwrap
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe import Recipe, load_recipe
from finetune.recipe.base import Regex

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
GRPO = textwrap.dedent(
    """\
    model:
      model_path: org/base
    data:
      datasets:
        - path: p.jsonl
          type: prompt
    train:
      output_dir: out
      objective: grpo
      micro_batch_size: 8
    grpo:
      rewards:
        - name: exact_match
          field_expected: answer
          answer_pattern: '#### (\\d+)'
        - name: format
          pattern: '^\\d+$'
    eval:
      generation_sets:
        - name: gsm8k
          path: g.jsonl
          answer_pattern: '#### (\\d+)'
    """
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text), overrides or [])
    return str(info.value)


def all_models(root: type[BaseModel] = Recipe) -> set[type[BaseModel]]:
    """Every model class reachable from `root` (sections, dataset entries, rewards, ...)."""
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


def _fields():
    return [(cls, name, field) for cls in all_models() for name, field in cls.model_fields.items()]


# ------------------------------------------------------------------------------------------ regexes


@pytest.mark.parametrize(
    ("field", "line"),
    [
        ("grpo.rewards[0].answer_pattern", 15),
        ("grpo.rewards[1].pattern", 17),
        ("eval.generation_sets[0].answer_pattern", 22),
    ],
)
def test_a_bad_regex_is_a_recipe_error_naming_path_line_pattern_and_fix(
    tmp_path: Path, field: str, line: int
):
    lines = GRPO.splitlines()
    key = lines[line - 1].split(":")[0]
    lines[line - 1] = f"{key}: '#### (\\d+'"  # the ) forgotten
    assert load_recipe(write(tmp_path, GRPO), [])  # as written, valid
    message = error_of(tmp_path, "\n".join(lines) + "\n")
    assert "1 problem(s)" in message, message
    assert f"{field} (line {line}): got '#### (\\\\d+'" in message
    assert "is not a valid regular expression (missing ), unterminated subpattern at position 5)" in message
    assert "needs a backslash before it" in message and "single quotes" in message


def test_a_bad_regex_from_an_override_exits_2_without_a_traceback(tmp_path: Path, capsys):
    path = write(tmp_path, GRPO)
    assert main(["validate", str(path), "--eval.generation_sets.0.answer_pattern", "(["]) == 2
    err = capsys.readouterr().err
    assert "eval.generation_sets[0].answer_pattern (from --eval.generation_sets.0.answer_pattern)" in err
    assert "unterminated character set" in err and "Traceback" not in err


def test_every_regex_field_is_compiled():
    """A pattern field (its description says regex) has the Regex type, so it is compiled when validated."""
    regex_fields = [
        f"{cls.__name__}.{name}"
        for cls, name, field in _fields()
        if name.endswith("pattern") or re.match(r"(\w+: )?(the )?regex", field.description or "")
    ]
    assert sorted(regex_fields) == [
        "GenerationSet.answer_pattern",
        "RewardSpec.answer_pattern",
        "RewardSpec.pattern",
    ]
    for cls, name, field in _fields():
        if f"{cls.__name__}.{name}" in regex_fields:
            assert Regex in typing.get_args(field.annotation), f"{cls.__name__}.{name}"
            with pytest.raises(ValidationError, match="not a valid regular expression"):
                TypeAdapter(field.annotation).validate_python("(")


# ----------------------------------------------------------------------------------- no bool numbers


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("train", "loss_chunk_size"),
        ("train", "lr"),
        ("train", "save_steps"),
        ("data", "sequence_len"),
        ("lora", "lora_dropout"),
        ("preference", "beta"),
        ("eval", "batch_size"),
    ],
)
def test_a_boolean_for_a_number_names_path_line_value_and_fix(tmp_path: Path, section: str, key: str):
    if f"\n{section}:\n" in f"\n{MINIMAL}":
        text = MINIMAL.replace(f"{section}:\n", f"{section}:\n  {key}: true\n", 1)
    else:
        text = MINIMAL + f"{section}:\n  {key}: true\n"
    line = text.splitlines().index(f"  {key}: true") + 1
    message = error_of(tmp_path, text)
    assert f"{section}.{key} (line {line}): got True: a boolean where " in message, message
    assert "write the number you mean" in message


def test_booleans_in_grpo_and_a_dataset_entry(tmp_path: Path):
    text = GRPO.replace("  micro_batch_size: 8\n", "  micro_batch_size: 8\n  max_steps: yes\n").replace(
        "grpo:\n", "grpo:\n  beta: true\n  temperature: false\n"
    )
    text = text.replace("      type: prompt\n", "      type: prompt\n      max_seq_len: on\n")
    message = error_of(tmp_path, text)
    for where in ("train.max_steps", "grpo.beta", "grpo.temperature", "data.datasets[0].max_seq_len"):
        assert re.search(rf"{re.escape(where)} \(line \d+\): got (True|False): a boolean where", message), (
            where
        )


def test_overrides_keep_working_and_refuse_booleans(tmp_path: Path):
    path = write(tmp_path, MINIMAL)
    recipe = load_recipe(path, ["--train.lr", "3e-5", "--train.loss_chunk_size", "512"])
    assert recipe.train.lr == 3e-5 and recipe.train.loss_chunk_size == 512
    assert load_recipe(write(tmp_path, MINIMAL + "preference:\n  beta: '1e-1'\n"), []).preference.beta == 0.1
    with pytest.raises(
        RecipeError, match=r"train\.loss_chunk_size \(from --train\.loss_chunk_size\): got True"
    ):
        load_recipe(path, ["--train.loss_chunk_size", "true"])


def _takes_numbers_not_booleans(annotation) -> bool:
    """From the field's JSON schema (pydantic's own view of its type, not the validator's)."""
    try:
        schema = TypeAdapter(annotation).json_schema()
    except Exception:
        return False
    options = schema.get("anyOf", [schema])
    types = {o.get("type") for o in options} | {
        type(v).__name__
        for o in options
        for v in o.get("enum", [o.get("const")])
        if "const" in o or "enum" in o
    }
    return bool(types & {"integer", "number"}) and not types & {"boolean", "bool", None}


def test_every_numeric_field_refuses_true():
    checked = []
    for cls, name, field in _fields():
        if not _takes_numbers_not_booleans(field.annotation):
            continue
        with pytest.raises(ValidationError) as info:
            cls.model_validate({name: True})
        at_field = [e for e in info.value.errors() if e["loc"][:1] == (name,)]
        assert at_field and at_field[0]["input"] is True, f"{cls.__name__}.{name} took true"
        checked.append(f"{cls.__name__}.{name}")
    assert len(checked) > 60, checked  # the schema has ~80 numeric fields: the walk found them


@pytest.mark.parametrize(
    "weight, says", [(1e6, "is at most 1000"), (1e300, "is at most 1000"), (float("inf"), "finite number")]
)
def test_a_mixture_weight_beyond_what_data_can_draw_is_refused_at_validate(weight, says):
    """A weight of 1e6 asked for a 21 GiB index and 1e300 overflowed: both tracebacks at prepare. At most
    1000 (each row 1000 times), said at validate."""
    from pydantic import ValidationError

    from finetune.recipe import dataset_entry

    with pytest.raises(ValidationError, match=says):
        dataset_entry(path="d.jsonl", type="completion", weight=weight)
    assert dataset_entry(path="d.jsonl", type="completion", weight=1000).weight == 1000
