"""Standard benchmarks in `finetune eval` (finetune.evaluation.harness): lm-evaluation-harness run on the
model object finetune already loaded, on tiny lm-eval tasks defined on local files (tiny random Llama
from a config, the demo tokenizer: nothing is downloaded). The numbers are compared with what
`lm_eval.simple_evaluate` itself computes on the same model object, so the wiring is checked, not a copy;
a built-in task whose data is not local fails at once, offline, naming the task. simple_evaluate
launches subprocesses (git, pip), so the tests that run it are `slow`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from finetune.errors import FinetuneError
from finetune.evaluation.compare import evaluate_models, format_table
from finetune.evaluation.harness import (
    HarnessSettings,
    check_tasks,
    import_harness,
    run_harness,
    task_manager,
)
from tests.tiny import tiny_model

lm_eval = pytest.importorskip("lm_eval", reason="pip install 'finetune[eval]'")

# lm_eval.simple_evaluate runs `git describe` and `pip list` in subprocesses (the environment it records
# beside the numbers), so every test that runs it is in the slow tier (tests/tiers.py).
SIMPLE_EVALUATE = pytest.mark.slow

TOKENIZER = Path(__file__).resolve().parents[3] / "recipes" / "demo" / "tokenizer"
ROWS = [
    {
        "question": f"What is {a} plus {b}?",
        "choices": [str(a + b), str(a + b + 1), str(a * b)],
        "label": k % 3,
    }
    for k, (a, b) in enumerate([(2, 3), (4, 1), (7, 2), (5, 5), (1, 8), (3, 6), (9, 1), (6, 2)])
]

CHOICE_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GENERATE_TASK = """task: tiny_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[0]}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 4
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A folder of two lm-eval task YAMLs on a local jsonl file: one scored by log-likelihoods, one by
    greedy generation."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "tiny_choice.yaml").write_text(CHOICE_TASK.format(rows=rows))
    (folder / "tiny_answer.yaml").write_text(GENERATE_TASK.format(rows=rows))
    return folder


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    return tiny_model(vocab_size=len(tokenizer), initializer_range=0.5).eval(), tokenizer


@SIMPLE_EVALUATE
def test_numbers_are_lm_evals_own_on_the_same_model(tasks, model_and_tokenizer):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = model_and_tokenizer
    settings = HarnessSettings(
        tasks=("tiny_choice", "tiny_answer"),
        include_path=(str(tasks),),
        limit=6,
        batch_size=4,
        bootstrap_iters=10,
    )
    ours = run_harness(model, tokenizer, settings, *check_tasks(settings))
    theirs = lm_eval.simple_evaluate(
        HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device="cpu"),
        tasks=["tiny_choice", "tiny_answer"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        limit=6,
        bootstrap_iters=10,
        log_samples=False,
    )["results"]
    choice = ours["tasks"]["tiny_choice"]
    assert choice["n"] == 6 and set(choice["metrics"]) == {"acc,none", "acc_norm,none"}
    for task in ("tiny_choice", "tiny_answer"):
        for key, metric in ours["tasks"][task]["metrics"].items():
            name, filt = key.split(",")
            assert metric["value"] == theirs[task][key]
            assert metric["stderr"] == theirs[task][f"{name}_stderr,{filt}"]
    assert choice["metrics"]["acc,none"]["stderr"] > 0  # a mean's stderr is closed-form: it is there
    assert 0 < choice["metrics"]["acc,none"]["value"] < 1  # a number that can tell a wrong wiring


@SIMPLE_EVALUATE
def test_base_and_tuned_side_by_side_in_the_table(tasks, model_and_tokenizer):
    import torch

    model, tokenizer = model_and_tokenizer
    tuned = tiny_model(vocab_size=len(tokenizer), initializer_range=0.5).eval()
    with torch.no_grad():
        tuned.lm_head.weight.mul_(-1.0)  # a different model: other log-likelihoods, other answers
    settings = HarnessSettings(
        tasks=("tiny_choice",), include_path=(str(tasks),), batch_size=8, bootstrap_iters=10
    )
    manager, specs = check_tasks(settings)
    results = evaluate_models(
        {"base": lambda: (model, tokenizer), "tuned": lambda: (tuned, tokenizer)},
        eval_batches=None,
        sets=[],
        batch_size=8,
        progress=False,
        say=lambda _: None,
        harness=lambda m, t: run_harness(m, t, settings, manager, specs),
    )
    base_acc = results["base"]["lm_eval"]["tasks"]["tiny_choice"]["metrics"]["acc,none"]
    tuned_acc = results["tuned"]["lm_eval"]["tasks"]["tiny_choice"]["metrics"]["acc,none"]
    row = next(
        line for line in format_table(results).splitlines() if line.startswith("lm-eval tiny_choice acc ")
    )
    assert "(n=8)" in row
    assert f"{base_acc['value']:.4f} ± {base_acc['stderr']:.4f}" in row
    assert f"{tuned_acc['value']:.4f} ± {tuned_acc['stderr']:.4f}" in row


