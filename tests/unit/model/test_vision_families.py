"""finetune.model.families, the table of vision families, against tiny models of each family built from
configs (tests/vlm_configs.py) and their real image processors (tests/vlm_processors.py): the tower and
projector names are modules of the models, the pixel layout is what the image processor makes, the
patch-merge factor is the model's patches per image token; a model of no known family gets the generic
names, or an error where only a row can answer; and no module outside the table tests a model_type."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, CLIPImageProcessorPil

from finetune.errors import FinetuneError
from finetune.model import families
from finetune.model.families import FAMILIES, GENERIC, PIXEL_LAYOUTS, family_for, patch_grid_of
from finetune.model.vlm import parts
from finetune.plan.images import image_input
from finetune.plan.inventory import inventory_of
from finetune.recipe import validate_recipe
from tests.vlm_configs import CONFIGS
from tests.vlm_processors import PROCESSORS

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "finetune"
DEMO = REPO / "recipes/demo/tiny_vlm_cpu.yaml"
MODEL_TYPES = [t for family in FAMILIES for t in family.model_types]


def _image_processor(model_type: str):
    """A real image processor of the model type's family, making 32-pixel images (LLaVA's is CLIP's)."""
    made = {"idefics3": "smolvlm", "smolvlm": "smolvlm", "gemma3": "gemma3"}
    made |= {"qwen2_vl": "qwen2.5-vl", "qwen2_5_vl": "qwen2.5-vl"}
    if model_type in made:
        return PROCESSORS[made[model_type]]()[0].image_processor
    return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _tiny(model_type: str):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(CONFIGS[model_type]())


def _pixels(model_type: str) -> dict[str, torch.Tensor]:
    """The image processor's tensors for two rows, of two images and one."""
    image = Image.new("RGB", (40, 30), (200, 10, 10))
    out = _image_processor(model_type)(images=[[image, image], [image]], return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def test_the_rows_are_consistent():
    assert set(CONFIGS) == set(MODEL_TYPES), "tests/vlm_configs.py has a tiny config of every model type"
    assert len(MODEL_TYPES) == len(set(MODEL_TYPES)), "a model type in two rows"
    for family in (*FAMILIES, GENERIC):
        assert family.pixels in PIXEL_LAYOUTS and family.towers
        assert (family.pixels == "flat_patches") == (family.patch_grid is not None), family.name


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tower_and_projector_names_are_modules_of_the_model(model_type):
    net = _tiny(model_type)
    family = family_for(net)
    assert model_type in family.model_types and family_for(net.config) is family
    last_names = {name.rsplit(".", 1)[-1] for name, _ in net.named_modules()}
    assert set(family.towers) <= last_names and set(family.projectors) <= last_names
    towers, projectors = parts(net)
    assert [t.rsplit(".", 1)[-1] for t in towers] == list(family.towers)
    assert [p.rsplit(".", 1)[-1] for p in projectors] == list(family.projectors)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_pixel_layout_is_the_image_processors(model_type):
    family, pixels = family_for(model_type), _pixels(model_type)
    first = pixels["pixel_values"].shape[0]
    if family.pixels == "per_row":
        assert first == 2
    elif family.pixels == "per_image":
        assert first == 3
    else:
        grid = pixels[family.patch_grid]
        assert patch_grid_of(pixels) == family.patch_grid and grid.shape[0] == 3
        assert grid.prod(dim=-1).sum() == first
        # each patch's values: 3 colours x patch x patch pixels x frames_per_patch frames
        patch = CONFIGS[model_type]().vision_config.patch_size
        assert pixels["pixel_values"].shape[1] == 3 * patch * patch * family.frames_per_patch


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_merge_is_the_models_patches_per_image_token(model_type):
    family, net, pixels = family_for(model_type), _tiny(model_type), _pixels(model_type)
    # LLaVA: every patch's feature, not the CLIP default that drops the first (the class token)
    extra = {"vision_feature_select_strategy": "full"} if model_type == "llava" else {}
    with torch.no_grad():
        features = net.model.get_image_features(**pixels, **extra).pooler_output
    tokens = (
        sum(f.shape[0] for f in features) if isinstance(features, list | tuple) else features[:, :, 0].numel()
    )
    vision = net.config.vision_config
    if family.patch_grid:
        patches = int(pixels[family.patch_grid].prod(dim=-1).sum())
    else:
        patches = 3 * (vision.image_size // vision.patch_size) ** 2
    assert patches == tokens * family.merge(net.config)
    assert family.rope_per_row == hasattr(net.model, "get_rope_index")  # a multimodal RoPE's positions
    assert bool(family.max_pixels) == (not getattr(vision, "image_size", 0))  # dynamic resolution


def test_idefics3_crops_are_its_processors_largest_split():
    from transformers import Idefics3ImageProcessorPil

    processor = Idefics3ImageProcessorPil()
    crops = math.ceil(processor.size["longest_edge"] / processor.max_image_size["longest_edge"]) ** 2 + 1
    assert processor.do_image_splitting and family_for("idefics3").max_crops == crops


def test_a_model_of_no_known_family_gets_the_generic_names():
    config = AutoConfig.for_model(
        "llava_next",
        vision_config=CONFIGS["llava"]().vision_config,
        text_config=CONFIGS["llava"]().text_config,
    )
    with torch.device("meta"):
        net = AutoModelForImageTextToText.from_config(config)
    assert family_for(net) is GENERIC and family_for("") is GENERIC and family_for(object()) is GENERIC
    assert parts(net) == (["model.vision_tower"], ["model.multi_modal_projector"])


def test_an_unknown_family_is_an_error_where_only_a_row_can_answer():
    with pytest.raises(FinetuneError, match=r"patches: model_type 'mystery_vl' is in no row .*families\.py"):
        family_for("mystery_vl", required="patches")
    assert family_for("qwen2_vl", required="patches").rope_per_row
    # The planner: a tower that takes any image size, of no known family, cannot be counted.
    inv = inventory_of(_tiny("qwen2_vl"), vision_language=True)
    mystery = dataclasses.replace(inv.vision, family=GENERIC, model_type="mystery_vl", image_size=0)
    raw = yaml.safe_load(DEMO.read_text())
    recipe = validate_recipe({**raw, "model": {**raw["model"], "tokenizer_path": "nobody/processor"}})
    with pytest.raises(FinetuneError, match=r"the planner's patches per image .*--patches-per-image"):
        image_input(mystery, recipe, images_per_row=1)
    assert image_input(mystery, recipe, images_per_row=1, patches_per_image=64).patches_per_image == 64


def _sources() -> dict[Path, str]:
    return {path: path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")}


def test_model_type_startswith_only_in_the_table():
    found = [p.relative_to(PACKAGE) for p, text in _sources().items() if "model_type.startswith" in text]
    assert all(p == Path("model/families.py") for p in found), found


def test_no_module_but_the_table_names_a_family_model_type():
    """A family check by name (`== "idefics3"`, `in ("qwen2_vl", ...)`) outside families.py: any string
    constant that is a table model type (docstrings and comments are prose, not checks)."""
    import gguf

    # finetune/gguf/ compares GGUF architecture names (llama.cpp's "gemma3" text graph), another namespace
    # than transformers' model types, even where the spelling is the same.
    gguf_archs = set(gguf.MODEL_ARCH_NAMES.values())
    found = []
    for path, text in _sources().items():
        if path == Path(families.__file__):
            continue
        in_gguf = path.parent == PACKAGE / "gguf"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and node.value in MODEL_TYPES:
                if in_gguf and node.value in gguf_archs:
                    continue
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not found, found
