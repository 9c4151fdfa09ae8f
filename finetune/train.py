"""Train from a recipe: `accelerate launch finetune/train.py recipe.yaml [--section.field value ...]`.

recipe -> accelerator -> objective (what is trained) -> engine (how: finetune/engine/). The same
script runs on one CPU, one GPU, DDP, FSDP2 and DeepSpeed; the accelerate config decides.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a script, Python puts finetune/ first on sys.path; its modules (data, model, recipe...)
    # must not shadow top-level packages. The installed `finetune` package is imported instead.
    sys.path.pop(0)

from finetune.errors import FinetuneError


def main(argv: list[str] | None = None) -> int:
    """Run one training job; 0 when done or stopped cleanly (with a checkpoint, or during startup before
    anything trained), 2 on a user error."""
    from finetune.launcher import StoppedAtStartup, stop_at_startup_on_signals, watch_supervisor

    previous = stop_at_startup_on_signals()  # first: imports and loading take a while
    watch_supervisor()  # under `finetune train`: end with it, never train on as an orphan
    try:
        return _main(argv)
    except StoppedAtStartup as stop:
        if os.environ.get("RANK", "0") == "0":  # once, from the main process
            print(
                f"stopping: received {stop} during startup, before the first step; nothing trained, nothing "
                "to save. Run the same command again to start over",
                flush=True,
            )
        return 0
    finally:
        for sig, handler in previous.items():  # main() may run inside another program (tests)
            signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    import torch  # training needs it anyway; whether CUDA is there decides what DeepSpeed is told

    from finetune.quiet import quiet_third_party

    quiet_third_party(
        torch.cuda.is_available()
    )  # before the imports below pull in bitsandbytes, DeepSpeed, diffusers
    from finetune import engine
    from finetune.notices import warn
    from finetune.objectives import objective_for
    from finetune.recipe import load_recipe, recipe_to_dict, recipe_warnings

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        recipe = load_recipe(argv[0], argv[1:])
        accelerator = engine.make_accelerator(
            recipe.train,
            model_kind=recipe.model.kind,
            qlora=recipe.lora.enable_qlora,
            compile_model=recipe.model.enable_compile,
            lora=recipe.lora.enable_lora,
        )
        for line in recipe_warnings(recipe) + context_warnings(recipe):  # said once, first
            warn(line, emit=accelerator.print)
        try:
            return engine.train(
                objective_for(recipe),
                accelerator,
                train=recipe.train,
                hub=recipe.hub,
                recipe_dict=recipe_to_dict(recipe),
                memory_plan=memory_plan(recipe) if accelerator.is_main_process else None,
            )
        finally:
            # Also on an early stop or an abort: trackers flush their files here.
            accelerator.end_training()
    except FinetuneError as exc:
        from finetune.launcher import write_status

        print(f"error: {exc}", file=sys.stderr, flush=True)
        write_status(2, str(exc))  # `finetune train` then exits 2 with this message alone
        return 2


def context_warnings(recipe) -> list[str]:
    """Rows longer than the model's trained context without model.rope_scaling (finetune.model.context);
    an online objective's rows hold the prompt and its completion."""
    from finetune.model.build import _load_config
    from finetune.model.context import context_warning
    from finetune.recipe.objectives import OBJECTIVES

    if recipe.model.kind == "diffusion":
        return []
    spec = OBJECTIVES[recipe.train.objective]
    online = getattr(recipe, spec.section) if spec.kind == "online" else None
    length = recipe.data.sequence_len + (online.max_new_tokens if online is not None else 0)
    try:  # the config as the model ships it; one that cannot be read here is reported when the model loads
        config = _load_config(recipe.model)
    except (FinetuneError, OSError, ValueError):
        return []
    found = context_warning(config, recipe.model, length)
    return [found] if found else []


def memory_plan(recipe) -> dict:
    """The planner's prediction for this run (finetune.plan.training_prediction), recorded in
    progress.jsonl beside the measured peaks; {"unavailable": why} when it cannot be made. A
    prediction is information only: no failure of the planner may stop a training run."""
    from finetune.accelerate_config import setup_from_env
    from finetune.plan import training_prediction

    try:
        return training_prediction(recipe, setup_from_env())
    except Exception as exc:  # any failure: see the docstring
        return {"unavailable": f"the planner failed: {type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    sys.exit(main())