@SIMPLE_EVALUATE
def test_a_builtin_task_pointed_at_local_files_runs_offline(tmp_path, model_and_tokenizer):
    rows = tmp_path / "gsm8k_rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"question": f"{a} + 1?", "answer": f"{a} + 1 = {a + 1}\n#### {a + 1}"}) + "\n"
            for a in range(5)
        )
    )
    settings = HarnessSettings(
        tasks=("gsm8k",),
        data_files={"gsm8k": {"test": str(rows), "train": str(rows)}},
        limit=2,
        num_fewshot=1,
        max_gen_toks=16,
    )
    manager = task_manager(settings)
    _, tokenizer = model_and_tokenizer
    # 128 positions: lm-eval refuses gsm8k's default of 256 new tokens on this model, so the task runs
    # only if max_gen_toks reaches lm-eval.
    model = tiny_model(vocab_size=len(tokenizer), initializer_range=0.5).eval()
    result = run_harness(model, tokenizer, settings, *check_tasks(settings, manager))["tasks"]["gsm8k"]
    assert result["n"] == 2 and result["n_shot"] == 1
    assert set(result["metrics"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}

    # The same built-in task without local files: its Hub dataset cannot be read offline. One error,
    # naming the task and how to point it at local files, before any model would load, with no retries.
    started = time.perf_counter()
    with pytest.raises(FinetuneError) as caught:
        check_tasks(HarnessSettings(tasks=("gsm8k",)), manager)
    assert time.perf_counter() - started < 10  # huggingface_hub's five retries would take ~25 s
    message = str(caught.value)
    assert message.startswith("lm-eval task gsm8k: its data could not be loaded")
    assert "eval.lm_eval.data_files.gsm8k: {test: FILE.jsonl, train: FILE.jsonl}" in message
    assert "(the splits it reads: test_split test, training_split train)" in message
    assert "eval.lm_eval.include_path" in message and "eval.lm_eval.download: true" in message


@pytest.mark.slow  # a name not in include_path is looked up in lm-eval's whole index: ~15 s on 2 cores
def test_an_unknown_task_is_named(tasks):
    with pytest.raises(FinetuneError, match="no_such_task is no lm-eval task"):
        task_manager(HarnessSettings(tasks=("no_such_task",), include_path=(str(tasks),)))


def test_missing_folders_and_files_are_named(tasks):
    with pytest.raises(FinetuneError, match=r"include_path: .*missing is not a folder"):
        task_manager(HarnessSettings(tasks=("tiny_choice",), include_path=(str(tasks / "missing"),)))
    settings = HarnessSettings(
        tasks=("tiny_choice",),
        include_path=(str(tasks),),
        data_files={"tiny_choice": {"test": "nowhere.jsonl"}},
    )
    with pytest.raises(FinetuneError, match=r"data_files.tiny_choice.test: nowhere.jsonl is not a file"):
        check_tasks(settings)


def test_a_missing_extra_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(FinetuneError, match=r"pip install 'finetune\[eval\]'"):
        import_harness()


@SIMPLE_EVALUATE
def test_finetune_eval_with_lm_eval_writes_both_models_to_eval_json(tasks, tmp_path, monkeypatch, capsys):
    import yaml
    from transformers import AutoTokenizer

    from finetune.cli import main
    from tests.tiny import save_tiny_lora_run

    repo = TOKENIZER.parents[2]
    demo = repo / "recipes" / "demo" / "tiny_sft_cpu.yaml"
    config = {
        k: v for k, v in yaml.safe_load(demo.read_text())["model"]["config_path"].items() if k != "model_type"
    }
    run = save_tiny_lora_run(tmp_path / "run", AutoTokenizer.from_pretrained(TOKENIZER), config=config)
    monkeypatch.chdir(repo)
    argv = ["eval", str(demo), "--adapter", str(run), "--lm-eval", "tiny_choice", "--lm-eval-limit", "5",
            "--eval.lm_eval.include_path", f"[{tasks}]", "--eval.lm_eval.bootstrap_iters", "10",
            "--data.val_set_size", "null", "--eval.generation_sets", "[]", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((run / "eval.json").read_text())["results"]
    assert set(report) == {"base", "tuned"}
    for name in ("base", "tuned"):
        task = report[name]["lm_eval"]["tasks"]["tiny_choice"]
        assert task["n"] == 5 and set(task["metrics"]) == {"acc,none", "acc_norm,none"}
    assert "lm-eval tiny_choice acc (n=5)" in capsys.readouterr().out
