"""Data-driven LoRA inits, EVA and CorDA: PEFT's own functions run over training batches before training.

* EVA (`peft.initialize_lora_eva_weights`): each adapted layer's A starts as the top right-singular
  vectors of the layer's inputs over the data (incremental SVD until they stop moving), and the ranks
  are redistributed across layers by explained variance (lora.eva.rho); B starts at zero, so the model
  starts as the base.
* CorDA (`peft.tuners.lora.corda.preprocess_corda`, then `get_peft_model`): each weight is decomposed
  with the covariance of its inputs over the data; the adapter starts from the leading (ipm) or
  trailing (kpm) components and the base keeps the residual (saved converted, as PiSSA's).

Where it runs: the main process computes the init over its share of the training batches and
broadcasts the result; every process then applies the same tensors through PEFT. PEFT's EVA can
instead gather every rank's inputs, but its loop stops on a convergence test each rank must pass at
the same step (a collective per layer and batch); one computation broadcast cannot hang or differ
between ranks. The result is saved to output_dir/lora_init/ (EVA's state dict; CorDA's eigens in
PEFT's own cache_file format): a resumed run loads it instead of reading the data again, so its adapter
has the checkpoint's shapes (EVA's ranks) and its base the checkpoint's residual (CorDA).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from finetune.constants import IGNORE_INDEX
from finetune.errors import FinetuneError
from finetune.losses.causal_lm import forward

FOLDER = "lora_init"
"""output_dir's folder for the computed init (a resumed run loads it)."""
EVA_FILE = "eva_state_dict.safetensors"
CORDA_FILE = "corda_cache.pt"
MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


@dataclass
class InitData:
    """What a data-driven init reads: `loader()` makes a fresh loader of this process's training
    batches (not the training loader itself, whose generator the first epoch must find untouched),
    `num_batches` of which are read (None: all); `pad_id` finds packed rows' padding; `folder` holds
    the result; `resume_from`, on a resume, is the lora_init folder of the run that wrote the
    checkpoint, loaded instead of computing the init again (and copied to `folder`)."""

    loader: Callable[[], Iterable[dict]]
    num_batches: int | None
    pad_id: int
    folder: Path
    resume_from: Path | None = None


def config_fields(lora) -> dict[str, Any]:
    """LoraConfig's eva_config / corda_config for lora.init_lora_weights (empty for other inits)."""
    from peft import EvaConfig
    from peft.tuners.lora.config import CordaConfig

    if lora.init_lora_weights == "eva":
        eva = lora.eva
        return {
            "eva_config": EvaConfig(
                rho=eva.rho,
                tau=eva.tau,
                use_label_mask=eva.use_label_mask,
                label_mask_value=IGNORE_INDEX,
                whiten=eva.whiten,
                adjust_scaling_factors=eva.adjust_scaling_factors,
            )
        }
    if lora.init_lora_weights == "corda":
        corda = lora.corda
        return {
            "corda_config": CordaConfig(
                corda_method=corda.corda_method, use_float16_for_covariance=corda.use_float16_for_covariance
            )
        }
    return {}


def is_data_driven(config) -> bool:
    """Whether a LoraConfig's init reads training data (EVA, CorDA)."""
    return config.init_lora_weights in ("eva", "corda")


def data_driven_peft_model(net, config, data: InitData | None):
    """`get_peft_model(net, config)` with EVA's or CorDA's init computed over `data` (see the module
    docstring: on the main process, broadcast, saved for a resume). Every process calls it."""
    from peft import get_peft_model

    if data is None:
        raise FinetuneError(
            f"lora.init_lora_weights: {config.init_lora_weights} needs the training batches, which this "
            "caller does not give: use true, gaussian, pissa or olora here"
        )
    data.folder.mkdir(parents=True, exist_ok=True)
    if config.init_lora_weights == "eva":
        # Adapters on the meta device until EVA sets them (PEFT's advice: no throwaway random init).
        model = get_peft_model(net, config, low_cpu_mem_usage=True)
        state = _shared(
            data, data.folder / EVA_FILE, lambda: eva_state_dict(model, data), _save_eva, _load_eva
        )
        from peft import initialize_lora_eva_weights

        initialize_lora_eva_weights(model, eva_state_dict=dict(state))
        return model
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    # preprocess_corda matches target_modules by name and does not expand `all-linear` itself, as
    # get_peft_model does: PEFT's own expansion first, so both see the same layers.
    config = _maybe_include_all_linear_layers(config, net)
    cache = _shared(
        data, data.folder / CORDA_FILE, lambda: corda_cache(net, config, data), torch.save, _load_pt
    )
    with tempfile.TemporaryDirectory() as tmp:
        # Every process applies the main process's eigens through PEFT's own cache path.
        config.corda_config.cache_file = str(Path(tmp) / CORDA_FILE)
        torch.save(cache, config.corda_config.cache_file)
        from peft.tuners.lora.corda import preprocess_corda

        preprocess_corda(net, config)
        config.corda_config.cache_file = None  # the temporary file is gone: not recorded in adapter_config
        return get_peft_model(net, config)


