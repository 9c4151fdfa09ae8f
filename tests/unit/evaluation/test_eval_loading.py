"""What `finetune eval`, `chat` and `merge-lora` refuse, with exit 2 and before evaluating anything: a
missing, empty or damaged adapter folder, a training checkpoint, a bad --max-new-tokens, an adapter
trained from another base than the recipe's; and eval loads every model before it evaluates one.

The commands run in-process through finetune.cli.main (an exception it did not turn into exit 2 would
fail the test); tests/integration/test_eval_chat.py runs a few as subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import weakref
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file
from transformers import AutoTokenizer

from finetune.cli import main
from finetune.errors import FinetuneError
from finetune.evaluation.compare import evaluate_models
from finetune.evaluation.fit import check_fits_recipe
from finetune.model.build import load_tokenizer
from finetune.model.inference import merge_lora
from finetune.recipe import load_recipe
from tests.tiny import save_tiny_base, save_tiny_lora_run, tiny_model

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "recipes" / "demo" / "tiny_sft_cpu.yaml"
# The demo recipe's inline model: an adapter trained from it fits the demo recipe.
DEMO_CONFIG = {
    k: v for k, v in yaml.safe_load(DEMO.read_text())["model"]["config_path"].items() if k != "model_type"
}

FOREIGN_VOCAB = 285


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """demo: a LoRA run of the demo recipe's random-init model; foreign_base: a pretrained model with
    another tokenizer (FOREIGN_VOCAB tokens) and architecture; foreign: a LoRA run from it (foreign_bare: the
    same adapter without the run's recipe.resolved.yaml)."""
    spec = importlib.util.spec_from_file_location(
        "make_demo_data", REPO / "recipes" / "demo" / "make_demo_data.py"
    )
    make_demo_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_demo_data)
    texts = [f"question {k}: what is {k} plus {k + 1}? answer {2 * k + 1}" for k in range(200)]
    foreign_tokenizer = make_demo_data.train_tokenizer(texts, vocab_size=300)
    assert len(foreign_tokenizer) == FOREIGN_VOCAB  # what the BPE trainer learns from these texts
    demo_tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    root = tmp_path_factory.mktemp("runs")
    save_tiny_base(root / "foreign_base", foreign_tokenizer)
    return {
        "demo": save_tiny_lora_run(root / "demo", demo_tokenizer, config=DEMO_CONFIG),
        "foreign_base": root / "foreign_base",
        "foreign": save_tiny_lora_run(root / "foreign", foreign_tokenizer, base=root / "foreign_base"),
        "foreign_bare": save_tiny_lora_run(
            root / "foreign_bare", foreign_tokenizer, base=root / "foreign_base", record=False
        ),
    }


def _checkpoint(run: Path, tmp: Path) -> Path:
    """A copy of `run` with a checkpoint as training writes one (checkpoints/step-2), which is returned."""
    shutil.copytree(run, tmp / "run")
    step = tmp / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text(json.dumps({"step": 2}))
    save_file({"w": tiny_model().lm_head.weight.detach()}, str(step / "trainable_0.safetensors"))
    return step


def _damage(run: Path, tmp: Path, case: str) -> Path:
    """The folder of `case`: missing, empty, a checkpoint, or a copy of `run` damaged as `case` says."""
    if case == "missing":
        return tmp / "nowhere"
    if case == "empty":
        (tmp / "empty").mkdir()
        return tmp / "empty"
    if case == "checkpoint":
        return _checkpoint(run, tmp)
    adapter = Path(shutil.copytree(run, tmp / "adapter"))
    weights, config_file = adapter / "adapter_model.safetensors", adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    if case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "random-bytes":
        weights.write_bytes(os.urandom(4096))
    elif case == "no-weights":
        weights.unlink()
    elif case == "bad-json":
        config_file.write_text('{"r": 2,')
    else:  # a field PEFT does not take
        field, value = {"rank-not-a-number": ("r", "two"), "unknown-peft-type": ("peft_type", "FOO")}.get(
            case, ("r", -1)
        )
        config_file.write_text(json.dumps({**config, field: value}))
    return adapter


BROKEN = {
    "missing": r"nowhere does not exist: point at a .*train.output_dir",
    "empty": r"empty is an empty folder: neither an adapter \(adapter_config.json\) nor a model",
    "checkpoint": r"step-2 is a training checkpoint .*point at the run's output folder .*run, which holds",
    "truncated": r"adapter_model.safetensors: not a readable safetensors file .*truncated or damaged",
    "random-bytes": r"adapter_model.safetensors: not a readable safetensors file .*truncated or damaged",
    "no-weights": r"holds adapter_config.json but no adapter weights \(adapter_model.safetensors",
    "bad-json": r"adapter_config.json: not valid JSON \(line 1, column 9",
    "rank-not-a-number": r"adapter_config.json: r is 'two', not int",
    "unknown-peft-type": r"adapter_config.json: peft_type 'FOO' is no adapter type PEFT knows",
    "negative-rank": r"PEFT cannot load the adapter onto the base model .*`r` should be a positive integer",
}


