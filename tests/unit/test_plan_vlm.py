"""finetune.plan on vision-language models (model.kind vlm): the inventory against the real models'
parameter counts (tiny Idefics3, Qwen2-VL, Qwen2.5-VL and Gemma 3 built offline from configs), the
frozen and trained splits against finetune.model.vlm and PEFT, the activations against what autograd saves
on CPU for the tiny demo VLM, and `finetune plan` on the shipped VLM recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForImageTextToText

from finetune.accelerate_config import DistributedSetup
from finetune.cli import main
from finetune.model import vlm
from finetune.model.adapters import apply_lora
from finetune.plan import estimate, make_plan
from finetune.plan.images import image_input
from finetune.plan.inventory import adapter_counts, inspect_model, inventory_of
from finetune.plan.states import model_states
from finetune.recipe import Recipe, validate_recipe
from tests.memory import saved_tensor_bytes

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes/demo/tiny_vlm_cpu.yaml"
LLAMA_TEXT = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "tie_word_embeddings": False,
}  # fmt: skip
QWEN_TEXT = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 64, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
}  # fmt: skip
TINY = {  # model_type: config of a tiny image-text-to-text model
    "idefics3": {
        "image_token_id": 5, "scale_factor": 2, "text_config": LLAMA_TEXT,
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
    },
    "qwen2_vl": {
        "image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 7, "text_config": QWEN_TEXT,
        "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 32, "patch_size": 4,
                          "spatial_merge_size": 2, "mlp_ratio": 2},
    },
    "qwen2_5_vl": {
        "image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 7, "text_config": QWEN_TEXT,
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                          "out_hidden_size": 32, "patch_size": 4, "spatial_merge_size": 2,
                          "fullatt_block_indexes": [1]},
    },
    "gemma3": {
        "image_token_index": 5, "mm_tokens_per_image": 4,
        "text_config": {"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "head_dim": 16, "vocab_size": 64},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
    },
}  # fmt: skip
# Published configs (config.json of the Hub repos), given inline as the planner downloads nothing.
QWEN2_5_VL_3B = {
    "model_type": "qwen2_5_vl", "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "tie_word_embeddings": True,
    "text_config": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                    "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                    "tie_word_embeddings": True, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
}  # fmt: skip
SMOLVLM_INSTRUCT = {
    "model_type": "idefics3", "image_token_id": 49153, "scale_factor": 3, "tie_word_embeddings": False,
    "text_config": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
                    "vocab_size": 49155, "tie_word_embeddings": False},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "image_size": 384, "patch_size": 14},
}  # fmt: skip


def _recipe(config: dict, *, model: dict | None = None, lora: dict | None = None, **sections) -> Recipe:
    return validate_recipe(
        {
            "model": {"kind": "vlm", "config_path": config, "tokenizer_path": "proc", **(model or {})},
            "data": {"datasets": [{"path": "d.jsonl", "type": "chat_template"}], "sequence_len": 64},
            "train": {"output_dir": "out", **sections.get("train", {})},
            "lora": lora or {},
        }
    )


def _tiny(model_type: str) -> tuple[dict, torch.nn.Module]:
    config = {"model_type": model_type, **TINY[model_type]}
    raw = dict(config)
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    return config, net


def _params(net, prefixes=None, *, trainable=False) -> int:
    return sum(
        p.numel()
        for n, p in net.named_parameters()
        if (prefixes is None or any(n.startswith(x + ".") for x in prefixes))
        and (p.requires_grad or not trainable)
    )


# --------------------------------------------------------------------------------------------- inventory


@pytest.mark.parametrize("model_type", TINY)
def test_inventory_counts_equal_the_real_model(model_type):
    """Built on the meta device from the config, as `finetune plan` does: the same totals as the model
    built for real, the vision tower and projector apart, the language model's layers only."""
    config, net = _tiny(model_type)
    inv = inspect_model(_recipe(config).model)
    towers, projectors = vlm.parts(net)
    assert inv.total == _params(net)
    assert inv.vision.tower_params == _params(net, towers) > 0
    assert inv.vision.projector_params == _params(net, projectors)
    assert sum(m.kind == "layer" for m in inv.modules) == inv.num_layers == 2
    assert not any(m.name.startswith(tuple(towers + projectors)) for m in inv.modules)
    assert inv.vision.num_layers == 2 and inv.vision.hidden_size == 32


