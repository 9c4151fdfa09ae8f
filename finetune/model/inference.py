"""What training wrote, loaded for inference: an adapter on its base (merged on request, or into a
saved model: `merge_lora`), a full model folder or Hub id, a GGUF file (converted once), a
vision-language model with its processor; and that model written as a GGUF file (`export_gguf`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import torch

from finetune.errors import FinetuneError, write_error, write_failure_reason
from finetune.gguf.convert import resolve_model_source, resolve_path
from finetune.gguf.export import check_outtype, default_output, gguf_architecture, write_gguf
from finetune.gguf.names import is_gguf_name, is_package_ref
from finetune.model import vlm
from finetune.model.build import DTYPES
from finetune.model.folders import (
    ADAPTER_CONFIG,
    _brief,
    check_adapter_folder,
    check_model_location,
    check_saved_files,
)
from finetune.notices import warn
from finetune.recipe import ModelSection

logger = logging.getLogger(__name__)


def merge_lora(adapter_dir: str, output: str, *, base: str | None = None, dtype: str = "auto") -> None:
    """Merge a LoRA adapter into its base model and save full safetensors weights + tokenizer."""
    from finetune.checkpoint import file_stamps, record_written

    adapter = Path(adapter_dir)
    net, tokenizer = load_adapter(adapter, base=base, dtype=dtype)
    merged = net.merge_and_unload()
    out = Path(output)
    before = file_stamps(out)
    try:
        merged.save_pretrained(out, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        else:
            warn("no tokenizer found next to the adapter or base model; merged weights saved without one")
    except BaseException as exc:
        if write_failure_reason(exc) is None:
            raise
        raise write_error(
            exc,
            f"saving the merged model in {out}",
            out,
            "The files written there are incomplete; free space or choose another output folder, then merge again",
        ) from None
    record_written(out, before)  # verified when finetune loads the merged model
    for extra in ("recipe.resolved.yaml",):
        if (adapter / extra).is_file():
            shutil.copy(adapter / extra, out / extra)


def load_adapter(adapter: Path, *, base: str | None = None, dtype: str = "auto"):
    """(PeftModel, tokenizer or None): the adapter in `adapter` on its base model.

    The base is `base` if given, else the adapter's recorded base_model_name_or_path; a GGUF file (or
    `package://` reference) as base is used through its converted folder. The tokenizer is the
    adapter's own when saved with it (training saves it: its length sizes the embeddings), else the base's.
    """
    from peft import PeftModel

    peft_config = check_adapter_folder(adapter)
    check_saved_files(adapter)
    base_path = base or peft_config.base_model_name_or_path
    if not base_path:
        raise FinetuneError(f"{adapter}: the adapter names no base model; pass --base PATH")
    fix = "Pass --base PATH if it moved (for a GGUF base, the .gguf file: it is converted again)."
    net, base_path = _load_causal_lm(
        base_path, dtype, f"could not load the base model {{}} of {adapter}", fix
    )
    own = (adapter / "tokenizer_config.json").is_file()
    tokenizer = _load_tokenizer_or_none(str(adapter) if own else base_path)
    if base is not None and own and tokenizer is not None:  # a base given by hand: is it the adapter's?
        _check_base_tokenizer(adapter, tokenizer, base_path)
    if tokenizer is not None and len(tokenizer) > net.get_input_embeddings().weight.shape[0]:
        # Training added special tokens and grew the embeddings (trained through modules_to_save, which
        # the adapter holds at the new size): the base must have that size before the adapter loads.
        logger.info("resizing the base embeddings to the adapter's tokenizer (%d tokens)", len(tokenizer))
        net.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    try:
        return PeftModel.from_pretrained(net, adapter), tokenizer
    except (OSError, RuntimeError, ValueError, KeyError) as exc:  # shapes or modules the base lacks
        raise FinetuneError(
            f"{adapter}: PEFT cannot load the adapter onto the base model {base_path}: {_brief(exc)}. Check "
            "its adapter_config.json (as training wrote it) and that the base is the model it was trained "
            "on. " + fix
        ) from None


def load_for_inference(
    path: str, *, base: str | None = None, dtype: str = "auto", merge: bool = False, tokenizer=None
):
    """(model, tokenizer) in eval mode, ready to generate, from what training wrote or any model:
    an adapter folder (its base + the adapter; merged into the base when `merge`, which generates
    faster), a full model folder or Hub id, or a GGUF file / `package://` reference (converted once).

    `base` overrides an adapter's recorded base; `dtype` is auto (the checkpoint's), bf16, fp16 or fp32;
    `tokenizer` replaces the one found next to the model (a recipe's own tokenizer for its base).
    """
    given = tokenizer

    local = Path(path).expanduser()
    _refuse_vision_language(local)
    check_model_location(path)
    if (local / ADAPTER_CONFIG).is_file():
        net, tokenizer = load_adapter(local, base=base, dtype=dtype)
        if merge:
            net = net.merge_and_unload()
    else:
        if base is not None:
            raise FinetuneError(f"{path}: a base model was given, but this is not an adapter folder")
        failure = f"{path}: not an adapter folder (no adapter_config.json) and no model loads from it"
        net, source = _load_causal_lm(
            path, dtype, failure, "Point at a folder training wrote, a Hub id, or a .gguf file."
        )
        tokenizer = _load_tokenizer_or_none(source)
    tokenizer = given if given is not None else tokenizer
    if tokenizer is None:
        raise FinetuneError(f"{path}: no tokenizer saved with the model or its base; cannot generate text")
    return net.eval(), tokenizer


def is_vision_language(local: Path) -> bool:
    """Whether `local` is a vision-language model folder (its config has a vision_config), or an adapter
    folder whose recorded base is one; False for anything that is not a local folder with a config."""
    config = local / "config.json"
    try:
        if (local / ADAPTER_CONFIG).is_file():
            base = json.loads((local / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
            config = Path(base).expanduser() / "config.json"
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError, AttributeError, TypeError):
        return False  # not a local folder with a readable config: the loading says what is wrong


def _refuse_vision_language(local: Path) -> None:
    """A vision-language run (model.kind vlm) cannot be loaded as a causal LM for text generation: say
    so, instead of transformers' "unrecognized configuration class" from deep inside the loading."""
    if is_vision_language(local):
        raise FinetuneError(
            f"{local} is a vision-language model (its config has a vision_config): export-gguf and text "
            "generation take text models only so far (finetune chat DIR --image PATH talks to it, finetune eval "
            "with its recipe scores its held-out loss); it loads with transformers' "
            "AutoModelForImageTextToText and AutoProcessor"
        )


def load_vlm_for_inference(path: str, *, base: str | None = None, dtype: str = "auto"):
    """(model, processor) in eval mode from what a vision-language run wrote: an adapter folder (on its
    recorded base, or `base`) or a full model folder, loaded with AutoModelForImageTextToText; the
    processor is the one saved with it (training saves it next to the weights), else the base's."""
    from transformers import AutoModelForImageTextToText

    local = Path(path).expanduser()
    check_model_location(path)
    adapter = (local / ADAPTER_CONFIG).is_file()
    if adapter:
        peft_config = check_adapter_folder(local)
        source = base or peft_config.base_model_name_or_path
    elif base is not None:
        raise FinetuneError(f"{path}: a base model was given, but this is not an adapter folder")
    else:
        source = str(local)
    check_saved_files(local)
    fix = "Pass --base PATH if the base model moved." if adapter else "Point at a folder training wrote."
    try:
        net = AutoModelForImageTextToText.from_pretrained(source, dtype=_load_dtype(dtype))
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"{path}: could not load the vision-language model {source!r}: {_brief(exc)}. {fix}"
        ) from None
    own = any((local / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))
    processor = vlm.auto_processor(str(local) if own else source)
    if adapter:
        from peft import PeftModel

        try:
            net = PeftModel.from_pretrained(net, local)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise FinetuneError(
                f"{local}: PEFT cannot load the adapter onto the base model {source}: {_brief(exc)}. {fix}"
            ) from None
    return net.eval(), processor


