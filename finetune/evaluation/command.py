"""The `finetune eval` and `finetune chat` commands (finetune/cli.py parses and calls these).

`finetune eval` compares models side by side (the recipe's base and a tuned adapter or model) on:
* the recipe's held-out split, scored the way the objective scores it in training (the objective
  class's `held_out`, finetune.objectives): SFT's token loss and perplexity, the preference
  objectives' loss, rewards and `preferred` on held-out pairs with the base as the reference, the
  online objectives' rewards of greedy completions, a reward model's pair accuracy (the class may say
  how its models load: `load`);
* its `eval.generation_sets` (finetune.generation.sets);
* its `eval.lm_eval` tasks, standard benchmarks run by lm-evaluation-harness on the loaded model
  (finetune.evaluation.harness).
The held-out batches are built by the objectives' own loaders, as training builds them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError


def run_chat(
    model_dir: str,
    *,
    base: str | None,
    prompt: str | None,
    system: str | None,
    max_new_tokens: int,
    images: list[str] | None = None,
    tools: list[str] | None = None,
    tool_close: str = "",
    tool_timeout_s: float = 10.0,
) -> int:
    """`finetune chat`: load the model once, then one answer (`prompt`) or a conversation; a
    vision-language model (with its processor) also takes `images` (paths) for the first message.
    `tools` (`file.py:function[:trigger]`, finetune.evaluation.chat.tool_specs) are called while it
    answers, as in training and evaluation."""
    from finetune.evaluation.chat import chat, open_image, tool_specs
    from finetune.generation.backends import backend_for
    from finetune.model.inference import (
        inference_device,
        is_vision_language,
        load_for_inference,
        load_vlm_for_inference,
    )

    pictures = [open_image(path) for path in images or []]  # checked before the model loads
    specs = tool_specs(tools or [], close=tool_close)  # checked too
    processor = None
    if is_vision_language(Path(model_dir).expanduser()):
        model, processor = load_vlm_for_inference(model_dir, base=base)
        tokenizer = processor.tokenizer
    elif pictures:
        raise FinetuneError(
            f"--image: {model_dir} is not a vision-language model (its config has no vision_config), so it "
            "cannot read images; leave out --image, or point at a model.kind vlm run's output_dir"
        )
    else:
        model, tokenizer = load_for_inference(model_dir, base=base)
    model.to(inference_device())
    backend = backend_for("transformers", model, tokenizer, processor=processor)
    toolbox = None
    if specs:
        from finetune.generation.tools import load_tools

        toolbox = load_tools(
            specs, tokenizer=tokenizer, max_tool_calls=4, timeout_s=tool_timeout_s, base=None, label="--tool"
        )
    try:
        return chat(
            backend,
            prompt=prompt,
            system=system,
            max_new_tokens=max_new_tokens,
            pictures=pictures,
            toolbox=toolbox,
        )
    finally:
        if toolbox is not None:
            toolbox.close()


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _held_out(recipe) -> dict[str, Any]:
    """What the objective scores on the prepared eval split ({} without one): its class's `held_out`
    (token-loss batches, or a per-model `score` hook, whether the base is the reference, and how its
    models `load` when they are not causal LMs)."""
    from finetune.data.prepare.build import prepare

    if not (recipe.data.val_set_size or recipe.data.test_datasets):
        return {}
    prepared = prepare(recipe, log=_say)
    if prepared.eval is None or len(prepared.eval) == 0:
        return {}
    from finetune.objectives import objective_class

    return objective_class(recipe).held_out(recipe, prepared)


def model_labels(targets: list[str]) -> list[str]:
    """Column names of the tuned models: `tuned` for one, else their folder names (made unique).

    >>> model_labels(["out/sft"]), model_labels(["out/sft", "out/grpo", "b/grpo"])
    (['tuned'], ['sft', 'grpo', 'grpo-2'])
    """
    if len(targets) == 1:
        return ["tuned"]
    labels: list[str] = []
    for target in targets:
        name = Path(target).name or str(target)
        label, k = name, 2
        while label in labels or label == "base":
            label, k = f"{name}-{k}", k + 1
        labels.append(label)
    return labels


def run_eval(recipe, args) -> int:
    """`finetune eval` with its parsed command line `args` (finetune/cli.py): the models to compare,
    the held-out split, the generation sets -> table.

    Several adapters (`--adapter A --adapter B`, e.g. an SFT run and a GRPO run on top of it) are
    scored side by side with the base, each in its own column. Every adapter or model is checked
    against the recipe's base before anything runs; then the models load, are evaluated and are freed
    one at a time (evaluation.compare.evaluate_models, which first checks that each tuned one loads), so
    peak memory is one model's."""
    adapters, model, no_base = args.adapter, args.model, args.no_base
    vision = recipe.model.kind == "vlm"
    from finetune.evaluation.compare import evaluate_models, format_table, write_report
    from finetune.evaluation.fit import check_fits_recipe
    from finetune.model.build import load_tokenizer
    from finetune.model.folders import check_model_location
    from finetune.model.inference import base_model_source, inference_device, load_for_inference

    load = _load_vlm if vision else load_for_inference

    has_split = bool(recipe.data.val_set_size or recipe.data.test_datasets)
    benchmarks = recipe.eval.lm_eval.tasks
    if not has_split and not recipe.eval.generation_sets and not benchmarks:
        raise _nothing_to_evaluate()
    targets = list(adapters or []) or ([model] if model else [])
    flag = "--adapter" if adapters else "--model"
    tokenizer = load_tokenizer(recipe.model)
    for target in targets:  # in seconds, before the data is prepared and any model loads
        check_model_location(target, flag=flag, local=bool(adapters))
        check_fits_recipe(target, recipe.model, tokenizer, flag=flag)
    harness = _harness(recipe.eval.lm_eval) if benchmarks and not vision else None
    if benchmarks and vision:
        raise FinetuneError(
            "eval.lm_eval: the lm-eval benchmarks run on text causal LMs; a model.kind vlm recipe cannot run "
            "them: leave out --lm-eval / eval.lm_eval.tasks"
        )
    held_out = _held_out(recipe)
    if not held_out and not recipe.eval.generation_sets and harness is None:
        raise _nothing_to_evaluate()
    load = held_out.get("load", load)  # a reward model loads as one (its score head; finetune.model.reward)
    needs_reference = held_out.get("needs_reference", False)
    models = {}
    if no_base and needs_reference and targets:
        _say(f"the base model is scored too: it is train.objective {recipe.train.objective}'s reference")
    if not targets or not no_base or needs_reference:
        base = base_model_source(recipe.model, adapter=adapters[0] if adapters else None)
        models["base"] = lambda: load(base, tokenizer=tokenizer)
    for label, target in zip(model_labels(targets), targets, strict=True):
        # Merged into the base for generation (faster); the weights are the same function.
        models[label] = lambda target=target: load(target, merge=True)
    processor = None
    if vision:  # the recipe's processor reads every model's images, as in training
        from finetune.model.vlm import load_processor

        processor = load_processor(recipe.model)
    results = evaluate_models(
        models,
        eval_batches=held_out.get("eval_batches"),
        sets=recipe.eval.generation_sets,
        batch_size=recipe.eval.batch_size,
        progress=not args.no_progress,
        say=_say,
        score=held_out.get("score"),
        device=inference_device(),
        processor=processor,
        image_max_pixels=recipe.data.image_max_pixels,
        base=Path(recipe.source_path).parent if recipe.source_path else None,
        images_outside=recipe.data.allow_image_paths_outside,
        harness=harness,
    )
    default = Path(targets[-1] if targets else recipe.train.output_dir) / "eval.json"
    path = Path(args.output) if args.output else default
    names = {"base": recipe.model.model_path, **dict(zip(model_labels(targets), targets, strict=True))}
    write_report(results, path, recipe=args.recipe, models=names)
    print(format_table(results))
    print(f"\nfull results and every sample: {path}")
    return 0


