"""The vLLM generation backend (grpo.generation_backend: vllm): rollouts from a vLLM engine colocated
with training on each GPU process, synced with the trained weights after every update.

How it is set up, and why:
* **One engine per process, sharing its GPU** (colocate, as TRL's `vllm_mode="colocate"`): vLLM's
  `external_launcher` executor runs inside the training process, with `gpu_memory_utilization` of the
  GPU for its weights and KV cache (grpo.vllm_gpu_memory_utilization). Each process generates for its
  own prompts, as the transformers backend does; a DDP run has one engine per rank.
* **Built from the config, filled by the first sync**: the engine starts with `load_format="dummy"`
  from the model's config and tokenizer written to a temporary folder (no second read of the weights
  from disk, and models built from an inline config or converted from GGUF work), then
  `sync_weights` loads the trained weights into it, before the first rollout and after every update.
* **LoRA**: the adapters are merged into the base weights for the copy (PEFT's safe merge into new
  tensors, the originals put back bit for bit: finetune.model.adapters.merged_adapters; PEFT's
  merge_adapter / unmerge_adapter, which round, where that cannot be: QLoRA, DoRA), so vLLM runs the
  plain architecture at full speed; vLLM's own LoRA path would send only the adapter but run the
  slower punica kernels. Which is faster per step was not measured: no
  GPU was lent when this was built (benchmarks/RESULTS.md says so).
* **Prompts go in as token ids**; each completion is its own request with its own seed
  (finetune.objectives.rollout.completion_seed), so a prompt's completions do not depend on its
  batch. vLLM honours per-request seeds: the same weights, prompt and seed sample the same tokens on
  the same GPU and vLLM version; bitwise equality across batch compositions is not guaranteed (its
  kernels' reductions depend on the batch), so a resumed run samples the same completions only up to
  those numerics.
* **Sampling log-probs**: vLLM returns the log-prob of every sampled token after temperature
  (`logprobs_mode="processed_logprobs"`); the online objective corrects the gap between these and the
  trainer's with truncated importance sampling (finetune.losses.policy_gradient.importance_weights).

Needs a CUDA GPU and `pip install -e ".[vllm]"`; both are checked when the backend is made, with an
error saying what to use instead.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.generation.prompts import decode_completion, stop_token_ids
from finetune.generation.protocol import Completion, SamplingParams

# vLLM refuses a higher temperature (SamplingParams._verify_args).
MAX_TEMPERATURE = 2.0


class VLLMBackend:
    """See the module docstring; the interface is finetune.generation.protocol's."""

    name = "vllm"
    copies_weights = True  # the engine holds its own copy: sync_weights reads the trained weights whole

    def __init__(
        self,
        model,
        tokenizer,
        *,
        processor=None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
    ):
        if processor is not None:
            raise FinetuneError(
                "grpo.generation_backend vllm: vision-language models are not supported by the vLLM backend "
                "yet; use generation_backend: transformers"
            )
        check_vllm_available()
        from vllm import LLM

        self.model, self.tokenizer, self.processor = model, tokenizer, None
        self.enable_sleep_mode = enable_sleep_mode
        process_index = _set_launcher_environment()
        self._folder = tempfile.TemporaryDirectory(prefix="finetune-vllm-")
        _base_model(model).config.save_pretrained(self._folder.name)
        tokenizer.save_pretrained(self._folder.name)
        self.llm = LLM(
            model=self._folder.name,
            load_format="dummy",  # the weights come from the first sync_weights
            dtype=_dtype_name(model),
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            distributed_executor_backend="external_launcher",
            seed=process_index,  # the engine's own RNG; every request carries its seed
            logprobs_mode="processed_logprobs",
        )
        self.stops = stop_token_ids(tokenizer, model)
        self.sync_weights(model)

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[Sequence[int]] | None = None,
        batch_size: int = 8,
        images: Sequence[Sequence[Any]] | None = None,
        progress: bool = False,
    ) -> list[list[Completion]]:
        """Every completion is one request (vLLM batches them itself: `batch_size` is not needed)."""
        n = params.num_return_sequences
        if not params.greedy and (seeds is None or any(len(s) != n for s in seeds)):
            raise ValueError(
                "sampling needs one seed per completion: seeds[k] holds num_return_sequences seeds"
            )
        if params.stop_patterns:  # what it would take: finetune/generation/tools.py's module docstring
            raise FinetuneError("tools with inline triggers are not supported by the vLLM backend yet")
        if params.temperature > MAX_TEMPERATURE:
            raise FinetuneError(
                f"grpo.temperature {params.temperature}: vLLM samples at temperatures up to {MAX_TEMPERATURE}"
            )
        requests, sampling = [], []
        for k, ids in enumerate(prompts):
            for j in range(n):
                requests.append({"prompt_token_ids": list(ids)})
                sampling.append(self._vllm_params(params, None if params.greedy else int(seeds[k][j])))
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=progress)
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
        flat = [completion_of(out.outputs[0], self.stops, eos=self.tokenizer.eos_token_id) for out in outputs]
        return [flat[k * n : (k + 1) * n] for k in range(len(prompts))]

    def _vllm_params(self, params: SamplingParams, seed: int | None):
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            seed=seed,
            stop_token_ids=list(self.stops),
            logprobs=0,  # the sampled token's log-prob only
            skip_special_tokens=True,
        )

    def stream(self, inputs: Mapping[str, torch.Tensor], params: SamplingParams) -> Iterator[str]:
        """vLLM's offline engine answers whole: the answer comes as one piece."""
        ids = inputs["input_ids"][0].tolist()
        (row,) = self.generate([ids], params)
        yield decode_completion(self.tokenizer, row[0].ids, stops=self.stops)

    def sync_weights(self, model) -> None:
        """Load `model`'s current weights into the engine (merged, for a PEFT model), then drop the
        prefix cache, whose keys and values the old weights computed."""
        self.model = model
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
        target = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in vllm_named_weights(model):
            target.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()