@pytest.mark.parametrize("model_type", ["idefics3", "qwen2_5_vl"])
@pytest.mark.parametrize(("tower", "projector"), [(False, False), (False, True), (True, True)])
def test_trainable_splits_equal_vlm_freeze_and_peft(model_type, tower, projector):
    """Full fine-tuning trains what finetune.model.vlm.freeze leaves; LoRA trains what PEFT adds with
    finetune.model.vlm.lora_settings (the tower's linears with train_vision_tower, the projector saved)."""
    config, net = _tiny(model_type)
    flags = {"train_vision_tower": tower, "train_projector": projector}
    inv = inventory_of(net, vision_language=True)
    full = _recipe(config, model=flags)
    layout = model_states(
        inv, adapter_counts(inv, full.lora, full.model), full, DistributedSetup(), checkpointing=False
    )
    vlm.freeze(net, **flags)
    assert layout.states.trainable_params == _params(net, trainable=True)
    assert layout.states.frozen == 4 * (inv.total - _params(net, trainable=True))

    lora = _recipe(config, model=flags, lora={"enable_lora": True, "lora_rank": 4})
    adapter = adapter_counts(inv, lora.lora, lora.model)
    _, fresh = _tiny(model_type)
    peft = apply_lora(
        fresh, lora.lora, gradient_checkpointing=False, **vlm.lora_settings(fresh, "all-linear", [], **flags)
    )
    assert adapter.trainable == _params(peft, trainable=True)
    # Qwen2-VL's merger (its projector) is inside `visual`: it trains with the tower
    assert adapter.saved_params == (inv.vision.projector_params if projector else 0)
    assert bool(inv.vision.projector_params) == (model_type == "idefics3")


# ------------------------------------------------------------------------------------------ activations


@pytest.fixture(scope="module")
def demo():
    """The tiny demo VLM's recipe and a batch as collate_vlm makes it: 4 rows of 64 tokens (one padded),
    one 32px image each (4 image tokens)."""
    raw = yaml.safe_load(DEMO.read_text())
    raw["model"]["tokenizer_path"] = str(REPO / raw["model"]["tokenizer_path"])
    torch.manual_seed(0)
    rows, seq = 4, 64
    ids = torch.randint(10, 700, (rows, seq))
    ids[:, 5:9] = raw["model"]["config_path"]["image_token_id"]
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[1, 50:] = 0
    batch = {
        "input_ids": ids, "attention_mask": mask, "labels": ids.clone(),
        "pixel_values": torch.randn(rows, 1, 3, 32, 32),
        "pixel_attention_mask": torch.ones(rows, 1, 32, 32, dtype=torch.bool),
    }  # fmt: skip
    return raw, batch


CASES = {  # id: (train_vision_tower, train_projector, LoRA)
    "full-tower-projector": (True, True, False),
    "full-projector": (False, True, False),
    "full-frozen-vision": (False, False, False),
    "lora-projector": (False, True, True),
    "lora-tower-projector": (True, True, True),
}


@pytest.mark.parametrize(("tower", "projector", "lora"), CASES.values(), ids=CASES)
def test_predicted_activations_match_saved_tensors(demo, tower, projector, lora):
    """The formula (language model + vision tower + projector) against what autograd saves in the
    demo VLM's forward on CPU, within 1% as the LLM planner's test; the vision part alone matches the
    difference from a frozen vision tower exactly for full fine-tuning."""
    raw, batch = demo
    rows = batch["input_ids"].shape[0]

    def run(tower: bool, projector: bool) -> tuple[int, object]:
        model = {**raw["model"], "train_vision_tower": tower, "train_projector": projector}
        recipe = validate_recipe(
            {**raw, "model": model, "train": {**raw["train"], "micro_batch_size": rows},
             "lora": {"enable_lora": True, "lora_dropout": 0.0} if lora else {}}
        )  # fmt: skip
        config = dict(model["config_path"])
        torch.manual_seed(0)
        net = AutoModelForImageTextToText.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config), attn_implementation="sdpa"
        )
        inv = inventory_of(net, vision_language=True)
        if lora:
            settings = vlm.lora_settings(
                net, "all-linear", [], train_vision_tower=tower, train_projector=projector
            )
            net = apply_lora(net, recipe.lora, gradient_checkpointing=False, **settings)
        else:
            vlm.freeze(net, train_vision_tower=tower, train_projector=projector)
        est = estimate(
            inv, recipe, DistributedSetup(), micro_batch_size=rows, checkpointing=False,
            images=image_input(inv.vision, recipe),
        )  # fmt: skip
        return saved_tensor_bytes(net.train(), batch), est.activations

    measured, acts = run(tower, projector)
    assert acts.saved == pytest.approx(measured, rel=0.01)
    assert (acts.vision > 0) == (tower or projector)
    if not lora and (tower or projector):
        frozen_measured, frozen_acts = run(False, False)
        assert frozen_acts.vision == 0
        assert acts.vision == pytest.approx(measured - frozen_measured, rel=0.01)


