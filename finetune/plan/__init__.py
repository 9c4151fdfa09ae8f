"""`finetune plan`: per-GPU memory of a recipe by part, whether it fits, and a micro-batch suggestion.

Nothing is loaded or downloaded: the model is built on the meta device from its config, and every
figure comes from parameter counts and the model's shapes.

Model states follow what this codebase holds (`model_states`), sharded as the engine of the
accelerate config does (`shard_states`). Under DeepSpeed they reproduce the ZeRO paper
(Rajbhandari et al. 2020, section 3) for mixed-precision Adam with P parameters and N devices:
baseline 16P bytes, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N.
Activations count what autograd saves for a Llama-style decoder layer (`activation_bytes`).

An online objective (grpo, rloo) adds its rollout: the generate call's KV cache, logits and sampling
or prompt forward, a sharded model's gathered weights, the log-prob passes without grad, the
reference model and a vLLM engine's share; a step's peak is the larger of the rollout and the
training step.

Modules: `inventory` (the model from its config), `states` (model states and their sharding),
`activations` (what autograd saves), `rollout` (online RL's generation and rollout), `planner`
(estimate, fit, suggestions; `make_plan`) and `report` (table and JSON).
"""

from finetune.plan.activations import Activations, activation_bytes
from finetune.plan.inventory import (
    CUDA_ALLOWANCE_BYTES,
    Adapter,
    GiB,
    ModelInventory,
    adapter_counts,
    inspect_model,
    inventory_of,
    qlora_bytes_per_param,
)
from finetune.plan.planner import Estimate, Plan, estimate, gpu_memory_bytes, make_plan, suggest
from finetune.plan.report import format_plan, plan_json, plan_to_dict, training_prediction
from finetune.plan.states import Part, States, model_states, shard_states

__all__ = [
    "CUDA_ALLOWANCE_BYTES",
    "Activations",
    "Adapter",
    "Estimate",
    "GiB",
    "ModelInventory",
    "Part",
    "Plan",
    "States",
    "activation_bytes",
    "adapter_counts",
    "estimate",
    "format_plan",
    "gpu_memory_bytes",
    "inspect_model",
    "inventory_of",
    "make_plan",
    "model_states",
    "plan_json",
    "plan_to_dict",
    "qlora_bytes_per_param",
    "shard_states",
    "suggest",
    "training_prediction",
]
