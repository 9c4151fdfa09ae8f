"""Tools in the loop through the real CLI, on tiny models (recipes/demo/tiny_grpo_cpu.yaml):

- GRPO with an inline tool logs its calls, errors, timeouts and seconds every step, shows the calls of
  its samples, and scores its held-out prompts with the tool; `finetune eval` does the same;
- GRPO with a chat tool, on a tiny model scripted to call it in Qwen2.5's template format: the calls
  run, the results come back as tool messages, calls past max_tool_calls are counted errors;
- a run killed with SIGKILL resumes to the same completions (tool calls included), rewards and losses;
- 2-process DDP trains on the same completions and losses as one process;
- `finetune eval` with a generation set that has a tool, and `finetune chat --tool`;
- the environment recipe (recipes/demo/tiny_grpo_env_cpu.yaml) plays its game.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._run import REPO, kill_once_saved, progress, run, short_run

pytestmark = pytest.mark.slow

GRPO_DEMO = REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml"
TOOLS_PY = '''
def shout(letter: str) -> str:
    """Shout a letter.

    Args:
        letter: the letter
    """
    print("shouting", letter)  # never reaches the run's output
    if letter == "e":
        raise ValueError("e is too quiet")
    return letter.upper() * 2
'''


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grpo_tools")
    (path / "tools.py").write_text(TOOLS_PY)
    return path


def inline(root: Path) -> list[str]:
    """An inline tool on every 'a' or 'e' the tiny model writes (often: it writes at random)."""
    spec = f"[{{function: {root / 'tools.py'}:shout, trigger: '([ae])', close: ']'}}]"
    return ["--grpo.tools", spec, "--grpo.max_tool_calls", "3"]


def command(name: str, out: Path, prepared: Path, *args: str, recipe: Path = GRPO_DEMO) -> list[str]:
    cmd = [sys.executable, "-m", "finetune.cli", name, str(recipe), *short_run(*args)]
    return [*cmd, "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]


def finetune(name: str, out: Path, prepared: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    result = run(command(name, out, prepared, *args, **kw))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def inserted(text: str, completion: str) -> bool:
    """`text` is in the completion, or the completion ends inside it: inserted results count toward
    max_new_tokens, so the budget may end within one (and no shorter prefix than a token).

    >>> inserted("AA]", "xAA] b"), inserted("error: V]", "be error: V"), inserted("AA]", "xA b")
    (True, True, False)
    """
    return text in completion or any(completion.endswith(text[:k]) for k in range(2, len(text)))


def steps_of(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in progress(out) if r.get("event") is None and "loss" in r}


@pytest.fixture(scope="module")
def trained(root) -> Path:
    """A 3-step GRPO run with the inline tool, evaluated before its first step and at its end."""
    out = root / "inline"
    made = finetune(
        "train", out, root / "prepared", *inline(root), "--train.max_steps", "3", "--train.eval_steps", "3",
        "--train.eval_on_start", "true",
    )  # fmt: skip
    assert "shouting" not in made.stdout + made.stderr
    return out


def test_grpo_with_an_inline_tool_logs_its_calls_and_scores_with_it(trained, root):
    steps = steps_of(trained)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        for key in ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "generation_seconds"):
            assert key in record, key
        assert record["tool_calls"] > 0 and record["tool_timeouts"] == 0
        assert 0 < record["tool_seconds"] < record["rollout_seconds"]
        assert record["generation_seconds"] < record["rollout_seconds"]
    assert sum(r["tool_errors"] for r in steps.values()) > 0  # every 'e' raises: an error result, no crash
    samples = [s for r in steps.values() for s in r["completions_sample"]]
    shown = [s for s in samples if "shout(['a']) -> AA" in s["tool_calls"]]
    assert shown and all(
        inserted("AA]", s["completion"]) for s in shown
    )  # the result as inserted, then close
    errors = [s for s in samples if "e is too quiet" in s["tool_calls"]]
    assert errors and all(inserted("error: ValueError: e is too quiet]", s["completion"]) for s in errors)
    # The held-out prompts are answered greedily with the tool in the loop. The random-init model writes
    # letters, so the tool fires (step 0); three steps of the demo's digits reward may already teach it to
    # write digits only, which call nothing: the trained model's count is compared, not assumed.
    start, evaluated = sorted(
        (r for r in progress(trained) if r.get("event") == "eval"), key=lambda r: r["step"]
    )
    assert (start["step"], evaluated["step"]) == (0, 3)
    assert start["eval_tool_calls"] > 0

    result = run([sys.executable, "-m", "finetune.cli", "eval", str(GRPO_DEMO), "--adapter", str(trained),
                  "--data.dataset_prepared_path", str(root / "prepared"), "--no-progress", *inline(root)])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    table = {l.split()[0]: l.split()[1:] for l in result.stdout.splitlines() if l.startswith("eval_")}  # noqa: E741
    assert float(table["eval_tool_calls"][0]) == pytest.approx(start["eval_tool_calls"], abs=1e-4)  # base
    assert float(table["eval_tool_calls"][1]) == pytest.approx(evaluated["eval_tool_calls"], abs=1e-4)


def test_sigkill_then_resume_gives_the_same_completions_tool_calls_and_losses(root):
    args = ["--train.max_steps", "6", "--train.save_steps", "3", "--train.eval_steps", "null"]
    args += ["--lora.lora_dropout", "0.1", "--grpo.num_iterations", "2", "--train.save_hf_weights", "false"]
    args += [*inline(root), "--grpo.max_new_tokens", "24"]
    prepared = root / "prepared"
    reference = root / "reference"
    finetune("train", reference, prepared, *args)
    expected = steps_of(reference)
    out = root / "killed"
    kill_once_saved(command("train", out, prepared, *args), out, 3)
    assert 3 <= max(steps_of(out)) < 6
    finetune("train", out, prepared, *args, "--train.load_checkpoint_path", "auto")
    after = steps_of(out)
    assert sorted(after) == list(range(1, 7))
    for step, want in expected.items():
        got = after[step]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
        if "reward" in want:
            assert got["reward"] == pytest.approx(want["reward"], abs=1e-6), step
            assert got["tool_calls"] == want["tool_calls"] and got["tool_errors"] == want["tool_errors"], step
            assert [(s["completion"], s["tool_calls"]) for s in got["completions_sample"]] == [
                (s["completion"], s["tool_calls"]) for s in want["completions_sample"]
            ], step


def test_two_process_ddp_with_a_tool_equals_one_process(root):
    args = [
        "--train.max_steps",
        "2",
        "--train.eval_steps",
        "null",
        "--train.save_hf_weights",
        "false",
        *inline(root),
    ]
    ddp, single = root / "ddp", root / "single"
    finetune("train", ddp, root / "prepared", "--accelerate-config", "multi_cpu", *args,
             "--train.gradient_accumulation_steps", "1")  # fmt: skip
    finetune("train", single, root / "prepared", *args, "--train.gradient_accumulation_steps", "2")
    two, one = steps_of(ddp), steps_of(single)
    assert sorted(two) == sorted(one) == [1, 2]
    for step in one:
        for key in ("reward", "completion_length", "tool_calls", "tool_errors", "loss"):
            assert two[step][key] == pytest.approx(one[step][key], abs=1e-6), (step, key)
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step


def test_finetune_eval_and_chat_call_the_tools(trained, root):
    tool = f"{root / 'tools.py'}:shout"
    sets = (f"[{{name: shouts, path: recipes/demo/data/prompts.jsonl, field_prompt: question, field_expected: answer, "
            f"num_rows: 4, max_new_tokens: 12, num_samples: 4, tools: [{{function: {tool}, trigger: '([ae])', close: ']'}}]}}]")  # fmt: skip
    out = root / "eval.json"
    result = run([sys.executable, "-m", "finetune.cli", "eval", str(GRPO_DEMO), "--adapter", str(trained),
                  "--data.dataset_prepared_path", str(root / "prepared"), "--no-progress",
                  "--eval.generation_sets", sets, "--output", str(out)])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "    tools: shout(" in result.stdout
    results = json.loads(out.read_text())["results"]
    # base and tuned both generate with the tool (which of them writes an 'a' or 'e' greedily depends on
    # the random tiny model): every sample lists its calls, and some made calls
    samples = [s for model in ("base", "tuned") for s in results[model]["generation"]["shouts"]["samples"]]
    assert all("tool_calls" in s for s in samples) and any(s["tool_calls"] for s in samples)
    assert "shouting" not in result.stdout + result.stderr

    # any lowercase letter calls it: the tuned tiny model may write no 'a' or 'e' (it collapses to 'un...')
    chat = run([sys.executable, "-m", "finetune.cli", "chat", str(trained), "--prompt", "What is 2 + 3?",
                "--tool", f"{tool}:([a-z])", "--tool-close", "]", "--max-new-tokens", "16"])  # fmt: skip
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "[tool] shout(['" in chat.stdout and "shouting" not in chat.stdout + chat.stderr
    bad = run([sys.executable, "-m", "finetune.cli", "chat", str(trained), "--prompt", "Hi",
               "--tool", f"{root / 'tools.py'}:whisper:(a)"])  # fmt: skip
    assert bad.returncode != 0 and "defines no 'whisper'" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------ chat tools

CALL = '<tool_call>\n{"name": "shout", "arguments": {"letter": "a"}}\n</tool_call>'


def scripted_caller(folder: Path) -> Path:
    """A tiny Llama (saved with its tokenizer: the demo's, Qwen2.5's tool template, the whole call as one
    added token) that answers every assistant turn with the call: its attention and MLPs output nothing,
    and its head maps the turn's first token to the call and the call to the end of turn."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.tiny import tiny_model

    tok = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    tok.chat_template = (REPO / "tests/unit/data/templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    tok.add_tokens([AddedToken(CALL, normalized=False, special=False)])
    model = tiny_model(vocab_size=len(tok), hidden_size=128, intermediate_size=64, max_position_embeddings=1024,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    start = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    turn_start = tok(start, add_special_tokens=False)["input_ids"][-1]
    call, end = tok.convert_tokens_to_ids(CALL), tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        hidden = model.model.norm(model.model.embed_tokens.weight)
        for current, nxt in ((turn_start, call), (call, end)):
            model.lm_head.weight[nxt] += hidden[current] / hidden[current].norm() * 20
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_grpo_with_a_chat_tool_runs_the_templates_calls(root):
    model = scripted_caller(root / "caller")
    out = root / "chat_tool"
    args = ["--model.config_path", "null", "--model.tokenizer_path", "null", "--model.model_path", str(model),
            "--lora.modules_to_save", "[]", "--grpo.tools", f"[{{function: {root / 'tools.py'}:shout}}]",
            "--grpo.max_tool_calls", "2", "--grpo.max_new_tokens", "100", "--train.max_steps", "2"]  # fmt: skip
    finetune("train", out, root / "prepared_chat", *args)
    steps = steps_of(out)
    for record in steps.values():
        # Each completion calls until its budget ends: 2 calls run, every later one is an error result.
        assert record["tool_calls"] > 2 and record["tool_errors"] > 0 and record["clipped_ratio"] == 1.0
        sample = record["completions_sample"][0]
        assert sample["tool_calls"].startswith("shout({'letter': 'a'}) -> AA; shout({'letter': 'a'}) -> AA; ")
        assert "<tool_response>\nAA\n</tool_response>" in sample["completion"]
        assert "What is" in sample["prompt"] and "shout" in sample["prompt"]  # the schema is in the prompt
        assert record["loss"] == record["loss"]


def test_the_environment_recipe_plays_its_game(root):
    recipe = REPO / "recipes" / "demo" / "tiny_grpo_env_cpu.yaml"
    out = root / "env"
    finetune(
        "train",
        out,
        root / "prepared_env",
        "--train.max_steps",
        "2",
        "--train.eval_steps",
        "2",
        recipe=recipe,
    )
    steps = steps_of(out)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert "reward/environment" in record and "tool_calls" in record
        assert all(s["prompt"].startswith("user\nGuess my number") for s in record["completions_sample"])
    (evaluated,) = [r for r in progress(out) if r.get("event") == "eval"]
    assert "eval_reward/environment" in evaluated