def _eval(*args: str, tmp: Path) -> list[str]:
    """`finetune eval` of the demo recipe writing into `tmp`, scoring one generation set (no eval split:
    nothing to prepare), with `args`."""
    questions = tmp / "q.jsonl"
    questions.write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "#### 5"}) + "\n")
    gen_sets = (
        f"[{{name: q, path: {questions}, field_prompt: question, field_expected: answer, max_new_tokens: 2}}]"
    )
    return [
        "eval", str(DEMO), "--no-progress", *args, "--train.output_dir", str(tmp / "out"),
        "--data.dataset_prepared_path", str(tmp / "prepared"), "--data.val_set_size", "null",
        "--eval.generation_sets", gen_sets,
    ]  # fmt: skip


@pytest.mark.parametrize("command", ["eval", "chat"])
@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_adapter_folder_is_an_error_before_anything_is_evaluated(
    runs, tmp_path, case, command, capsys, monkeypatch
):
    monkeypatch.chdir(REPO)
    folder = _damage(runs["demo"], tmp_path, case)
    argv = (
        _eval("--adapter", str(folder), tmp=tmp_path)
        if command == "eval"
        else ["chat", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") or "\nerror: " in err
    assert re.search(BROKEN[case], err), err
    assert "evaluating" not in err and not (folder / "eval.json").exists()


@pytest.mark.parametrize("case", ["missing", "checkpoint", "truncated"])
def test_merge_lora_refuses_a_broken_adapter_folder(runs, tmp_path, case, capsys):
    folder = _damage(runs["demo"], tmp_path, case)
    assert main(["merge-lora", str(folder), "--output", str(tmp_path / "merged")]) == 2
    assert re.search(BROKEN[case], capsys.readouterr().err)
    assert not (tmp_path / "merged").exists()


def test_a_checkpoint_of_an_unfinished_run_says_to_resume_it(runs, tmp_path, capsys):
    step = _checkpoint(runs["demo"], tmp_path)
    (tmp_path / "run" / "adapter_config.json").unlink()  # no final adapter yet
    assert main(["chat", str(step), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"writes its final adapter or model to {tmp_path / 'run'} when training ends" in err
    assert f"--train.load_checkpoint_path {step}" in err


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "0 is not above 0"), ("-3", "-3 is not above 0"), ("x", "'x' is not a whole number")],
)
def test_max_new_tokens_must_be_above_zero(runs, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", str(runs["demo"]), "--prompt", "hi", "--max-new-tokens", value])
    assert exit_info.value.code == 2
    assert f"argument --max-new-tokens: {message}" in capsys.readouterr().err


def test_eval_of_a_missing_adapter_folder_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(_eval("--adapter", str(tmp_path / "nowhere"), tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"--adapter {tmp_path / 'nowhere'} does not exist" in err and "pass --adapter" not in err


# ----------------------------------------------------------------------- an adapter of another base


def _eval_with_split(*args: str, tmp: Path) -> list[str]:
    """`finetune eval` of the demo recipe with its eval split (which must not be prepared)."""
    return [
        "eval", str(DEMO), "--no-progress", *args, "--train.output_dir", str(tmp / "out"),
        "--data.dataset_prepared_path", str(tmp / "prepared"),
    ]  # fmt: skip


@pytest.mark.parametrize("adapter", ["foreign", "foreign_bare"])
def test_eval_refuses_a_pretrained_models_adapter_on_a_random_init_recipe(
    runs, tmp_path, adapter, capsys, monkeypatch
):
    """The issue's case: an adapter of a pretrained model evaluated with the demo recipe printed a
    plausible table (the eval split tokenized with the wrong tokenizer) and overwrote its eval.json."""
    monkeypatch.chdir(REPO)
    assert main(_eval_with_split("--adapter", str(runs[adapter]), tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"--adapter {runs[adapter]} is not of this recipe's base model" in err
    assert "The recipe's base is a random-init model from model.config_path" in err
    assert f"the adapter's is {runs['foreign_base']}" in err
    assert "its architecture differs: hidden_size 64 (the recipe's: 128)" in err
    assert (
        f"its tokenizer has another vocabulary ({FOREIGN_VOCAB} tokens) than the recipe's (704 tokens" in err
    )
    if adapter == "foreign":
        assert "the run was trained from another base model" in err and "recipe.resolved.yaml" in err
    assert not (runs[adapter] / "eval.json").exists() and not (tmp_path / "prepared").exists()


def test_eval_refuses_a_random_init_adapter_on_a_pretrained_recipe(runs, tmp_path, capsys, monkeypatch):
    """The reverse: it crashed with an IndexError after the base's whole evaluation."""
    monkeypatch.chdir(REPO)
    recipe = (
        "--model.model_path",
        str(runs["foreign_base"]),
        "--model.config_path",
        "null",
        "--model.tokenizer_path",
        "null",
    )
    assert main(_eval_with_split("--adapter", str(runs["demo"]), *recipe, tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"The recipe's base is {runs['foreign_base']}; the adapter's is a random-init model" in err
    assert (
        "the run was trained from another base model" in err
        and f"(704 tokens) than the recipe's ({FOREIGN_VOCAB} tokens" in err
    )
    assert not (runs["demo"] / "eval.json").exists() and not (tmp_path / "prepared").exists()


def test_eval_refuses_a_random_init_adapter_of_another_inline_config(runs, tmp_path, capsys, monkeypatch):
    """Both random-init, one tokenizer, but the recipe's config is not the run's: another model."""
    monkeypatch.chdir(REPO)
    args = _eval_with_split(
        "--adapter", str(runs["demo"]), "--model.config_path.vocab_size", "800", tmp=tmp_path
    )
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "the run's random-init model had another model.config_path (vocab_size 704 (the recipe's: 800))"
        in err
    )
    assert not (runs["demo"] / "eval.json").exists() and not (tmp_path / "prepared").exists()


def test_an_adapter_of_the_recipes_base_fits(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    demo = load_recipe(str(DEMO), [])
    check_fits_recipe(str(runs["demo"]), demo.model, load_tokenizer(demo.model), flag="--adapter")
    merge_lora(str(runs["demo"]), str(tmp_path / "merged"))  # a full model, with the run's recipe
    check_fits_recipe(str(tmp_path / "merged"), demo.model, load_tokenizer(demo.model), flag="--model")
    pretrained = load_recipe(
        str(DEMO),
        [
            "--model.model_path",
            str(runs["foreign_base"]),
            "--model.config_path",
            "null",
            "--model.tokenizer_path",
            "null",
        ],
    )
    for name in ("foreign", "foreign_bare"):
        check_fits_recipe(
            str(runs[name]), pretrained.model, load_tokenizer(pretrained.model), flag="--adapter"
        )


def test_chat_refuses_a_base_with_another_vocabulary(runs, capsys):
    assert main(["chat", str(runs["demo"]), "--base", str(runs["foreign_base"]), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"--base {runs['foreign_base']} is not the base of {runs['demo']}" in err


# ----------------------------------------------------------- one model in memory at a time, base first


def test_models_load_evaluate_and_free_one_at_a_time():
    alive: list[weakref.ref] = []  # every model a loader gave, to see which are still referenced
    events: list[str] = []

    def loader(name: str):
        def load():
            assert [ref for ref in alive if ref() is not None] == [], f"a model is alive when {name} loads"
            model = tiny_model()
            alive.append(weakref.ref(model))
            events.append(f"load {name}")
            return model, name

        return load

    def batches(tokenizer):
        events.append(f"evaluate {tokenizer}")
        return []

    def fails():
        raise FinetuneError("broken: does not load")

    models = {"base": loader("base"), "sft": loader("sft"), "grpo": loader("grpo")}
    results = evaluate_models(models, eval_batches=batches, sets=[], batch_size=1, say=lambda _: None)
    # The tuned models are loaded once first (a broken one fails before any evaluation), then each
    # loads again for its turn.
    checked = ["load sft", "load grpo"]
    assert events == checked + [f"{step} {name}" for name in models for step in ("load", "evaluate")]
    assert all(ref() is None for ref in alive)  # the last one is freed too
    assert list(results) == list(models)
    assert all(set(r) == {"eval_loss", "eval_ppl", "eval_tokens", "generation"} for r in results.values())
    events.clear()
    with pytest.raises(FinetuneError, match="broken: does not load"):
        evaluate_models({**models, "broken": fails}, eval_batches=batches, sets=[], batch_size=1, say=print)
    assert not [e for e in events if e.startswith("evaluate")]  # it failed before any evaluation


def test_eval_refuses_an_adapter_whose_base_is_gone(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    adapter = Path(shutil.copytree(runs["demo"], tmp_path / "adapter"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    gone = tmp_path / "gone"  # where the base was when the adapter was trained
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(gone)}))
    assert main(_eval_with_split("--adapter", str(adapter), tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"--adapter {adapter}: no model config loads from {gone}" in err
    assert not (tmp_path / "prepared").exists()


def test_a_model_folder_under_a_folder_named_checkpoints_is_no_checkpoint(runs, tmp_path, capsys):
    """Only checkpoints/step-N (or a folder with train_state.json) is a training checkpoint."""
    kept = Path(shutil.copytree(runs["demo"], tmp_path / "checkpoints" / "my-adapter"))
    assert main(["chat", str(kept), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.strip()


def test_eval_refuses_a_full_model_of_another_base(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    model = str(runs["foreign_base"])
    assert main(_eval_with_split("--model", model, "--no-base", tmp=tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"--model {model} is not of this recipe's base model: its architecture differs" in err
    assert f"the model's is {model} (its config.json)" in err and not (tmp_path / "prepared").exists()
