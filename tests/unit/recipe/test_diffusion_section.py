"""The `diffusion` recipe section and its combinations with model.kind, data, lora and train."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import load_recipe, recipe_to_dict, validate_recipe
from finetune.recipe.diffusion import DIFFUSION_DEFAULT_LORA_TARGETS

BASE = {
    "model": {"kind": "diffusion", "model_path": "org/sd"},
    "data": {"datasets": [{"path": "photos", "type": "dreambooth"}]},
    "train": {"output_dir": "out"},
    "diffusion": {"instance_prompt": "a photo of sks dog"},
}


def problems(tmp_path: Path, data: dict) -> list[str]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return str(info.value).splitlines()[1:]


def with_changes(**sections) -> dict:
    data = copy.deepcopy(BASE)
    for section, values in sections.items():
        if values is None:
            data.pop(section, None)
        else:
            data.setdefault(section, {}).update(values)
    return data


def test_minimal_diffusion_recipe_resolves_its_implied_values() -> None:
    recipe = validate_recipe(BASE)
    assert recipe.model.kind == "diffusion"
    assert recipe.lora.enable_lora is True
    assert recipe.lora.lora_target_modules == DIFFUSION_DEFAULT_LORA_TARGETS
    assert recipe.diffusion.resolution == 512 and recipe.diffusion.snr_gamma is None
    # The resolved recipe (written next to the outputs) loads back unchanged.
    assert validate_recipe(recipe_to_dict(recipe)) == recipe


def test_section_defaults_when_left_out_and_explicit_all_linear_is_kept() -> None:
    data = with_changes(diffusion=None, lora={"lora_target_modules": "all-linear"})
    data["data"]["datasets"][0]["type"] = "images"
    recipe = validate_recipe(data)
    assert recipe.diffusion is not None and recipe.diffusion.caption_column == "text"
    assert recipe.lora.lora_target_modules == "all-linear"


def test_llm_recipes_are_unchanged() -> None:
    recipe = validate_recipe(
        {
            "model": {"model_path": "m"},
            "data": {"datasets": [{"path": "a", "type": "alpaca"}]},
            "train": {"output_dir": "o"},
        }
    )
    assert recipe.model.kind == "llm" and recipe.diffusion is None
    assert recipe.lora.lora_target_modules == "all-linear" and recipe.lora.enable_lora is False


def test_llm_only_fields_and_text_datasets_are_reported_with_their_paths(tmp_path: Path) -> None:
    data = with_changes(train={"eval_steps": 5}, lora={"use_dora": True})
    data["data"]["datasets"].append({"path": "x.jsonl", "type": "alpaca"})
    lines = problems(tmp_path, data)
    joined = "\n".join(lines)
    assert len(lines) == 3, joined
    assert "train.eval_steps" in joined and "validation_steps" in joined
    assert "lora.use_dora" in joined and "does not apply to a diffusion recipe" in joined
    assert "data.datasets[1].type" in joined and "image sources" in joined


def test_text_only_settings_are_warnings_in_a_diffusion_recipe(tmp_path: Path) -> None:
    """Settings that change nothing for images (text formatting, packing) are said, not refused."""
    from finetune.recipe import recipe_warnings

    data = with_changes(data={"sequence_len": 512}, model={"chat_template": "chatml"})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    warnings = recipe_warnings(load_recipe(path))
    assert [w.split(" (")[0] for w in warnings] == ["model.chat_template", "data.sequence_len"]
    assert all("does nothing in a diffusion recipe" in w for w in warnings)


def test_image_sources_need_diffusion_kind_and_the_section_needs_it_too(tmp_path: Path) -> None:
    data = with_changes(model={"kind": "llm"})
    joined = "\n".join(problems(tmp_path, data))
    assert "data.datasets[0].type" in joined and "need model.kind: diffusion" in joined
    assert "diffusion (line" in joined and "set model.kind: diffusion" in joined


@pytest.mark.parametrize(
    ("changes", "path", "text"),
    [
        ({"diffusion": {"instance_prompt": None}}, "diffusion.instance_prompt", "dreambooth datasets need"),
        ({"diffusion": {"with_prior_preservation": True}}, "diffusion.class_prompt", "needs class_data_dir"),
        ({"diffusion": {"validation_steps": 10}}, "diffusion.validation_steps", "set validation_prompts"),
        ({"lora": {"enable_lora": False}}, "lora.enable_lora", "train LoRA adapters"),
        ({"lora": {"use_dora": True}}, "lora.use_dora", "not supported yet"),
        ({"model": {"model_path": None}}, "model.model_path", "diffusers pipeline"),
        ({"data": {"push_dataset_to_hub": "me/x"}}, "data.push_dataset_to_hub", "not supported yet"),
        ({"diffusion": {"snr_gamma": 0}}, "diffusion.snr_gamma", "greater than 0"),
        (
            {"diffusion": {"train_text_encoder": True, "adapter": "lokr"}},
            "diffusion.train_text_encoder",
            "adapter lokr does not write",
        ),
        ({"diffusion": {"text_encoder_lr": 1e-5}}, "diffusion.text_encoder_lr", "without train_text_encoder"),
        (
            {"diffusion": {"adapter": "full"}, "model": {"torch_dtype": "bf16"}},
            "model.torch_dtype",
            "keeps the trained denoiser in fp32",
        ),
        ({"diffusion": {"adapter": "dora"}}, "diffusion.adapter", "'lora', 'lokr', 'loha' or 'full'"),
        (
            {"diffusion": {"prediction_type": "flow"}},
            "diffusion.prediction_type",
            "'epsilon', 'v_prediction' or 'flow_matching'",
        ),
    ],
)
def test_bad_combinations(tmp_path: Path, changes: dict, path: str, text: str) -> None:
    lines = problems(tmp_path, with_changes(**changes))
    assert any(path in line and text in line for line in lines), "\n".join(lines)


def test_instance_prompt_needs_a_dreambooth_source(tmp_path: Path) -> None:
    data = with_changes()
    data["data"]["datasets"][0]["type"] = "images"
    assert any("is used by dreambooth datasets only" in line for line in problems(tmp_path, data))


def test_overrides_reach_the_diffusion_section(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    recipe = load_recipe(path, ["--diffusion.snr_gamma", "5", "--diffusion.validation_prompts", "[a, b]"])
    assert recipe.diffusion.snr_gamma == 5.0 and recipe.diffusion.validation_prompts == ["a", "b"]


def test_training_modes_resolve() -> None:
    recipe = validate_recipe(with_changes(diffusion={"train_text_encoder": True, "text_encoder_lr": 5e-6}))
    assert recipe.diffusion.adapter == "lora" and recipe.diffusion.text_encoder_lr == 5e-6
    full = validate_recipe(with_changes(diffusion={"adapter": "full", "use_ema": True}))
    assert full.diffusion.adapter == "full" and full.diffusion.use_ema


def test_lora_sizes_with_full_finetuning_are_warnings() -> None:
    recipe = validate_recipe(with_changes(diffusion={"adapter": "full"}, lora={"lora_rank": 8}))
    assert any(
        path == "lora.lora_rank" and "diffusion.adapter: full" in reason
        for path, _, reason in recipe._warnings()
    )
