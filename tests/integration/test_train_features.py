"""Training-loop features end to end (finetune/train.py's main on the demo recipe), plus the loop's small
pure helpers and early errors.

One-process runs call the training entry point in this process (tests/inprocess.py: the fast tier);
each run groups several checks. The 2-process run (torchrun) and the compiled model (inductor's
compile workers) are subprocesses, in the slow tier.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.errors import FinetuneError
from tests import inprocess
from tests.integration._run import DEMO, REPO, demo_overrides, env, progress, step_losses

slow = pytest.mark.slow
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _split(text: str) -> list[str]:
    """Overrides written as one string (no value holds a space)."""
    return text.split()


COMMON = _split(
    "--train.log_format structured --train.log_steps 1 --train.save_epochs 0 "
    "--train.eval_steps null --train.save_total_limit null"
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One dataset cache for the module: runs with the same data settings prepare it once."""
    return tmp_path_factory.mktemp("prepared")


def train(tmp_path: Path, prepared: Path, *extra: str) -> subprocess.CompletedProcess:
    """finetune/train.py on the demo, in this process (tests/inprocess.py)."""
    overrides = [*demo_overrides(tmp_path, *COMMON, *extra), "--data.dataset_prepared_path", str(prepared)]
    return inprocess.train(DEMO, *overrides)


def train_ok(tmp_path: Path, prepared: Path, overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`train` with `overrides` (one string, see _split) that must exit 0: its result and output folder."""
    result = train(tmp_path, prepared, *_split(overrides))
    assert result.returncode == 0, result.stderr[-4000:]
    return result, tmp_path / "out"


def steps(records: list[dict]) -> dict[int, dict]:
    """The step records (not events) by step."""
    return {r["step"]: r for r in records if r.get("event") is None}


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's trained tensors: a LoRA checkpoint holds only those (trainable_0.safetensors),
    a full fine-tune the whole model."""
    trainable = checkpoint / "trainable_0.safetensors"
    return load_file(trainable if trainable.is_file() else checkpoint / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ one-process runs


def test_skip_profile_sgd_linear_schedule_unpacked_data_and_eval(tmp_path, prepared):
    lr, lr_min, total, warmup = 0.3, 0.03, 6, 2
    overrides = (
        f"--train.max_steps {total} --train.iterations_to_skip [3,4] --train.save_steps 2 "
        "--train.enable_profiling true --train.profile_start_step 1 --train.profile_end_step 2 "
        f"--train.optimizer sgd --train.lr {lr} --train.lr_min {lr_min} --train.lr_warmup_ratio 0.34 "
        "--train.lr_decay_style linear --data.sample_packing false --data.eval_sample_packing false "
        "--train.eval_steps 2"
    )
    _, out = train_ok(tmp_path, prepared, overrides)
    records = progress(out)
    by_step = steps(records)
    assert sorted(by_step) == list(range(1, total + 1))

    # iterations_to_skip: logged, no loss, and the weights do not move across them.
    assert [r["step"] for r in records if r.get("event") == "skipped_iteration"] == [3, 4]
    assert by_step[3]["loss"] is None and by_step[4]["loss"] is None
    assert all(math.isfinite(by_step[s]["loss"]) for s in (1, 2, 5, 6))
    ckpt = out / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-2", "step-4", "step-6"]
    assert same_weights(weights(ckpt / "step-2"), weights(ckpt / "step-4"))
    assert not same_weights(weights(ckpt / "step-4"), weights(ckpt / "step-6"))
    assert json.loads((ckpt / "step-6" / "train_state.json").read_text())["state"]["skipped_iterations"] == 2

    # The LR each step used: linear warmup over 2 steps, then linear decay towards lr_min (reached
    # after the last step), skipped steps included.
    def expected_lr(step: int) -> float:
        k = step - 1
        return (
            lr * k / warmup if k < warmup else lr_min + (lr - lr_min) * (1 - (k - warmup) / (total - warmup))
        )

    for step, record in by_step.items():
        assert record["lr"] == pytest.approx(expected_lr(step)), step

    # Profiler window -> a Chrome trace under output_dir/trace.
    trace = json.loads((out / "trace" / "trace_rank0.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])

    # Unpacked data: one example per row, padded with an attention mask.
    manifests = [json.loads(p.read_text()) for p in prepared.glob("*/manifest.json")]
    unpacked = [m for m in manifests if not m["splits"]["train"]["packed"]]
    assert (
        len(unpacked) == 1
        and unpacked[0]["splits"]["train"]["rows"] == unpacked[0]["splits"]["train"]["examples"]
    )
    assert by_step[1]["tokens_per_sec"] > 0

    # Eval every 2 steps, the last one not repeated at the end; every eval token counted once.
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6]
    eval_trainable = unpacked[0]["splits"]["eval"]["num_trainable_tokens"]
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]))
        assert r["eval_tokens"] == eval_trainable
    assert evals[0]["eval_loss"] == pytest.approx(evals[1]["eval_loss"])  # nothing trained in steps 3-4
    assert evals[2]["eval_loss"] < evals[1]["eval_loss"]


