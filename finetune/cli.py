"""The `finetune` command: thin subcommands that parse, validate the recipe and call one function.

Heavy libraries (torch, transformers, datasets) are imported inside the subcommands that need
them, so `finetune validate` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from finetune.accelerate_config import list_configs, resolve_accelerate_config
from finetune.errors import FinetuneError
from finetune.gguf.export import K_QUANTS, OUTTYPES
from finetune.launcher import run_supervised

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"

OVERRIDES_HELP = (
    "Any recipe field can be overridden after the recipe path: --section.field VALUE or "
    "--section.field=VALUE (list items by index: --data.datasets.0.path x.jsonl). "
    "Values are parsed as YAML: true, null, [a, b], 3e-5."
)


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (argparse prints the error with the usage, exit 2).

    >>> positive_int("8")
    8
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one above 0") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not above 0; give a whole number above 0, e.g. 256")
    return value


def _recipe_parser(sub, name: str, help_text: str, *, optional: bool = False) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=f"{help_text} {OVERRIDES_HELP}")
    parser.add_argument("recipe", nargs="?" if optional else None, help="path to the recipe YAML")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune",
        description="Fine-tune LLMs (full, LoRA, QLoRA) from one YAML recipe on the Hugging Face stack.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    validate = _recipe_parser(sub, "validate", "Validate a recipe and print it resolved (no heavy imports).")
    validate.add_argument("--explain", action="store_true", help="print each field's description too")

    prepare = _recipe_parser(sub, "prepare-dataset", "Load, format, tokenize, pack and cache the datasets.")
    prepare.add_argument(
        "--push", action="store_true", help="push the prepared dataset to data.push_dataset_to_hub"
    )

    # The recipe is optional here only so that `finetune train --list-configs` works; main()
    # requires it otherwise.
    train = _recipe_parser(
        sub, "train", "Train: runs `accelerate launch finetune/train.py RECIPE ...`.", optional=True
    )
    train.add_argument(
        "--accelerate-config",
        metavar="NAME|PATH",
        help="a config name from accelerate_configs/ (see --list-configs) or a path; "
        "default: train.accelerate_config, else a single process",
    )
    train.add_argument(
        "--list-configs", action="store_true", help="list the shipped accelerate configs and exit"
    )
    launch = train.add_argument_group(
        "launch", "override the accelerate config's values (multi-node: run once per node)"
    )
    launch.add_argument("--num-processes", type=int, metavar="N", help="processes (GPUs) on all machines")
    launch.add_argument("--num-machines", type=int, metavar="N", help="number of machines (nodes)")
    launch.add_argument(
        "--machine-rank", type=int, metavar="R", help="this machine's rank, 0..num_machines-1"
    )
    launch.add_argument("--main-process-ip", metavar="HOST", help="address of the machine with rank 0")
    launch.add_argument("--main-process-port", type=int, metavar="PORT", help="port on that machine")

    sub.add_parser("list-configs", help="List the accelerate configs shipped in accelerate_configs/.")

    plan = _recipe_parser(
        sub, "plan", "Predict per-GPU memory by part, whether it fits, and a micro batch (no weights loaded)."
    )
    plan.add_argument(
        "--accelerate-config",
        metavar="NAME|PATH",
        help="engine to plan for: a name from accelerate_configs/ or a path; default: train.accelerate_config, "
        "else a single device",
    )
    plan.add_argument("--num-gpus", type=int, metavar="N", help="GPUs on all nodes (overrides num_processes)")
    plan.add_argument("--num-nodes", type=int, metavar="M", help="nodes (overrides num_machines)")
    plan.add_argument(
        "--sequence-len",
        type=int,
        metavar="TOKENS",
        help="plan for rows of this many tokens (sets data.sequence_len and data.sample_packing_sequence_len), "
        "e.g. 131072; sequence or context parallel is recommended when activations dominate",
    )
    plan.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="memory per GPU, e.g. 80GiB, 80GB, 24GiB, 81920MiB; default: the first visible CUDA device, else 80GiB",
    )
    plan.add_argument(
        "--images-per-row",
        type=float,
        metavar="N",
        help="vision-language models: images per row, on average (default 1; the planner does not read the data)",
    )
    plan.add_argument(
        "--patches-per-image",
        type=int,
        metavar="N",
        help="vision-language models: vision-tower patches per image (default: the largest image the processor "
        "settings and data.image_max_pixels allow)",
    )
    plan.add_argument("--json", action="store_true", help="print the numbers (bytes) as JSON")

    evaluate = _recipe_parser(
        sub,
        "eval",
        "Evaluate a model: eval loss and perplexity on the recipe's eval split, and the generation metrics of "
        "its eval.generation_sets; with --adapter or --model, the recipe's base model too, side by side.",
    )
    which = evaluate.add_mutually_exclusive_group()
    which.add_argument(
        "--adapter",
        metavar="DIR",
        action="append",
        help="a trained adapter folder (evaluated on its base); repeat it to compare several side by side",
    )
    which.add_argument("--model", metavar="DIR", help="a full model folder (e.g. merged or fully fine-tuned)")
    evaluate.add_argument(
        "--no-base", action="store_true", help="with --adapter/--model: skip the base model"
    )
    evaluate.add_argument(
        "--output",
        metavar="FILE",
        help="where to write eval.json (default: DIR/eval.json, else train.output_dir)",
    )
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bars")
    evaluate.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="standard benchmarks through lm-evaluation-harness, comma-separated (gsm8k,arc_easy,hellaswag, "
        "or tasks of eval.lm_eval.include_path): sets eval.lm_eval.tasks; needs pip install 'finetune[eval]'",
    )
    evaluate.add_argument(
        "--lm-eval-limit",
        type=positive_int,
        metavar="N",
        help="score the first N examples of each lm-eval task only: sets eval.lm_eval.limit",
    )

    talk = sub.add_parser(
        "chat", help="Talk to a model: an adapter or full model folder, a .gguf file or package:// reference."
    )
    talk.add_argument("model_dir", help="adapter folder, model folder, .gguf file or package://pkg/file.gguf")
    talk.add_argument("--prompt", help="answer this one message and exit (scriptable)")
    talk.add_argument("--system", help="a system prompt (default: the chat template's own)")
    talk.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=512,
        metavar="N",
        help="most tokens an answer has (512)",
    )
    talk.add_argument("--base", help="the adapter's base model, when it moved since training")
    talk.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image for the first message (repeatable; vision-language models only). "
        "In a conversation, /image PATH attaches one to the next message",
    )
    talk.add_argument(
        "--tool",
        action="append",
        metavar="FILE.py:FUNCTION[:TRIGGER]",
        help="a tool the model calls while it answers (repeatable): with a TRIGGER regex an inline call "
        "(fn(*groups) where the text ends with a match, its result inserted), without one a chat tool in "
        "the template's call format; as grpo.tools and generation sets' tools",
    )
    talk.add_argument("--tool-close", default="", metavar="TEXT", help="inserted after inline results ('>>')")
    talk.add_argument(
        "--tool-timeout", type=float, default=10.0, metavar="S", help="seconds a tool call may take (10)"
    )

    checkpoints = sub.add_parser(
        "checkpoints",
        help="List a run's checkpoints: step, size, whether each verifies, which one `auto` resumes.",
    )
    checkpoints.add_argument("output_dir", help="the run's train.output_dir")

    report = sub.add_parser(
        "report",
        help="One self-contained HTML page about training runs: curves overlaid across runs, finetune eval's "
        "table and samples, the data manifest, the planner's memory prediction vs the measured peak.",
    )
    report.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help="a run's train.output_dir")
    report.add_argument("--output", metavar="FILE", help="the HTML file to write (report.html)")
    report.add_argument(
        "--serve",
        action="store_true",
        help="serve the page on this machine instead of writing it, kept current while the runs log "
        "(Ctrl-C stops)",
    )
    report.add_argument("--port", type=int, metavar="N", help="--serve's port (8765; 0: any free port)")
    report.add_argument(
        "--host",
        metavar="ADDRESS",
        help="--serve's address (127.0.0.1, this machine only; another address is served with a warning)",
    )

    merge = sub.add_parser(
        "merge-lora", help="Merge a LoRA adapter into its base model and save full weights."
    )
    merge.add_argument("adapter_dir", help="folder holding adapter_config.json and the adapter weights")
    merge.add_argument("--output", required=True, help="folder to write the merged model to")
    merge.add_argument("--base", help="base model path (default: base_model_name_or_path of the adapter)")
    merge.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")

    export = sub.add_parser(
        "export-gguf",
        help="Write a trained model (an adapter is merged first) as one GGUF file for llama.cpp, Ollama, LM Studio.",
    )
    export.add_argument(
        "output_dir", help="a run's train.output_dir: an adapter, a full or a merged model folder"
    )
    export.add_argument(
        "--outtype",
        choices=[*OUTTYPES, *K_QUANTS],
        default="f16",
        help="weight type of the matrices (f16); the k-quants are refused with what is written",
    )
    export.add_argument(
        "--output", metavar="FILE", help="the .gguf file (default: OUTPUT_DIR/<name>-<outtype>.gguf)"
    )
    export.add_argument("--base", help="the adapter's base model, when it moved since training")
    export.add_argument("--overwrite", action="store_true", help="replace the .gguf file if it exists")
    return parser


def _print_recipe(recipe, explain: bool) -> None:
    from finetune.recipe import recipe_to_dict
    from finetune.recipe.yaml_io import dump_yaml

    if not explain:
        print(dump_yaml(recipe_to_dict(recipe)), end="")
        return
    for line in explain_lines(recipe):
        print(line)


def explain_lines(recipe) -> list[str]:
    """The resolved recipe as YAML with each field's description as a comment above it."""
    from pydantic import BaseModel

    from finetune.recipe.yaml_io import dump_yaml

    out: list[str] = []

    def walk(model: BaseModel, indent: str) -> None:
        data = model.model_dump(mode="json")
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if field.description:
                out.append(f"{indent}# {field.description}")
            if isinstance(value, BaseModel):
                out.append(f"{indent}{name}:")
                walk(value, indent + "  ")
            elif value and isinstance(value, list) and all(isinstance(v, BaseModel) for v in value):
                out.append(f"{indent}{name}:")
                for item in value:  # `-` alone, then the item's fields with their comments
                    out.append(f"{indent}-")
                    walk(item, indent + "  ")
            else:
                dumped = dump_yaml({name: data[name]})
                out.extend(indent + line for line in dumped.rstrip("\n").splitlines())

    walk(recipe, "")
    return out