def inference_device() -> torch.device:
    """Where `finetune eval` and `finetune chat` run the model: the first GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def base_model_source(model: ModelSection, *, adapter: str | None = None) -> str:
    """The recipe's base model as a loadable location (a GGUF file's converted folder); for a recipe
    without pretrained weights (a random-init config), the base recorded in `adapter`."""
    if model.model_path is not None:
        return resolve_model_source(model).model_path
    if adapter is not None and (Path(adapter) / "adapter_config.json").is_file():
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
        if config.get("base_model_name_or_path"):
            return config["base_model_name_or_path"]
    raise FinetuneError(
        "the recipe's model has no pretrained weights (model.model_path is null): evaluate a trained "
        "adapter with --adapter DIR (its saved base is used) or a model folder with --model DIR --no-base"
    )


def _load_causal_lm(location: str, dtype: str, failure: str, fix: str):
    """(model, the folder or Hub id it loaded from): AutoModelForCausalLM.from_pretrained on `location`
    made loadable (a GGUF file or package:// reference converted, `resolve_path`); a loading failure
    is said as `failure` (with the resolved location in place of `{}`), the reason, then `fix`."""
    from transformers import AutoModelForCausalLM

    try:
        source = resolve_path(location)  # a GGUF base is converted (again, on a new machine) here
    except FinetuneError as exc:
        raise FinetuneError(f"{failure.format(repr(location))}: {exc}. {fix}") from None
    if Path(source).is_dir():
        check_saved_files(Path(source))
    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=_load_dtype(dtype)), source
    except (OSError, ValueError) as exc:  # no such folder or Hub id; a config without a model_type
        raise FinetuneError(f"{failure.format(repr(source))}: {exc}. {fix}") from None


def _load_dtype(dtype: str):
    return "auto" if dtype == "auto" else DTYPES[dtype]


def _load_tokenizer_or_none(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def _check_base_tokenizer(adapter: Path, tokenizer, base_path: str) -> None:
    """A base given by hand must have the adapter's vocabulary: every token of its tokenizer with the
    same id in the adapter's (which may add special tokens)."""
    base_tokenizer = _load_tokenizer_or_none(base_path)
    if base_tokenizer is None:
        return
    adapter_vocab = tokenizer.get_vocab()
    differ = [t for t, i in base_tokenizer.get_vocab().items() if adapter_vocab.get(t) != i]
    if differ:
        raise FinetuneError(
            f"--base {base_path} is not the base of {adapter}: its tokenizer ({len(base_tokenizer)} tokens) "
            f"is not the adapter's ({len(tokenizer)} tokens; {len(differ)} differ, e.g. {differ[0]!r}). "
            "Pass the model the adapter was trained on (its adapter_config.json base_model_name_or_path)"
        )


# ------------------------------------------------------------------------------------ GGUF export


def export_gguf(
    output_dir: str,
    *,
    outtype: str = "f16",
    output: str | None = None,
    base: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write what training left in `output_dir` (an adapter is merged into its base first) as a GGUF
    file at `output` (default: `default_output`); returns its path. The file must be a .gguf name (so
    no file of the run, its adapter or weights, can be replaced) and must not exist unless `overwrite`."""
    check_outtype(outtype)
    target = Path(output) if output else default_output(output_dir, outtype)
    check_export_target(target, overwrite=overwrite)
    _refuse_unsupported_early(output_dir, base)
    # The checkpoint's own dtype (as merge-lora loads it): a bf16 model is not doubled in memory, and
    # PEFT computes the merge's delta in float32 on CPU whatever the weights' dtype.
    net, tokenizer = load_for_inference(output_dir, base=base, dtype="auto", merge=True)
    gguf_architecture(net.config.model_type)  # before anything is written
    write_gguf(net, tokenizer, target, outtype=outtype, name=Path(output_dir).resolve().name)
    return target


def check_export_target(target: Path, *, overwrite: bool) -> None:
    """Refuse an export target that would destroy something: a folder, a file that is not a .gguf (the
    run's adapter or weights, say), or an existing .gguf without `overwrite`."""
    if target.is_dir():
        raise FinetuneError(f"export-gguf: --output {target} is a folder; name the .gguf file to write")
    if target.suffix != ".gguf":
        raise FinetuneError(
            f"export-gguf: --output {target} is not a .gguf file name; name the file NAME.gguf (a run's own "
            "files, its adapter and weights, are never written over)"
        )
    if target.exists() and not overwrite:
        raise FinetuneError(
            f"export-gguf: {target} exists; pass --overwrite to replace it, or --output another .gguf file"
        )


def _refuse_unsupported_early(output_dir: str, base: str | None) -> None:
    """Refuse an unsupported architecture from the config alone, before the weights load and merge.
    A location whose config does not load here (a GGUF base, a Hub id offline) is left to the load,
    which says what is wrong, and the architecture is checked after it."""
    from transformers import AutoConfig

    folder = Path(output_dir)
    source: str | None = output_dir
    if (folder / "adapter_config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            source = base or json.loads((folder / "adapter_config.json").read_text()).get(
                "base_model_name_or_path"
            )
    if not source or is_gguf_name(source) or is_package_ref(source):
        return
    try:
        model_type = AutoConfig.from_pretrained(source).model_type
    except (OSError, ValueError):
        return
    gguf_architecture(model_type)
