"""Tools in a recipe (finetune.recipe.tools): grpo.tools / max_tool_calls / tool_timeout_s / environment and a
generation set's tools, their rules, and the functions checked at validate without importing them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from finetune.errors import RecipeError
from finetune.recipe import load_recipe
from finetune.recipe.eval import GenerationSet
from finetune.recipe.grpo import GrpoSection

REPO = Path(__file__).resolve().parents[3]
CALC = {"function": "calc.py:calculate", "trigger": "<<([^<>=]*)=", "close": ">>"}
REWARDS = [{"name": "length"}]


def problems(**fields) -> str:
    with pytest.raises(Exception) as info:
        GrpoSection(**fields)
    return str(info.value)


def test_the_issues_yaml_validates():
    section = GrpoSection(
        rewards=REWARDS,
        tools=[CALC, {"function": "tools.py:get_weather"}],
        max_tool_calls=4,
        tool_timeout_s=10,
    )
    assert section.tools[0].trigger == "<<([^<>=]*)=" and section.tools[1].trigger is None
    gen_set = GenerationSet(name="wp", path="held_out.jsonl", field_prompt="question", field_expected="answer",
                            metric="exact_match", tools=[CALC])  # fmt: skip
    assert gen_set.tools[0].close == ">>" and gen_set.max_tool_calls == 4


def test_rules_of_the_tools():
    assert "close: is inserted after inline results only" in problems(
        rewards=REWARDS, tools=[{"function": "t.py:f", "close": ">>"}]
    )
    assert "write it as path/to/file.py:function" in problems(
        rewards=REWARDS, tools=[{"function": "nocolon"}]
    )
    assert "max_tool_calls: is read when there are tools" in problems(rewards=REWARDS, max_tool_calls=2)
    assert "tool_timeout_s: is read when there are tools" in problems(rewards=REWARDS, tool_timeout_s=1)
    assert "two chat tools have the same name" in problems(
        rewards=REWARDS, tools=[{"function": "a.py:f"}, {"function": "b.py:f"}]
    )
    assert "generation_backend vllm is not built yet" in problems(
        rewards=REWARDS, tools=[CALC], generation_backend="vllm"
    )
    assert "beside chat tools is not built yet" in problems(
        rewards=REWARDS, tools=[{"function": "t.py:f"}], environment="env.py:Game"
    )
    assert "give at least one reward" in problems()
    assert "is the environment's reward's name" in problems(
        rewards=[{"function": "r.py:environment"}], environment="env.py:Game"
    )
    assert "not a valid regular expression" in problems(
        rewards=REWARDS, tools=[{**CALC, "trigger": "(unclosed"}]
    )
    GrpoSection(environment="env.py:Game", max_tool_calls=3)  # an environment alone, its turns capped


TOOLS_PY = '''
import math

def calculate(expression):
    return expression

def two(a, b):
    return a

def untyped(city):
    """The weather."""

def typed(city: str) -> str:
    """The weather.

    Args:
        city: a city
    """

sqrt = math.sqrt

class Game:
    def reset(self, row):
        return "go"

    def step(self, text):
        return "", 1.0, True

class Broken:
    def reset(self, row):
        return "go"
'''


@pytest.fixture
def recipe(tmp_path) -> Path:
    shutil.copy(REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml", tmp_path / "grpo.yaml")
    shutil.copy(REPO / "recipes" / "demo" / "rewards.py", tmp_path / "rewards.py")
    (tmp_path / "calc.py").write_text(TOOLS_PY)
    return tmp_path / "grpo.yaml"


@pytest.mark.parametrize(
    "tools, message",
    [
        ("[{function: nope.py:f, trigger: '(a)'}]", r"grpo.tools\[0\].function: got 'nope.py:f': the file nope.py does not exist"),
        ("[{function: calc.py:missing, trigger: '(a)'}]", r"calc.py defines no 'missing' at its top level"),
        ("[{function: calc.py:two, trigger: '<<([^<>=]*)='}]", r"has 1 group, so the tool is called with 1 argument, which two\(a, b\) cannot take"),
        ("[{function: calc.py:calculate, trigger: '(a)(b)'}]", r"has 2 groups, so the tool is called with 2 arguments"),
        ("[{function: calc.py:untyped}]", r"untyped\(city\) has no type hints for city"),
        ("[{function: calc.py:calculate}]", r"calculate\(expression\) has no docstring"),
    ],
)  # fmt: skip
def test_validate_names_a_tool_that_cannot_work_without_running_it(recipe, tools, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe, ["--grpo.tools", tools])


def test_validate_accepts_tools_it_can_check_and_leaves_the_rest_to_the_start(recipe):
    fine = ["--grpo.tools", "[{function: calc.py:calculate, trigger: '<<([^<>=]*)=', close: '>>'}, "
            "{function: calc.py:typed}, {function: calc.py:sqrt, trigger: '(x)'}, {function: json:dumps}]"]  # fmt: skip
    assert len(load_recipe(recipe, fine).grpo.tools) == 4
    assert load_recipe(recipe, ["--grpo.environment", "calc.py:Game"]).grpo.environment == "calc.py:Game"
    with pytest.raises(
        RecipeError, match=r"grpo.environment: got 'calc.py:Broken': the environment class has no step"
    ):
        load_recipe(recipe, ["--grpo.environment", "calc.py:Broken"])
    sets = "[{name: wp, path: x.jsonl, tools: [{function: calc.py:nope, trigger: '(a)'}]}]"
    with pytest.raises(
        RecipeError, match=r"eval.generation_sets\[0\].tools\[0\].function: .*defines no 'nope'"
    ):
        load_recipe(recipe, ["--eval.generation_sets", sets])