LAUNCH_OPTIONS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")


def launch_command(
    recipe_path: str,
    overrides: list[str],
    config: Path | None,
    launch: dict | None = None,
    mixed_precision: str = "no",
) -> list[str]:
    """The command line `finetune train` runs: `accelerate launch ...`.

    `launch` holds the accelerate config values given on the command line (LAUNCH_OPTIONS).

    A MULTI_CPU config goes through torch.distributed.run instead: `accelerate launch` (1.15) starts a
    single process for CPU configs unless MPI is set up, while torchrun with ACCELERATE_USE_CPU=true
    (set by `_run`) gives a real multi-process gloo run.
    """
    import yaml

    launch = {k: v for k, v in (launch or {}).items() if v is not None}
    data = (yaml.safe_load(config.read_text()) or {}) if config is not None else {}
    if data.get("distributed_type") == "MULTI_CPU":
        processes = int(launch.get("num_processes", data.get("num_processes", 1)))
        if processes > 1:
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(processes),
                str(TRAIN_SCRIPT),
                recipe_path,
                *overrides,
            ]
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config is not None:
        cmd += ["--config_file", str(config)]
    else:
        # No config: one process on whatever device there is, without accelerate's warnings
        # about unset launcher values.
        launch.setdefault("num_processes", 1)
        cmd += ["--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", mixed_precision]
    if config is not None and _needs_a_free_port(launch, data):
        # accelerate launch binds 29500 unless told otherwise, so two single-machine runs at once
        # (two jobs on one box, or a parallel test suite) would collide; port 0 is accelerate's own
        # "pick a free port" (accelerate.utils.launch.prepare_multi_gpu_env / prepare_deepspeed_cmd_env).
        launch["main_process_port"] = 0
    for key in LAUNCH_OPTIONS:
        if key in launch:
            cmd += [f"--{key}", str(launch[key])]
    return [*cmd, str(TRAIN_SCRIPT), recipe_path, *overrides]


