"""Which settings a resume may not change comes from the schema's marks (finetune.recipe.resume)."""

from __future__ import annotations

from finetune.recipe import Recipe, validate_recipe
from finetune.recipe.resume import changed_on_resume, resume_rules

BASE = {
    "model": {"model_path": "org/base"},
    "data": {"datasets": [{"path": "p.jsonl", "type": "completion"}]},
    "train": {"output_dir": "out"},
}


def _dump(**changes) -> dict:
    data = {k: dict(v) for k, v in BASE.items()}
    for path, value in changes.items():
        section, name = path.split("__")
        data.setdefault(section, {})[name] = value
    return validate_recipe(data).model_dump(mode="json")


def test_the_rules_follow_the_marks():
    rules = resume_rules()
    assert {"lr", "max_steps", "seed", "objective", "loss_chunk_size"} <= set(rules["train"].fields)
    assert not {"eval_steps", "log_steps", "output_dir", "save_steps"} & set(rules["train"].fields)
    assert {"datasets", "sequence_len", "sample_packing"} <= set(rules["data"].fields)
    assert "dataloader_num_workers" not in rules["data"].fields
    for section in ("model", "lora", "preference", "diffusion"):
        assert rules[section].fields is None, section  # every field
    assert {"validation_prompts", "validation_steps"} <= rules["diffusion"].free
    assert set(rules) <= set(Recipe.model_fields)


def test_changes_are_named_and_free_settings_are_not():
    before = _dump()
    assert changed_on_resume(before, _dump(train__eval_steps=5, train__log_steps=3)) == []
    assert changed_on_resume(before, _dump(train__lr=1e-3)) == [
        "train.lr: 5e-05 in the checkpoint, 0.001 now"
    ]
    assert changed_on_resume(before, _dump(lora__lora_rank=8)) == [
        "lora.lora_rank: 16 in the checkpoint, 8 now"
    ]
    both = changed_on_resume(before, _dump(train__lr=1e-3, data__sequence_len=64))
    assert both == [
        "data.sequence_len: 2048 in the checkpoint, 64 now",
        "train.lr: 5e-05 in the checkpoint, 0.001 now",
    ]


def test_a_checkpoint_whose_entries_listed_every_types_fields_still_resumes():
    """Before one schema class per type, an entry dumped the fields of every type at their defaults."""
    now = _dump()
    old = {k: (dict(v) if isinstance(v, dict) else v) for k, v in now.items()}
    old["data"] = dict(now["data"])
    old["data"]["datasets"] = [{**now["data"]["datasets"][0], "field_chosen": "chosen", "role_map": {}}]
    assert changed_on_resume(old, now) == []
    old["data"]["datasets"] = [{**old["data"]["datasets"][0], "field_text": "body"}]
    assert changed_on_resume(old, now) and "data.datasets" in changed_on_resume(old, now)[0]