def _harness(section):
    """`run(model, tokenizer)` scoring `eval.lm_eval`'s tasks with lm-evaluation-harness. The tasks are
    loaded here first (their data read, offline unless eval.lm_eval.download), before any model loads:
    a task without its data fails in seconds, naming itself."""
    from finetune.evaluation.harness import HarnessSettings, check_tasks, run_harness

    settings = HarnessSettings(
        tasks=tuple(section.tasks),
        include_path=tuple(section.include_path),
        data_files={task: dict(files) for task, files in section.data_files.items()},
        limit=section.limit,
        num_fewshot=section.num_fewshot,
        batch_size=section.batch_size,
        max_length=section.max_length,
        max_gen_toks=section.max_gen_toks,
        apply_chat_template=section.apply_chat_template,
        bootstrap_iters=section.bootstrap_iters,
        download=section.download,
    )
    _say(f"loading lm-eval tasks {', '.join(settings.tasks)}")
    manager, specs = check_tasks(settings)
    return lambda model, tokenizer: run_harness(model, tokenizer, settings, manager, specs)


def _load_vlm(path: str, *, tokenizer=None, merge: bool = False):
    """(model, tokenizer) of a vision-language model or adapter for `finetune eval`: the held-out batches
    and the generation sets' images go through the recipe's processor (and `tokenizer`), as in training,
    so the saved processor is not used; an adapter stays unmerged (load_vlm_for_inference does not merge)."""
    from finetune.model.inference import load_vlm_for_inference

    net, processor = load_vlm_for_inference(path)
    return net, tokenizer if tokenizer is not None else processor.tokenizer


def _nothing_to_evaluate() -> FinetuneError:
    return FinetuneError(
        "nothing to evaluate: the recipe has no eval split (data.val_set_size or data.test_datasets), "
        "no eval.generation_sets and no eval.lm_eval.tasks (--lm-eval)"
    )