def check_vllm_available() -> None:
    """A clear error where vLLM cannot run: no CUDA GPU, or the package is not installed."""
    import importlib.util

    if not torch.cuda.is_available():
        raise FinetuneError(
            "grpo.generation_backend vllm needs a CUDA GPU (vLLM generates on GPUs) and this machine has none: "
            "use generation_backend: transformers, which generates with the training model on CPU or GPU"
        )
    if importlib.util.find_spec("vllm") is None:
        raise FinetuneError(
            'grpo.generation_backend vllm: the vllm package is not installed; pip install -e ".[vllm]" (a vLLM '
            "build for your torch and CUDA), or use generation_backend: transformers"
        )


def completion_of(output, stops: Sequence[int], *, eos: int | None) -> Completion:
    """A vLLM CompletionOutput as a Completion: its ids cut after the first stop id (kept, as the
    transformers backend keeps it), finished when vLLM stopped for a stop token or eos, and the log-prob
    of every sampled token (NaN where vLLM gave none: no importance-sampling correction there).

    >>> from types import SimpleNamespace as O
    >>> out = O(token_ids=[5, 6, 2, 9], finish_reason="stop", stop_reason=None,
    ...         logprobs=[{5: O(logprob=-0.5)}, {6: O(logprob=-1.0)}, {2: O(logprob=-0.1)}, {9: O(logprob=-3.0)}])
    >>> c = completion_of(out, [2], eos=2)
    >>> c.ids, c.finished, c.logprobs
    ([5, 6, 2], True, [-0.5, -1.0, -0.1])
    >>> completion_of(O(token_ids=[5, 6], finish_reason="stop", stop_reason=None, logprobs=None), [2], eos=2).ids
    [5, 6, 2]
    """
    ids = list(output.token_ids)
    logprobs = [
        entry[token].logprob if entry and token in entry else math.nan
        for token, entry in zip(ids, output.logprobs or [None] * len(ids), strict=True)
    ]
    end = next((t for t, token in enumerate(ids) if token in stops), None)
    if end is not None:
        return Completion(ids[: end + 1], True, logprobs[: end + 1])
    finished = output.finish_reason == "stop"
    if finished:  # stopped at a token vLLM left out of the ids (eos): keep it, as training trains on it
        stop = output.stop_reason if isinstance(output.stop_reason, int) else eos
        if stop is not None:
            ids, logprobs = [*ids, int(stop)], [*logprobs, math.nan]
    return Completion(ids, finished, logprobs)


def vllm_named_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of `model` under the name vLLM's load_weights expects (the
    transformers name); a PEFT model's adapters are merged into the base weights while they are read.
    One tensor at a time: no second copy of the model is made."""
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config")
    if not peft:
        for name, param in model.named_parameters():
            yield name, param.data
        return
    from finetune.model.adapters import merged_adapters

    with merged_adapters(model) as exact:  # the base weights put back bit for bit afterwards
        if not exact:  # QLoRA, DoRA: PEFT's merge and unmerge (which round)
            model.merge_adapter()
        try:
            prefix = getattr(model, "prefix", "lora_")
            for name, param in model.named_parameters():
                if prefix in name or "original_module" in name:
                    continue  # the adapters are merged; a module to save keeps its trained copy only
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                yield name.replace("modules_to_save.default.", ""), param.data
        finally:
            if not exact:
                model.unmerge_adapter()


def _base_model(model):
    """The transformers model under a PEFT wrapper (its config is the architecture vLLM builds)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _dtype_name(model) -> str:
    dtype = next(model.parameters()).dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _set_launcher_environment() -> int:
    """vLLM's external_launcher joins the training processes' torch.distributed world; it reads where
    that world is from the environment (set by torchrun / accelerate launch; filled in for one
    process). Returns this process's rank."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    return int(os.environ["RANK"])
