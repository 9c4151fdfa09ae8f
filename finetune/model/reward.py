"""A reward model loaded to score text: what a train.objective reward run wrote (a full model folder, or
a LoRA adapter of PEFT's task type SEQ_CLS on its base), or any one-label sequence-classification model
(a Hub id).

`load_reward_model` checks the head before the weights load: a location that does not exist, a causal
LM, a LoRA adapter of a causal LM, a classifier of several labels are FinetuneErrors that say what the
location is and what to point at instead. `finetune eval` also scores the recipe's base, a causal LM
with no score head: with `new_head_seed` it gets a new head drawn from that seed, the one the reward run
started from (finetune.model.build.init_score_head), so the base's numbers are those of training's first
step, at chance level, and the same on every run.
"""

from __future__ import annotations

from pathlib import Path

from finetune.errors import FinetuneError
from finetune.gguf.convert import resolve_path
from finetune.model.build import DTYPES, init_score_head, pad_token_id
from finetune.model.folders import (
    ADAPTER_CONFIG,
    _brief,
    check_adapter_folder,
    check_model_location,
    check_saved_files,
)

_TRAIN_ONE = "train one with train.objective reward and point at its train.output_dir"


def load_reward_model(
    path: str,
    *,
    tokenizer=None,
    merge: bool = False,
    new_head_seed: int | None = None,
    dtype: str = "auto",
    where: str = "",
):
    """(model in eval mode, tokenizer, whether its score head is new): the reward model at `path`.

    An adapter loads on its recorded base (merged into it with `merge`); its tokenizer is its own when
    saved with it, else the base's; `tokenizer` replaces either. A model without a score head is refused
    unless `new_head_seed` is given (then it gets a new head from that seed, and the pad token id of its
    tokenizer, as training gives one). `where` (a recipe path, an option) starts every error message.
    """
    from transformers import AutoModelForSequenceClassification

    prefix = f"{where}: " if where else ""
    local = Path(path).expanduser()
    try:
        check_model_location(path)  # a missing local path, a file, an empty folder, a checkpoint
    except FinetuneError as exc:
        raise FinetuneError(f"{prefix}{str(exc).split(': point at')[0]}: {_TRAIN_ONE}") from None
    adapter = (local / ADAPTER_CONFIG).is_file()
    source = _adapter_base(local, prefix) if adapter else path
    if not adapter:
        _check_head(source, prefix, allow_new=new_head_seed is not None)
    location = resolve_path(source)
    if Path(location).is_dir():
        check_saved_files(Path(location))
    try:
        net, info = AutoModelForSequenceClassification.from_pretrained(
            location,
            num_labels=1,
            output_loading_info=True,
            dtype="auto" if dtype == "auto" else DTYPES[dtype],
        )
    except (OSError, ValueError, RuntimeError) as exc:  # no such folder or Hub id; a head of another size
        if not Path(location).expanduser().exists():
            reason = f"it is no folder here (in {Path.cwd()}) and does not load as a Hub id ({_brief(exc)})"
        else:
            reason = _brief(exc)
        raise FinetuneError(
            f"{prefix}no reward model loads from {source!r}: {reason}. Point at a reward model: {_TRAIN_ONE}"
        ) from None
    new_head = any(key.startswith("score.") for key in info["missing_keys"])
    if new_head and new_head_seed is not None:
        init_score_head(net, new_head_seed)
    if tokenizer is None:
        tokenizer = _tokenizer(
            str(local) if (local / "tokenizer_config.json").is_file() else location, prefix
        )
    if new_head or net.config.pad_token_id is None:  # where its pooling stops, as training sets it
        net.config.pad_token_id = pad_token_id(tokenizer)
    if adapter:
        net = _with_adapter(net, local, source, prefix, merge=merge)
        new_head = False  # the adapter holds the trained head (modules_to_save)
    return net.eval(), tokenizer, new_head


def _adapter_base(folder: Path, prefix: str) -> str:
    """The recorded base of a reward model's adapter, after checking that it is one (PEFT task SEQ_CLS)."""
    config = check_adapter_folder(folder)
    task = str(getattr(config, "task_type", None) or "")
    if task.rsplit(".", 1)[-1] != "SEQ_CLS":
        raise FinetuneError(
            f"{prefix}{folder} is a LoRA adapter of a {task or 'model of no task type'} (a causal LM's, trained "
            f"by another objective), not a reward model's (task_type SEQ_CLS): {_TRAIN_ONE}"
        )
    if not config.base_model_name_or_path:
        raise FinetuneError(f"{prefix}{folder}: the adapter names no base model (adapter_config.json)")
    return config.base_model_name_or_path


def _check_head(source: str, prefix: str, *, allow_new: bool) -> None:
    """Refuse, from its config alone, a model that is not a one-label sequence classifier (a causal LM:
    unless `allow_new`, then it gets a new head). A location whose config does not load is left to the
    loading, which says why."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_path(source))
    except (OSError, ValueError):
        return
    architectures = config.architectures or []
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if classifier and config.num_labels != 1:
        raise FinetuneError(
            f"{prefix}{source} is a classifier with {config.num_labels} labels, not a reward model (one score): "
            f"{_TRAIN_ONE}"
        )
    if not classifier and not allow_new:
        kind = ", ".join(architectures) or f"a {config.model_type} model"
        raise FinetuneError(
            f"{prefix}{source} is {kind} with no score head, not a reward model (a sequence-classification "
            f"model with one label, as train.objective reward writes): {_TRAIN_ONE}"
        )


def _with_adapter(net, folder: Path, base: str, prefix: str, *, merge: bool):
    from peft import PeftModel

    try:
        net = PeftModel.from_pretrained(net, folder)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise FinetuneError(
            f"{prefix}PEFT cannot load the reward adapter {folder} onto its base {base}: {_brief(exc)}"
        ) from None
    return net.merge_and_unload() if merge else net


def _tokenizer(source: str, prefix: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"{prefix}no tokenizer saved with the reward model at {source}: {_brief(exc)} (training saves one "
            "next to the model)"
        ) from None