def _needs_a_free_port(launch: dict, config: dict) -> bool:
    """One machine and no port given (command line or config): any free port will do."""
    machines = int(launch.get("num_machines", config.get("num_machines", 1)))
    return machines <= 1 and "main_process_port" not in launch and "main_process_port" not in config


def print_checkpoints(output_dir: str) -> int:
    """The table of `finetune checkpoints`; exit 0 when `auto` has a checkpoint to resume, else 1."""
    from finetune.checkpoint import checkpoints_dir, describe_checkpoints

    rows = describe_checkpoints(output_dir)
    if not rows:
        print(f"no checkpoints in {checkpoints_dir(output_dir)}")
        return 1
    print(f"{'step':>8}  {'size':>10}  {'auto':4}  status")
    for row in rows:
        status = "verifies" if row["problem"] is None else f"DAMAGED: {row['problem']}"
        size = f"{row['bytes'] / 2**20:,.1f} MiB"
        print(f"{row['step']:>8}  {size:>10}  {'<-' if row['auto'] else '':4}  {status}")
    picked = [r for r in rows if r["auto"]]
    print(
        f"--train.load_checkpoint_path auto resumes from {picked[0]['path']}"
        if picked
        else "--train.load_checkpoint_path auto finds no checkpoint that verifies (a fresh start)"
    )
    return 0 if picked else 1


