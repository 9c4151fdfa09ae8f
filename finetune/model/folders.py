"""Checking a location before anything loads from it: a model or adapter folder that exists and is
no training checkpoint, an adapter's config and weights file readable, the files finetune wrote
matching their checksums. Each refusal names the folder and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.gguf.names import is_gguf_name, is_package_ref

ADAPTER_CONFIG = "adapter_config.json"


# PEFT's weight file names (peft.utils.constants SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


_RUN_FOLDER = "a run's train.output_dir"


def check_saved_files(folder: Path) -> None:
    """Refuse a model or adapter folder whose files do not match the checksums.json finetune wrote
    with them (training's final save, merge-lora); a folder without one (an older run, another tool)
    loads as it is."""
    from finetune.checkpoint import verify_checksums

    problem = verify_checksums(folder)
    if problem is not None:
        raise FinetuneError(
            f"{folder} does not load: {problem}. The file was damaged or changed after finetune wrote it: "
            "copy the folder again from where it came from, or write it again (resume the training run "
            "with --train.load_checkpoint_path auto, or run merge-lora again)"
        )


def check_model_location(path: str, *, flag: str = "", local: bool = False) -> None:
    """Refuse, before anything loads, a location no model loads from: a path that does not exist, a
    file, an empty folder or one with neither a model nor an adapter, a training checkpoint, an adapter
    folder whose files are damaged (check_adapter_folder). `flag` names the option that gave it
    (`--adapter`); `local` refuses what could only be a Hub id. A GGUF file or `package://` reference
    is checked where it is resolved (finetune.gguf)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if is_package_ref(path) or is_gguf_name(path):
        return
    folder = Path(path).expanduser()
    where = f"{flag} {path}".strip()
    if not folder.exists():
        try:
            validate_repo_id(path)
        except HFValidationError:
            local = True
        if local:
            raise FinetuneError(f"{where} does not exist: point at {_RUN_FOLDER} or another model folder")
        return  # a Hub id: _load_causal_lm says why it does not load, if it does not
    if not folder.is_dir():
        raise FinetuneError(
            f"{where} is a file: point at the folder that holds the model or adapter ({_RUN_FOLDER}), "
            "or at a .gguf file"
        )
    _refuse_checkpoint(folder, where)
    if (folder / ADAPTER_CONFIG).is_file():
        check_adapter_folder(folder, flag=flag)
    elif not (folder / "config.json").is_file():
        what = "is an empty folder" if not any(folder.iterdir()) else "holds no model"
        raise FinetuneError(
            f"{where} {what}: neither an adapter ({ADAPTER_CONFIG}) nor a model (config.json). Point at "
            f"{_RUN_FOLDER}, a model folder, a Hub id or a .gguf file"
        )


def check_adapter_folder(folder: Path, *, flag: str = ""):
    """The adapter's PEFT config, after checking what loading it needs: the folder exists and is no
    training checkpoint, adapter_config.json parses and PEFT accepts its fields, and a weights file is
    there with a readable header (a truncated or overwritten safetensors file fails here, not after
    the base model has loaded)."""
    from peft import PeftConfig

    where = f"{flag} {folder}".strip()
    if not folder.is_dir():
        raise FinetuneError(
            f"{where} does not exist: point at a trained adapter folder (a LoRA run's train.output_dir)"
        )
    _refuse_checkpoint(folder, where)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FinetuneError(
            f"{where} holds no {ADAPTER_CONFIG}, so it is no adapter: point at a trained adapter folder "
            "(a LoRA run's train.output_dir)"
        )
    again = "copy the adapter folder again from where it was trained, or train it again"
    try:
        saved = json.loads(config_file.read_text())
        config = PeftConfig.from_pretrained(str(folder))
    except json.JSONDecodeError as exc:
        raise FinetuneError(
            f"{config_file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); {again}"
        ) from None
    except KeyError:  # PEFT's table of config classes, by peft_type
        raise FinetuneError(
            f"{config_file}: peft_type {saved.get('peft_type')!r} is no adapter type PEFT knows; {again}"
        ) from None
    except (TypeError, ValueError, AttributeError) as exc:  # PEFT's config classes on bad fields
        raise FinetuneError(f"{config_file}: PEFT rejects it ({_brief(exc)}); {again}") from None
    wrong = _mistyped_fields(saved, type(config))
    if wrong:
        raise FinetuneError(f"{config_file}: {'; '.join(wrong)}; {again}")
    _check_adapter_weights(folder, again)
    return config


def _mistyped_fields(saved: dict, config_class) -> list[str]:
    """The fields of a saved PEFT config whose values do not have the type its config class declares.

    PEFT's config dataclasses do not check types (a rank of "sixteen" fails deep inside building the
    layers, after the base model has loaded), so the declared types are checked here with pydantic, in
    its lax mode (an int saved as 32.0 passes, as PEFT takes it).
    """
    import typing

    from pydantic import PydanticUserError, TypeAdapter, ValidationError

    hints = typing.get_type_hints(config_class)
    wrong = []
    for name, value in saved.items():
        if name not in hints:  # PEFT warns about fields it does not know, and ignores them
            continue
        try:
            check = TypeAdapter(hints[name])
        except PydanticUserError:  # a type pydantic cannot describe (a class of PEFT's): left to PEFT
            continue
        try:
            check.validate_python(value)
        except ValidationError as exc:
            wrong.append(f"{name} is {value!r}, not {_type_name(hints[name])} ({exc.errors()[0]['msg']})")
    return wrong


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _check_adapter_weights(folder: Path, again: str) -> None:
    from safetensors import SafetensorError, safe_open

    found = [folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()]
    if not found:
        raise FinetuneError(
            f"{folder} holds {ADAPTER_CONFIG} but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}); {again}"
        )
    if found[0].suffix != ".safetensors":
        return  # a pickled .bin (older PEFT): torch reads it when PEFT loads it
    try:  # reads the header and checks that it covers the file: nothing is loaded
        with safe_open(str(found[0]), framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError) as exc:
        raise FinetuneError(
            f"{found[0]}: not a readable safetensors file ({exc}): it is truncated or damaged; {again}"
        ) from None


def _refuse_checkpoint(folder: Path, where: str) -> None:
    """A training checkpoint (checkpoints/step-N) holds what resuming needs, not a loadable model:
    say so, with the run's output folder when it holds the final adapter or model."""
    from finetune.checkpoint import STATE_FILE, step_of

    folder_is_step = step_of(folder.resolve()) is not None and folder.resolve().parent.name == "checkpoints"
    if not ((folder / STATE_FILE).is_file() or folder_is_step):
        return
    run = folder.resolve().parent.parent
    if (run / ADAPTER_CONFIG).is_file() or (run / "config.json").is_file():
        fix = f"point at the run's output folder {run}, which holds its final adapter or model"
    else:
        fix = (
            f"the run writes its final adapter or model to {run} when training ends; finish the run with "
            f"`finetune train RECIPE --train.load_checkpoint_path {folder}` (the recipe it was trained with)"
        )
    raise FinetuneError(
        f"{where} is a training checkpoint (the trained weights with optimizer, scheduler and RNG state, "
        f"for resuming), not a model that loads for inference: {fix}"
    )


def _brief(exc: BaseException) -> str:
    """An exception in one line: its first two lines (torch's load_state_dict puts the cause on the
    second), at most 300 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
