"""`finetune eval`'s check that a trained adapter or model comes from the recipe's base model.

Every model `finetune eval` compares is scored on the eval split tokenized with the recipe's
tokenizer, so an adapter of another base gives numbers without meaning (or an index error after the
base's whole evaluation): it is refused before anything runs, with both bases named.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.gguf.convert import resolve_model_source, resolve_path
from finetune.model.adapters import _same_location
from finetune.model.build import _load_config
from finetune.model.folders import ADAPTER_CONFIG, _brief
from finetune.model.inference import _load_tokenizer_or_none
from finetune.notices import warn
from finetune.recipe import ModelSection

# The config fields that make two models of one architecture (vocabularies are compared as tokenizers).
_ARCHITECTURE = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size",
)  # fmt: skip


def check_fits_recipe(target: str, model: ModelSection, tokenizer, *, flag: str) -> None:
    """Refuse a trained adapter or model (`target`, given with `flag`) that was not trained from the
    recipe's base: `finetune eval` scores every model on the eval split tokenized with the recipe's
    tokenizer, so another base gives numbers without meaning (or an index error after the base's whole
    evaluation). Compared, before anything loads: the base the run recorded (its recipe.resolved.yaml's
    model.model_path, else the adapter's base_model_name_or_path) with the recipe's, the architecture
    (`_ARCHITECTURE`), and the tokenizer's vocabulary with `tokenizer` (the recipe's)."""
    folder = Path(target).expanduser()
    is_adapter = (folder / ADAPTER_CONFIG).is_file()
    recorded = (
        json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if is_adapter
        else None
    )
    trained = _trained_model_section(folder)
    ours = _base_name(model.model_path, model.gguf_file)
    if trained is not None:
        theirs = _base_name(trained.get("model_path"), trained.get("gguf_file"))
        where = f"{theirs} (its recipe.resolved.yaml)"
    else:
        theirs = recorded or str(folder)
        where = f"{theirs} (its {ADAPTER_CONFIG})" if recorded else f"{theirs} (its config.json)"
    problems = []
    if trained is not None and not _same_base(trained, model):
        changed = _config_changes(trained.get("config_path"), model.config_path)
        problems.append(
            f"the run's random-init model had another model.config_path ({changed})"
            if changed
            else "the run was trained from another base model"
        )
    elif trained is None and recorded and model.model_path is not None and not _same_base(recorded, model):
        problems.append("the adapter names another base model")
    if recorded or not is_adapter:  # an adapter naming no base is refused when it loads
        location = resolve_path(recorded) if recorded else str(folder)
        problems += _architecture_problems(_load_config(model), location, f"{flag} {target}")
    mine = _load_tokenizer_or_none(
        str(folder) if (folder / "tokenizer_config.json").is_file() else (recorded or str(folder))
    )
    if mine is not None and mine.get_vocab() != tokenizer.get_vocab():
        problems.append(
            f"its tokenizer has another vocabulary ({len(mine)} tokens) than the recipe's ({len(tokenizer)} tokens, "
            f"{model.tokenizer_source}), which tokenizes the eval split"
        )
    if problems:
        kind = "adapter" if is_adapter else "model"
        raise FinetuneError(
            f"{flag} {target} is not of this recipe's base model: {'; '.join(problems)}. The recipe's base "
            f"is {ours}; the {kind}'s is {where}. Evaluate it with the recipe it was trained with"
            + (f" ({folder / 'recipe.resolved.yaml'})" if trained is not None else "")
            + ", or set this recipe's model section (model.model_path, model.config_path, "
            "model.tokenizer_path) to its base"
        )


def _base_name(model_path: str | None, gguf_file: str | None) -> str:
    if model_path is None:
        return "a random-init model from model.config_path"
    return f"{model_path} ({gguf_file})" if gguf_file else model_path


def _trained_model_section(folder: Path) -> dict | None:
    """The model section of the recipe a run trained with (output_dir/recipe.resolved.yaml), if any."""
    import yaml

    path = folder / "recipe.resolved.yaml"
    if not path.is_file():
        return None
    try:
        section = (yaml.safe_load(path.read_text()) or {}).get("model")
    except (yaml.YAMLError, AttributeError) as exc:
        warn(f"{path} does not parse ({_brief(exc)}); the base it records is not compared with the recipe's")
        return None
    return section if isinstance(section, dict) else None


def _same_base(trained: dict | str, model: ModelSection) -> bool:
    """Whether a recorded base (a run's model section, or an adapter's base path) is the recipe's:
    both random-init, or the same location once resolved (a GGUF file is its converted folder)."""
    if isinstance(trained, str):
        trained = {"model_path": trained}
    path, gguf_file = trained.get("model_path"), trained.get("gguf_file")
    if path is None or model.model_path is None:
        if path is None and model.model_path is None:  # both random-init: of one inline config?
            config = trained.get("config_path")
            if isinstance(config, dict) and isinstance(model.config_path, dict):
                return config == model.config_path
            return True
        return False
    if (path, gguf_file) == (model.model_path, model.gguf_file):
        return True
    try:
        theirs = resolve_model_source(ModelSection(model_path=path, gguf_file=gguf_file)).model_path
        ours = resolve_model_source(model).model_path
    except (FinetuneError, ValueError):  # theirs no longer resolves here (not installed, moved)
        return _same_location(path) == _same_location(model.model_path)
    return _same_location(theirs) == _same_location(ours)


def _config_changes(trained, ours) -> str:
    """How two inline random-init configs differ ("vocab_size 704 (the recipe's: 800)"), or "" when
    either is not an inline config or the model is not random-init."""
    if not (isinstance(trained, dict) and isinstance(ours, dict)) or trained == ours:
        return ""
    keys = sorted(set(trained) | set(ours))
    return ", ".join(
        f"{k} {trained.get(k, 'unset')} (the recipe's: {ours.get(k, 'unset')})"
        for k in keys
        if trained.get(k) != ours.get(k)
    )


def _architecture_problems(ours, location: str, what: str) -> list[str]:
    """How the config at `location` (`what`'s base or `what` itself) differs from `ours` in the fields
    of _ARCHITECTURE."""
    from transformers import AutoConfig

    try:
        theirs = AutoConfig.from_pretrained(location)
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"{what}: no model config loads from {location} ({_brief(exc)}); point at a model or adapter "
            "whose base is where it was trained from"
        ) from None
    differ = [
        f"{name} {getattr(theirs, name)} (the recipe's: {getattr(ours, name)})"
        for name in _ARCHITECTURE
        if getattr(ours, name, None) is not None
        and getattr(theirs, name, None) is not None
        and getattr(ours, name) != getattr(theirs, name)
    ]
    return [f"its architecture differs: {', '.join(differ)}"] if differ else []