def export_gguf_command(args: argparse.Namespace) -> int:
    """`finetune export-gguf`: write the file, then say where it is and how to run it."""
    from finetune.model.inference import export_gguf

    path = export_gguf(
        args.output_dir, outtype=args.outtype, output=args.output, base=args.base, overwrite=args.overwrite
    )
    print(f"GGUF file written to {path} ({path.stat().st_size / 2**20:,.1f} MiB, {args.outtype})")
    print(f"run it with llama.cpp: llama-cli -m {path}")
    print(f"or with Ollama: a Modelfile holding `FROM {path}`, then `ollama create NAME -f Modelfile`")
    return 0


def check_before_launch(recipe, config: Path | None, launch: dict) -> None:
    """Refuse, before any process starts, a recipe and engine that cannot work together here."""
    import torch

    from finetune.accelerate_config import read_accelerate_config
    from finetune.distributed import check_combination
    from finetune.quiet import quiet_third_party

    # torch is loaded now: the launcher (accelerate launch imports DeepSpeed when the config uses it)
    # inherits the settings that keep DeepSpeed's device detection quiet (finetune/quiet.py).
    quiet_third_party(torch.cuda.is_available())

    engine = read_accelerate_config(config, num_processes=launch.get("num_processes"))
    check_combination(
        engine,
        recipe.train,
        model_kind=recipe.model.kind,
        qlora=recipe.lora.enable_qlora,
        cuda_available=torch.cuda.is_available(),
        lora=recipe.lora.enable_lora,
    )


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from finetune.recipe import load_recipe

    if args.command == "list-configs" or getattr(args, "list_configs", False):
        if overrides:
            raise FinetuneError(f"unexpected arguments: {' '.join(overrides)}")
        for name, line in list_configs():
            print(f"{name:16s} {line}")
        return 0
    # They import the heavy libraries; so does `train`'s launcher (accelerate launch imports DeepSpeed
    # when a config uses it, before train.py can quiet it): its environment gets the same settings.
    if args.command in ("chat", "merge-lora", "export-gguf", "prepare-dataset", "eval", "train"):
        from finetune.quiet import quiet_third_party

        quiet_third_party()
    if args.command == "chat":
        if overrides:
            raise FinetuneError(f"chat takes no recipe overrides, got {' '.join(overrides)}")
        from finetune.evaluation.command import run_chat

        return run_chat(
            args.model_dir,
            base=args.base,
            prompt=args.prompt,
            system=args.system,
            max_new_tokens=args.max_new_tokens,
            images=args.image,
            tools=args.tool,
            tool_close=args.tool_close,
            tool_timeout_s=args.tool_timeout,
        )
    if args.command == "checkpoints":
        if overrides:
            raise FinetuneError(f"checkpoints takes no recipe overrides, got {' '.join(overrides)}")
        return print_checkpoints(args.output_dir)
    if args.command == "report":
        if overrides:
            raise FinetuneError(f"report takes no recipe overrides, got {' '.join(overrides)}")
        if args.serve:
            return _serve_report(args)
        if args.port is not None or args.host is not None:
            raise FinetuneError("report: --port and --host are for --serve: add --serve, or leave them out")
        from finetune.report import build_report

        path = build_report(args.output_dirs, args.output)
        print(f"report of {len(args.output_dirs)} run(s) written to {path}")
        return 0
    if args.command == "merge-lora":
        if overrides:
            raise FinetuneError(f"merge-lora takes no recipe overrides, got {' '.join(overrides)}")
        from finetune.model.inference import merge_lora

        merge_lora(args.adapter_dir, args.output, base=args.base, dtype=args.dtype)
        print(f"merged model written to {args.output}")
        return 0
    if args.command == "export-gguf":
        if overrides:
            raise FinetuneError(f"export-gguf takes no recipe overrides, got {' '.join(overrides)}")
        return export_gguf_command(args)

    if getattr(args, "sequence_len", None):  # plan --sequence-len: the rows' length, packed or not
        n = str(args.sequence_len)
        overrides = [*overrides, "--data.sequence_len", n, "--data.sample_packing_sequence_len", n]
    if args.command == "eval":
        overrides = [*overrides, *lm_eval_overrides(args)]
    recipe = load_recipe(args.recipe, overrides)
    if args.command != "train":  # the training process says them itself, once
        from finetune.notices import warn
        from finetune.recipe import recipe_warnings

        for line in recipe_warnings(recipe):
            warn(line)
    if args.command == "validate":
        _print_recipe(recipe, args.explain)
        print(f"# {args.recipe}: valid", file=sys.stderr)
        return 0
    if args.command == "prepare-dataset":
        if recipe.data.streaming:
            raise FinetuneError(
                "data.streaming: true: the training rows are read, tokenized and packed while training, so there "
                "is nothing to prepare; run `finetune train`, or add --data.streaming false to prepare them"
            )
        if recipe.model.kind == "diffusion":  # images -> cached latents and text embeddings
            from finetune.diffusion.cache import prepare_images as prepare
        else:
            from finetune.data.prepare.fingerprint import cached
            from finetune.data.prepare.manifest import reusing, summary

            # A recipe already prepared is found from its fingerprint alone (file hashes), without
            # importing datasets or transformers: a cache hit costs little more than `validate`.
            found = None if (args.push or recipe.data.skip_prepare_dataset) else cached(recipe)
            if found is not None:
                path, manifest = found
                print(reusing(path))
                print(summary(manifest, "cache", path))
                return 0
            from finetune.data.prepare.build import prepare

        prepare(recipe, push=args.push)
        return 0
    if args.command == "eval":
        from finetune.evaluation.command import run_eval

        return run_eval(recipe, args)
    if args.command == "plan":
        from finetune.plan import format_plan, make_plan, plan_json

        plan = make_plan(
            recipe,
            recipe_path=args.recipe,
            accelerate_config=args.accelerate_config,
            num_gpus=args.num_gpus,
            num_nodes=args.num_nodes,
            gpu_memory=args.gpu_memory,
            images_per_row=args.images_per_row,
            patches_per_image=args.patches_per_image,
        )
        print(plan_json(plan) if args.json else format_plan(plan))
        return 0
    if args.command == "train":
        config = resolve_accelerate_config(args.accelerate_config or recipe.train.accelerate_config)
        launch = {key: getattr(args, key) for key in LAUNCH_OPTIONS}
        check_before_launch(recipe, config, launch)
        cmd = launch_command(args.recipe, overrides, config, launch, recipe.train.mixed_precision)
        env = dict(os.environ)
        if cmd[2] == "torch.distributed.run":
            env["ACCELERATE_USE_CPU"] = "true"
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        return run_supervised(cmd, env)
    raise AssertionError(args.command)