def _shared(data: InitData, path: Path, compute, save, load) -> dict[str, torch.Tensor]:
    """The init's tensors on every process: loaded from `path` on a resume, else computed on the main
    process and saved there; broadcast to the others (a sync point)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState()
    result: list = [None]
    if state.is_main_process:
        if data.resume_from is not None:
            saved = data.resume_from / path.name
            if not saved.is_file():
                raise FinetuneError(
                    f"{saved} is missing: a resumed run with lora.init_lora_weights eva or corda loads the init "
                    "that the checkpoint's run computed there; restore it, or start a new run"
                )
            tensors = load(saved)
            print(f"lora.init_lora_weights: the init is loaded from {saved} (resume), not computed again")
        else:
            tensors = {k: v.detach().cpu().contiguous() for k, v in compute().items()}
            print(f"lora.init_lora_weights: the init is computed from the training data, saved to {path}")
        if data.resume_from is None or data.resume_from.resolve() != path.parent.resolve():
            save(tensors, str(path))  # a resume into another output_dir keeps it for its own resume
        result = [tensors]
    if state.num_processes > 1:
        broadcast_object_list(result)  # sync point: the others wait for the main process's pass
    return result[0]


def _save_eva(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path)


def _load_eva(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _load_pt(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def real_tokens(batch: dict, pad_id: int) -> torch.Tensor:
    """Bool mask of a batch's tokens that are not padding. Unpadded rows have an attention mask;
    packed rows have none and end with a padding segment of their own (position_ids restart at 0,
    every id is pad_id and untrained: finetune.data.batching.collate).

    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 0, 0]]), "labels": torch.tensor([[5, 6, 7, -100, -100]]),
    ...          "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    >>> real_tokens(batch, pad_id=0).tolist()
    [[True, True, True, False, False]]
    """
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    mask = torch.ones_like(ids, dtype=torch.bool)
    for i in range(ids.size(0)):
        starts = torch.nonzero(pos[i] == 0).flatten()
        last = int(starts[-1]) if len(starts) else 0
        if (
            last > 0
            and bool((ids[i, last:] == pad_id).all())
            and bool((labels[i, last:] == IGNORE_INDEX).all())
        ):
            mask[i, last:] = False
    return mask


class _Batches:
    """The first `num_batches` batches of a fresh loader, with a `len` (PEFT's EVA asks for one)."""

    def __init__(self, data: InitData, device: torch.device | None):
        self.data, self.device = data, device

    def __len__(self) -> int:
        total = len(self.data.loader())
        return total if self.data.num_batches is None else min(total, self.data.num_batches)

    def __iter__(self) -> Iterator[dict]:
        for batch in islice(self.data.loader(), self.data.num_batches):
            batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
            batch["real_tokens"] = real_tokens(batch, self.data.pad_id)
            yield {k: v.to(self.device) for k, v in batch.items()} if self.device is not None else batch


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


def eva_state_dict(model, data: InitData) -> dict[str, torch.Tensor]:
    """PEFT's `get_eva_state_dict` of a PEFT model (adapters not yet set) over the training batches:
    the model's own forward (packed rows keep their sequences apart), the SVD over real tokens (and only
    trained ones with lora.eva.use_label_mask), nothing gathered from other ranks (see the docstring)."""
    from peft.tuners.lora.eva import get_eva_state_dict

    def mask_positions(batch: dict, peft_config) -> torch.Tensor:
        # PEFT's prepare_model_inputs_fn_language_modeling, with packed rows' padding found too.
        mask = batch["real_tokens"]
        if peft_config.eva_config.use_label_mask:
            mask = mask & (batch["labels"] != peft_config.eva_config.label_mask_value)
        return mask.nonzero()

    batches = _Batches(data, None)  # PEFT's EVA moves each batch to the model's device itself
    if len(batches) == 0:
        raise FinetuneError("lora.init_lora_weights: eva found no training batches to compute the init from")
    return get_eva_state_dict(
        model,
        batches,
        forward_fn=lambda m, batch: forward(m, _model_inputs(batch)),
        prepare_model_inputs_fn=mask_positions,
        gather_distributed_inputs=False,
        show_progress_bar=False,
    )


def corda_cache(net, config, data: InitData) -> dict[str, torch.Tensor]:
    """PEFT's `preprocess_corda` of `net` over the training rows, one forward per row with its padding
    removed (PEFT's covariance hook takes one sample per forward), returned in PEFT's cache format."""
    from peft.tuners.lora.corda import preprocess_corda

    device = next(net.parameters()).device

    def run_model() -> None:
        rows = 0
        for batch in _Batches(data, device):
            for i in range(batch["input_ids"].size(0)):
                keep = batch["real_tokens"][i]
                row = {k: batch[k][i][keep].unsqueeze(0) for k in ("input_ids", "position_ids")}
                forward(net, row)
                rows += 1
        if rows == 0:
            raise FinetuneError(
                "lora.init_lora_weights: corda found no training rows to compute the init from"
            )

    training = net.training
    with tempfile.TemporaryDirectory() as tmp:
        config.corda_config.cache_file = str(Path(tmp) / CORDA_FILE)
        try:
            preprocess_corda(net, config, run_model=run_model)
            return _load_pt(Path(config.corda_config.cache_file))
        finally:
            config.corda_config.cache_file = None
            net.train(training)  # preprocess_corda leaves the model in eval mode