@pytest.mark.parametrize(
    ("tower", "projector"), [(True, True), (False, False)], ids=["demo", "frozen-vision"]
)
def test_predicted_peak_matches_cpu_for_the_demo_vlm(demo, tower, projector):
    """The formula's peak (no checkpointing: the start of the backward) against the most bytes alive in
    one forward and backward of the demo VLM on CPU with the loss the SFT objective computes, within
    1% as the LLM planner's peak test (the weights' gradients come later, as activations are freed)."""
    from finetune.losses.causal_lm import forward
    from tests.memory import peak_allocated_bytes

    raw, batch = demo
    rows = batch["input_ids"].shape[0]
    model = {**raw["model"], "train_vision_tower": tower, "train_projector": projector}
    recipe = validate_recipe({**raw, "model": model, "train": {**raw["train"], "micro_batch_size": rows}})
    config = dict(model["config_path"])
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config), attn_implementation="sdpa"
    )
    inv = inventory_of(net, vision_language=True)
    vlm.freeze(net, train_vision_tower=tower, train_projector=projector)
    net.train()
    num_items = (batch["labels"][:, 1:] != -100).sum()
    measured = peak_allocated_bytes(lambda: forward(net, batch, num_items=num_items).loss.backward())
    est = estimate(
        inv, recipe, DistributedSetup(), micro_batch_size=rows, checkpointing=False,
        images=image_input(inv.vision, recipe),
    )  # fmt: skip
    assert est.activations.peak(False) == pytest.approx(measured, rel=0.01)


def test_images_per_row_and_checkpointing_scale_the_vision_activations():
    config = {"model_type": "idefics3", **TINY["idefics3"]}
    recipe = _recipe(config, model={"train_vision_tower": True, "train_projector": True})
    one = make_plan(recipe)
    two = make_plan(recipe, images_per_row=2)
    acts1, acts2 = one.estimate.activations, two.estimate.activations
    assert acts2.vision == pytest.approx(2 * acts1.vision)
    assert 0 < acts1.vision_checkpointed < acts1.vision
    assert one.images.patches_per_image == 16 and "--images-per-row" in one.images.source
    more = make_plan(recipe, patches_per_image=64)
    assert more.estimate.activations.vision == pytest.approx(4 * acts1.vision)
    frozen = make_plan(_recipe(config))
    assert frozen.estimate.activations.vision == 0  # a frozen tower and projector save nothing


