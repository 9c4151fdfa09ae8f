"""Defaults that depend on other fields, filled in one visible step before validation.

A field's own default lives on the field. Some defaults depend on what else the recipe says (QLoRA
implies LoRA; a vision-language recipe implies unpacked rows; a diffusion recipe implies LoRA on the attention projections and a `diffusion`
section with every default; a stream does not shuffle). They are written into the raw mapping here, only where the user wrote
nothing, so validators only check and never change a value; the filled-in values show in
recipe.resolved.yaml, and a contrary value the user did write is reported by the section's rules.

>>> resolve_defaults({"lora": {"enable_qlora": True}})["lora"]
{'enable_qlora': True, 'enable_lora': True}
>>> resolve_defaults({"lora": {"enable_qlora": True, "enable_lora": False}})["lora"]["enable_lora"]
False
"""

from __future__ import annotations

import copy
from typing import Any

from finetune.recipe.diffusion import DIFFUSION_DEFAULT_LORA_TARGETS
from finetune.recipe.objectives import OBJECTIVES


def resolve_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of the raw recipe mapping with the dependent defaults filled in where unset.

    Values of the wrong type are left alone for validation to report.
    """
    data = copy.deepcopy(data)
    lora = data.get("lora")
    if isinstance(lora, dict) and lora.get("enable_qlora") is True:
        lora.setdefault("enable_lora", True)
    stream = data.get("data")
    if isinstance(stream, dict) and stream.get("streaming") is True:
        # A stream is read in its shards' order (datasets' shuffle buffer does not resume exactly).
        stream.setdefault("shuffle_merged_datasets", False)
        stream.setdefault("shuffle_before_merging_datasets", False)
    model = data.get("model")
    if isinstance(model, dict) and model.get("kind") == "vlm" and isinstance(data.get("data"), dict):
        # Rows with images are not packed (finetune.recipe.schema.VLM_NO_PACKING says why).
        data["data"].setdefault("sample_packing", False)
        data["data"].setdefault("eval_sample_packing", False)
    if isinstance(model, dict) and model.get("kind") == "diffusion":
        if data.get("diffusion") is None:
            data["diffusion"] = {}
        lora = data.setdefault("lora", {})
        if isinstance(lora, dict):
            lora.setdefault("enable_lora", True)
            lora.setdefault("lora_target_modules", list(DIFFUSION_DEFAULT_LORA_TARGETS))
    _objective_section_defaults(data)
    return data


def _objective_section_defaults(data: dict[str, Any]) -> None:
    """The chosen objective's defaults for its section (an online variant's loss type, say), where the
    section is written and the field is not.

    >>> resolve_defaults({"train": {"objective": "rloo"}, "grpo": {"loss_type": "dapo"}})["grpo"]
    {'loss_type': 'dapo', 'scale_rewards': 'none', 'kl_in_reward': True}
    """
    train = data.get("train")
    objective = train.get("objective") if isinstance(train, dict) else None
    spec = OBJECTIVES.get(objective) if isinstance(objective, str) else None
    if spec is None or not spec.section_defaults or not isinstance(data.get(spec.section), dict):
        return
    for name, value in spec.section_defaults:
        data[spec.section].setdefault(name, value)
