"""The recipe: one YAML file describing a run, validated by pydantic before anything heavy is imported.

This package imports only pydantic and PyYAML, so `finetune validate` answers in well under two
seconds (no torch, transformers or datasets). Its modules:

* `base` (the section base class and cross-field problems), one schema module per section (`model`,
  `data`, `train`, `lora`, `hub`, `eval`, `diffusion`), `formats` (the schema of a dataset entry, one
  class per data format) and `schema` (the whole `Recipe` and the rules that span sections);
* `defaults`: defaults that depend on other fields, filled in before validation;
* `load`: YAML -> overrides -> defaults -> validation (`load_recipe`), reporting every problem at once
  through `errors`; `overrides` parses `--section.field value`; `yaml_io` reads and writes YAML.

Field names, defaults and descriptions are documented by the fields themselves:
`finetune validate recipe.yaml --explain` prints them.
"""

from finetune.recipe.data import (
    IMAGE_DATASET_TYPES,
    PREFERENCE_DATASET_TYPES,
    DataSection,
    DatasetEntry,
    dataset_entry,
)
from finetune.recipe.diffusion import DiffusionSection
from finetune.recipe.eval import EvalSection, GenerationSet
from finetune.recipe.hub import HubSection
from finetune.recipe.load import load_recipe, recipe_to_dict, recipe_warnings, validate_recipe
from finetune.recipe.lora import LoraSection
from finetune.recipe.model import KNOWN_CHAT_TEMPLATES, ModelSection, SpecialTokens
from finetune.recipe.schema import NOT_SUPPORTED_YET, Recipe
from finetune.recipe.train import TrainSection

__all__ = [
    "IMAGE_DATASET_TYPES",
    "KNOWN_CHAT_TEMPLATES",
    "NOT_SUPPORTED_YET",
    "PREFERENCE_DATASET_TYPES",
    "DataSection",
    "DatasetEntry",
    "DiffusionSection",
    "EvalSection",
    "GenerationSet",
    "HubSection",
    "LoraSection",
    "ModelSection",
    "Recipe",
    "SpecialTokens",
    "TrainSection",
    "dataset_entry",
    "load_recipe",
    "recipe_to_dict",
    "recipe_warnings",
    "validate_recipe",
]
