"""finetune.model_card: the card of a causal-LM run names a Hub base model, never a local path."""

from __future__ import annotations

from finetune.model_card import hub_model_id, render_model_card


def _recipe(model_path):
    return {
        "model": {"model_path": model_path},
        "train": {
            "lr": 1e-4,
            "lr_decay_style": "cosine",
            "lr_warmup_ratio": 0.0,
            "micro_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "num_train_epochs": 1,
            "max_steps": 3,
            "optimizer": "adamw",
            "weight_decay": 0.0,
            "mixed_precision": "bf16",
        },
        "lora": {
            "enable_lora": True,
            "save_lora_only": True,
            "enable_qlora": False,
            "lora_rank": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "lora_target_modules": "all-linear",
        },
        "data": {
            "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
            "sequence_len": 64,
            "sample_packing": True,
        },
    }


def test_model_card_names_a_hub_base_model_but_not_a_local_path(tmp_path):
    assert hub_model_id("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert hub_model_id("gpt2") == "gpt2"
    assert hub_model_id(str(tmp_path)) is None  # an existing folder
    assert hub_model_id("./models/x/y") is None and hub_model_id(None) is None
    hub = render_model_card(
        recipe=_recipe("meta-llama/Llama-3.1-8B"), manifest={}, metrics={"eval_loss": 1.23456}
    )
    assert "base_model: meta-llama/Llama-3.1-8B" in hub and "| eval_loss | 1.2346 |" in hub
    local = render_model_card(recipe=_recipe(str(tmp_path)), manifest={}, metrics={})
    front_matter = local.split("---")[1]
    assert "base_model" not in front_matter and "library_name: peft" in front_matter
    assert f"Base model: {tmp_path}." in local  # still named in the text for the reader
    assert "`data.jsonl` (alpaca)" in local


def test_model_card_names_the_mixture_weights():
    recipe = _recipe("gpt2")
    recipe["data"]["datasets"] = [
        {"path": "a.jsonl", "type": "alpaca", "weight": 0.5},
        {"path": "b.jsonl", "type": "completion", "weight": 1.0},
    ]
    card = render_model_card(recipe=recipe, manifest={}, metrics={})
    assert "`a.jsonl` (alpaca, weight 0.5), `b.jsonl` (completion)" in card