@slow  # two processes (torchrun)
def test_two_process_eval_counts_every_eval_token_once(tmp_path, prepared):
    """17 packed eval rows on 2 processes: the sampler pads one duplicate row, which
    gather_for_metrics must drop (a plain gather would count its tokens twice)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "finetune" / "train.py"),
        str(DEMO),
        *demo_overrides(
            tmp_path,
            *COMMON,
            *_split("--train.max_steps 2 --train.eval_steps 2 --train.save_hf_weights false"),
        ),
        "--data.dataset_prepared_path",
        str(prepared),
    ]
    result = subprocess.run(
        cmd, cwd=REPO, env={**env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    manifest = next(
        m
        for m in (json.loads(p.read_text()) for p in prepared.glob("*/manifest.json"))
        if m["splits"]["eval"]["packed"]
    )
    assert manifest["splits"]["eval"]["rows"] % 2 == 1  # uneven: the duplicate exists
    records = progress(tmp_path / "out")
    by_step = steps(records)
    assert by_step[2]["tokens_per_sec_total"] == pytest.approx(2 * by_step[2]["tokens_per_sec"])
    evals = [r for r in records if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [2]  # logged once, by the main process
    assert evals[0]["eval_tokens"] == manifest["splits"]["eval"]["num_trainable_tokens"]
    assert evals[0]["eval_ppl"] == pytest.approx(math.exp(evals[0]["eval_loss"]))


def test_nonfinite_losses_abort_with_a_checkpoint_of_the_last_good_state(tmp_path, prepared):
    # SGD with an absurd LR: step 1 is finite but blows the weights up, so later losses overflow.
    result = train(
        tmp_path,
        prepared,
        *_split(
            "--train.max_steps 8 --train.optimizer sgd --train.lr 1e30 "
            "--train.lr_decay_style constant --train.lr_warmup_ratio 0 --train.save_steps 1 "
            "--train.max_consecutive_nonfinite 2"
        ),
    )
    assert result.returncode == 2, result.stderr[-4000:]
    assert "error: 2 nonfinite steps in a row (a loss or gradient that is inf or NaN; limit " in result.stderr
    assert "train.max_consecutive_nonfinite=2)" in result.stderr
    assert "last good state" in result.stderr and "Traceback" not in result.stderr
    out = tmp_path / "out"
    records = progress(out)
    assert math.isfinite(step_losses(records)[1])
    assert [(r["step"], r["in_a_row"]) for r in records if r.get("event") == "nonfinite_loss"] == [
        (2, 1),
        (3, 2),
    ]
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-3"
    state = json.loads((ckpt / "step-3" / "train_state.json").read_text())["state"]
    assert state["step"] == 3 and state["nonfinite_steps"] == 2
    last_good = weights(ckpt / "step-1")
    saved = weights(ckpt / "step-3")
    assert same_weights(saved, last_good)  # nonfinite steps never touched the weights
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert not (out / "adapter_model.safetensors").exists()


def test_epochs_fractional_saves_limit_special_tokens_checkpointing_adamw_8bit(tmp_path, prepared):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    optimizer = "adamw_8bit" if HAS_BNB else "adamw"  # the other checks run without bitsandbytes too
    _, out = train_ok(
        tmp_path,
        prepared,
        "--data.datasets.0.shards 10 --data.datasets.0.shards_idx 0 --train.max_steps null "
        "--train.num_train_epochs 1.5 --train.save_epochs 0.5 --train.save_total_limit 2 "
        "--model.special_tokens.pad_token <|pad|> "
        "--model.special_tokens.additional_special_tokens ['<|tool|>'] "
        f"--train.gradient_checkpointing true --train.optimizer {optimizer} "
        "--train.lr_decay_style cosine --train.lr_min 1e-4",
    )
    by_step = steps(progress(out))
    # Steps per epoch from the logged epoch position; num_train_epochs 1.5 without max_steps.
    steps_per_epoch = round(1 / by_step[1]["epoch"])
    total = math.ceil(1.5 * steps_per_epoch)
    assert 4 <= steps_per_epoch <= 20
    assert sorted(by_step) == list(range(1, total + 1))
    assert by_step[steps_per_epoch + 1]["epoch"] == pytest.approx(1 + 1 / steps_per_epoch)
    losses = [by_step[s]["loss"] for s in sorted(by_step)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]

    # A checkpoint at every half epoch (first step at or after it), the newest 2 kept.
    marks = [math.ceil(k * steps_per_epoch / 2 - 1e-9) for k in range(1, 4)]
    assert marks[-1] == total
    ckpt = out / "checkpoints"
    assert sorted(int(p.name[5:]) for p in ckpt.glob("step-*")) == marks[-2:]
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == sorted(f"step-{s}" for s in marks[-2:])
    assert (ckpt / "latest").read_text().strip() == f"step-{total}"

    # adamw_8bit: the optimizer state in the checkpoint has 8-bit moments.
    optimizer_state = torch.load(ckpt / f"step-{total}" / "optimizer.bin", weights_only=False)["state"]
    # bitsandbytes nests the quantized moments under its own key in state_dict().
    moments = [s.get("__bnb_optimizer_quant_state__") or s for s in optimizer_state.values()]
    has_8bit_moments = any(m.get("state1") is not None and m["state1"].dtype == torch.uint8 for m in moments)
    assert has_8bit_moments is HAS_BNB

    # special_tokens: pad token added, embeddings (and the saved base) grown, adapter loads on that base.
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "<|pad|>" and len(tokenizer) == 706
    assert tokenizer.convert_tokens_to_ids("<|tool|>") == 705
    assert json.loads((out / "base_model" / "config.json").read_text())["vocab_size"] == 706
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter["base_model.model.model.embed_tokens.weight"].shape[0] == 706
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base_model"), out)
    logits = model(input_ids=torch.tensor([[1, 5, 704, 705]])).logits
    assert logits.shape == (1, 4, 706) and torch.isfinite(logits).all()


def test_exit_duration_checkpoints_and_exits_zero_with_tensorboard_events(tmp_path, prepared):
    trackers = "[tensorboard]" if HAS_TENSORBOARD else "[]"  # the exit checks run without tensorboard too
    overrides = f"--train.max_steps 50 --train.exit_duration_in_mins 0.0001 --train.report_to {trackers}"
    result, out = train_ok(tmp_path, prepared, overrides)
    assert "stopping: train.exit_duration_in_mins (0.0001) reached; checkpoint at" in result.stdout
    assert "--train.load_checkpoint_path auto" in result.stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-1"
    assert max(step_losses(progress(out))) == 1
    assert not (out / "adapter_model.safetensors").exists()  # stopped early: no final save
    if not HAS_TENSORBOARD:
        pytest.skip("tensorboard is not installed: event files not checked")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Tracker files are flushed on this early exit too.
    events = list(out.glob("**/events.out.tfevents.*"))
    assert events, sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    scalars = set()
    for path in events:
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        scalars |= set(accumulator.Tags()["scalars"])
    assert {"loss", "lr", "tokens_per_sec"} <= scalars


# --------------------------------------------------------------------------------- in process


def test_missing_tracker_is_an_error_with_the_fix(tmp_path, monkeypatch, fresh_accelerator_state):
    import accelerate.utils

    from finetune.engine import make_accelerator
    from finetune.recipe import load_recipe

    monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: False)
    recipe = load_recipe(DEMO, [*demo_overrides(tmp_path), "--train.report_to", "[tensorboard]"])
    with pytest.raises(FinetuneError, match=r"report_to: tensorboard is not installed \(pip install"):
        make_accelerator(recipe.train, model_kind="llm", qlora=False, compile_model=False)


def test_schedule_length_max_steps_versus_epochs():
    from finetune.engine.checkpoints import schedule_length

    assert schedule_length(10, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=None) == (10, 10)
    # A short last window still makes a step; fractional epochs round up.
    assert schedule_length(10, gradient_accumulation_steps=4, num_train_epochs=2, max_steps=None) == (3, 6)
    assert schedule_length(10, gradient_accumulation_steps=4, num_train_epochs=0.5, max_steps=None) == (3, 2)
    # max_steps wins, in either direction.
    assert schedule_length(10, gradient_accumulation_steps=2, num_train_epochs=3, max_steps=7) == (5, 7)
    assert schedule_length(10, gradient_accumulation_steps=2, num_train_epochs=1, max_steps=12) == (5, 12)


@pytest.mark.parametrize(
    ("steps_per_epoch", "save_epochs", "expected"),
    [
        (8, 0.5, [4, 8, 12, 16, 20, 24]),
        (7, 0.5, [4, 7, 11, 14, 18, 21]),  # marks stay on epoch ends (7, 14, 21), no drift
        (7, 1, [7, 14, 21]),
        (3, 1 / 3, list(range(1, 25))),
        (10, 1.5, [15]),
        (2, 0.1, list(range(1, 25))),  # finer than a step: every step
    ],
)
def test_fractional_save_epochs(steps_per_epoch, save_epochs, expected):
    from finetune.engine.checkpoints import crosses_epoch_mark

    got = [
        s
        for s in range(1, 25)
        if crosses_epoch_mark(s, steps_per_epoch=steps_per_epoch, save_epochs=save_epochs)
    ]
    assert got == expected


def test_unpacked_batches_carry_attention_masks_and_packed_ones_position_ids(tmp_path):
    from datasets import Dataset

    from finetune.data.batching.loader import count_tokens, make_dataloader, seq_stats

    rows = Dataset.from_list(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2], "extra": 1},
            {
                "input_ids": [8, 9, 10, 11, 12],
                "labels": [-100, 9, 10, 11, 12],
                "position_ids": [0, 1, 0, 1, 2],
                "extra": 2,
            },
        ]
    )
    settings = dict(
        micro_batch_size=2, seed=0, pad_id=3, shuffle=False, drop_last=False, pad_to_multiple_of=8
    )
    unpacked = next(iter(make_dataloader(rows, packed=False, **settings)))
    assert set(unpacked) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert unpacked["input_ids"].shape == (2, 8)  # padded to data.pad_to_multiple_of (8 in the demo)
    assert unpacked["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert (unpacked["labels"][unpacked["attention_mask"] == 0] == -100).all()
    assert count_tokens(unpacked) == 8
    packed = next(iter(make_dataloader(rows, packed=True, **settings)))
    assert "attention_mask" not in packed
    assert packed["position_ids"][1].tolist() == [0, 1, 0, 1, 2, 0, 1, 2]
    assert count_tokens(packed) == 16
    # Segments (padding is its own): row 0 = 3 | 5 padding, row 1 = 2 | 3 | 3 padding.
    assert seq_stats(packed) == (float(9 + 25 + 4 + 9 + 9), 16)


@slow  # a subprocess, and inductor starts compile workers
def test_compiled_model_trains_and_saves_the_adapter(tmp_path):
    """model.enable_compile (Accelerate's dynamo plugin, inductor on CPU): trains and saves an adapter
    with PEFT's key names (saving the compiled wrapper's state dict used to fail)."""
    from safetensors import safe_open

    from tests.integration._run import DEMO, accelerate_cmd, demo_overrides, progress, run, step_losses

    result = run(
        accelerate_cmd(
            DEMO,
            *demo_overrides(
                tmp_path,
                "--model.enable_compile",
                "true",
                "--train.max_steps",
                "2",
                "--train.log_steps",
                "1",
                "--train.save_epochs",
                "0",
                "--train.eval_steps",
                "null",
                "--data.val_set_size",
                "null",
                "--train.log_format",
                "structured",
            ),
        )
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(step_losses(progress(tmp_path / "out"))) == [1, 2]
    with safe_open(tmp_path / "out" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert any(".lora_A." in k for k in keys) and not any("_orig_mod" in k for k in keys)