# ------------------------------------------------------------------------------------------------- CLI


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_plan_demo_vlm(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    plan = _plan_json(capsys, "recipes/demo/tiny_vlm_cpu.yaml", "--gpu-memory", "24GiB")
    vision = plan["model"]["vision"]
    assert plan["model"]["params_total"] == 556_544 == plan["model"]["params_trainable"]
    assert vision["tower_params"] == 46_976 and vision["projector_params"] == 32_768
    assert vision["patches_per_image"] == 16 and vision["activations_bytes"] > 0
    assert main(["plan", "recipes/demo/tiny_vlm_cpu.yaml", "--images-per-row", "2"]) == 0
    text = capsys.readouterr().out
    assert "vision: tower" in text and "2 image(s) per row, --images-per-row" in text


@pytest.mark.parametrize(
    ("recipe", "config", "total", "tower", "patches"),
    [
        # Qwen2.5-VL-3B: 3.75B parameters, a ~670M vision tower (its merger included); image_max_pixels
        # 401408 = 512 tokens of 2x2 patches
        ("qwen2_5_vl_3b_lora.yaml", QWEN2_5_VL_3B, 3.75e9, 0.67e9, 2048),
        # SmolVLM-Instruct: 2.25B, a 400M SigLIP tower; without its processor one 384px crop is assumed
        ("smolvlm_lora.yaml", SMOLVLM_INSTRUCT, 2.25e9, 0.43e9, 729),
    ],
)
def test_cli_plan_vlm_recipes(capsys, monkeypatch, recipe, config, total, tower, patches):
    monkeypatch.chdir(REPO)
    args = [f"recipes/vlm/{recipe}", "--model.config_path", json.dumps(config), "--gpu-memory", "80GiB"]
    plan = _plan_json(capsys, *args)
    model, vision = plan["model"], plan["model"]["vision"]
    assert model["params_total"] == pytest.approx(total, rel=0.02)
    assert vision["tower_params"] + vision["projector_params"] == pytest.approx(tower, rel=0.05)
    assert vision["patches_per_image"] == patches
    assert plan["fits"] and model["lora_params"] > 0
    assert model["params_trainable"] == model["lora_params"]  # tower and projector frozen by default
    # Frozen, with checkpointing (on in these recipes): training removes the hook that would make the
    # tower's input require grad, so it keeps nothing and runs no backward (test_vlm_tower_release.py)
    frozen_bytes = vision["activations_bytes"]
    assert frozen_bytes == 0
    assert any("--images-per-row" in a for a in plan["assumptions"])
    trained = _plan_json(
        capsys, *args, "--model.train_vision_tower", "true", "--model.train_projector", "true"
    )
    assert trained["model"]["params_trainable"] > model["params_trainable"]
    assert trained["model"]["vision"]["activations_bytes"] > frozen_bytes


def test_training_records_the_vlm_plan(monkeypatch):
    """`finetune train` records the planner's prediction for a VLM run too (progress.jsonl's
    memory_plan): the same parts and total as `finetune plan` with its default images."""
    from finetune.plan import training_prediction

    monkeypatch.chdir(REPO)
    raw = yaml.safe_load(DEMO.read_text())
    recipe = validate_recipe(raw)
    recorded = training_prediction(recipe, DistributedSetup("single"))
    plan = make_plan(recipe)
    assert recorded["total_gpu_bytes"] == plan.estimate.total_gpu
    assert [p["name"] for p in recorded["parts"]] == [p.name for p in plan.estimate.parts]


def test_images_per_row_are_read_from_the_prepared_data(tmp_path, monkeypatch, capsys):
    """With the recipe's preparation on disk the planner counts the images of its rows (the most in a
    row) instead of assuming one; --images-per-row still wins."""
    monkeypatch.chdir(REPO)
    images = REPO / "recipes/demo/data/vlm/images"
    (tmp_path / "images").mkdir()
    for name in ("00000.png", "00001.png"):
        (tmp_path / "images" / name).write_bytes((images / name).read_bytes())
    part = {"type": "image", "image": "images/00000.png"}
    second = {"type": "image", "image": "images/00001.png"}
    rows = [[part], [part, second], [part]] * 4
    with (tmp_path / "rows.jsonl").open("w") as f:
        for parts in rows:
            user = [*parts, {"type": "text", "text": "What shape is it?"}]
            reply = [{"type": "text", "text": "square"}]
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}
                )
                + "\n"
            )
    args = [
        "recipes/demo/tiny_vlm_cpu.yaml", "--data.datasets", json.dumps([{"path": str(tmp_path / "rows.jsonl"), "type": "chat_template"}]),
        "--data.test_datasets", "[]", "--data.dataset_prepared_path", str(tmp_path / "prepared"),
    ]  # fmt: skip
    before = _plan_json(capsys, *args)["model"]["vision"]
    assert before["images_per_row"] == 1 and "assumed" in before["images_source"]
    assert main(["prepare-dataset", *args]) == 0
    capsys.readouterr()
    after = _plan_json(capsys, *args)["model"]["vision"]
    assert after["images_per_row"] == 2 and "prepared data" in after["images_source"]
    assert after["activations_bytes"] == pytest.approx(2 * before["activations_bytes"], rel=0.01)
    assert _plan_json(capsys, *args, "--images-per-row", "3")["model"]["vision"]["images_per_row"] == 3