def _serve_report(args: argparse.Namespace) -> int:
    """`finetune report --serve`: the live page until Ctrl-C."""
    if args.output is not None:
        raise FinetuneError(
            "report: --output writes a file, --serve serves the page instead: give one of them"
        )
    from finetune.report.serve import DEFAULT_HOST, DEFAULT_PORT, serve_report

    port = DEFAULT_PORT if args.port is None else args.port
    return serve_report(args.output_dirs, host=args.host or DEFAULT_HOST, port=port)


def lm_eval_overrides(args: argparse.Namespace) -> list[str]:
    """`finetune eval`'s --lm-eval and --lm-eval-limit as the recipe overrides they stand for.

    >>> lm_eval_overrides(argparse.Namespace(lm_eval="gsm8k, arc_easy", lm_eval_limit=50))
    ['--eval.lm_eval.tasks', '[gsm8k, arc_easy]', '--eval.lm_eval.limit', '50']
    """
    overrides = []
    if args.lm_eval is not None:
        tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
        if not tasks:
            raise FinetuneError("--lm-eval: give lm-eval task names separated by commas, e.g. gsm8k,arc_easy")
        overrides += ["--eval.lm_eval.tasks", "[" + ", ".join(tasks) + "]"]
    if args.lm_eval_limit is not None:
        overrides += ["--eval.lm_eval.limit", str(args.lm_eval_limit)]
    return overrides


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `finetune` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train" and args.recipe is None and not args.list_configs:
        parser.error("train: the following arguments are required: recipe (or --list-configs)")
    try:
        return _run(args, extra)
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
