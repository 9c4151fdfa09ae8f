"""finetune.model.reward: a reward model loads from what training writes (a full model, a SEQ_CLS LoRA
adapter on its base) and scores as it did in training; a location that is no reward model (missing, a
causal LM, a causal LM's adapter, a classifier of two labels) is refused with what it is and the fix; the
base of `finetune eval` gets the score head the reward run started from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

from finetune.errors import FinetuneError
from finetune.losses.reward import sequence_scores
from finetune.model.build import build_model
from finetune.model.reward import load_reward_model
from finetune.recipe import LoraSection, ModelSection
from tests.tiny import TINY_LLAMA

DEMO_TOKENIZER = Path(__file__).resolve().parents[3] / "recipes" / "demo" / "tokenizer"
CONFIG = {
    **TINY_LLAMA,
    "vocab_size": 704,
    "hidden_size": 32,
    "intermediate_size": 64,
    "initializer_range": 0.2,
}


def _save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO_TOKENIZER).save_pretrained(folder)
    return str(folder)


def reward_model(num_labels: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, num_labels=num_labels, pad_token_id=3)
    return AutoModelForSequenceClassification.from_config(config)


def causal_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, pad_token_id=3))


def lora(model, task: str, folder: Path) -> str:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, task_type=task)
    )
    return _save(peft_model, folder)


def score_text(model, ids: list[int]) -> float:
    batch = {"input_ids": torch.tensor([ids]), "position_ids": torch.arange(len(ids))[None]}
    with torch.no_grad():
        return sequence_scores(model, batch, torch.tensor([1]), pad_token_id=model.config.pad_token_id).item()


IDS = [1, 4, 50, 60, 5, 70, 2]


def test_a_full_reward_model_loads_and_scores_as_transformers_does(tmp_path):
    saved = reward_model()
    path = _save(saved, tmp_path / "rm")
    model, tokenizer, new_head = load_reward_model(path)
    assert not new_head and len(tokenizer) == len(AutoTokenizer.from_pretrained(DEMO_TOKENIZER))
    with torch.no_grad():
        assert score_text(model, IDS) == pytest.approx(
            saved.eval()(input_ids=torch.tensor([IDS])).logits.item(), abs=1e-6
        )


def test_a_reward_adapter_loads_on_its_base_merged_or_not(tmp_path):
    from peft import PeftModel

    base = _save(reward_model(), tmp_path / "base")
    path = lora(AutoModelForSequenceClassification.from_pretrained(base), "SEQ_CLS", tmp_path / "adapter")
    model, _, new_head = load_reward_model(path)
    merged, _, _ = load_reward_model(path, merge=True)
    direct = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), path).eval()
    assert not new_head and type(model).__name__ == "PeftModelForSequenceClassification"
    assert score_text(model, IDS) == pytest.approx(score_text(direct, IDS), abs=1e-6)
    assert score_text(merged, IDS) == pytest.approx(score_text(direct, IDS), abs=1e-5)
    assert score_text(model, IDS) != pytest.approx(score_text(load_reward_model(base)[0], IDS), abs=1e-4)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "rm does not exist: train one"),
        ("hub_like", "no reward model loads from 'outputs/rm': it is no folder here"),
        ("causal", "LlamaForCausalLM with no score head, not a reward model"),
        ("causal_adapter", "is a LoRA adapter of a CAUSAL_LM"),
        ("two_labels", "a classifier with 2 labels, not a reward model"),
    ],
)
def test_what_is_no_reward_model_is_refused_with_what_it_is_and_the_fix(tmp_path, monkeypatch, kind, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    if kind == "missing":
        path = str(tmp_path / "outputs" / "rm")
    elif kind == "hub_like":  # a relative path that is not here reads as a Hub id
        path = "outputs/rm"
    elif kind == "causal":
        path = _save(causal_lm(), tmp_path / "lm")
    elif kind == "causal_adapter":
        path = lora(
            AutoModelForCausalLM.from_pretrained(_save(causal_lm(), tmp_path / "lm")),
            "CAUSAL_LM",
            tmp_path / "a",
        )
    else:
        path = _save(reward_model(num_labels=2), tmp_path / "cls")
    with pytest.raises(FinetuneError, match=message) as info:
        load_reward_model(path, where="grpo.rewards.1.model")
    text = str(info.value)
    assert text.startswith("grpo.rewards.1.model: ") and "train.objective reward" in text


def test_the_base_gets_the_score_head_its_reward_run_started_from(tmp_path):
    """`finetune eval`'s base (a causal LM: new_head_seed) has the head build_model gave the reward run at
    its start, from the same seed, and the recipe tokenizer's pad token id."""
    path = _save(causal_lm(), tmp_path / "lm")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    torch.manual_seed(123)  # whatever the global RNG holds
    trained = build_model(
        ModelSection(model_path=path), LoraSection(), mixed_precision="no", vocab_size=len(tokenizer),
        gradient_checkpointing=False, head="score", pad_token_id=tokenizer.pad_token_id, seed=42,
    )  # fmt: skip
    base, _, new_head = load_reward_model(path, tokenizer=tokenizer, new_head_seed=42)
    assert new_head and base.config.pad_token_id == trained.config.pad_token_id == tokenizer.pad_token_id
    torch.testing.assert_close(base.score.weight, trained.score.weight, rtol=0, atol=0)
    assert score_text(base, IDS) == pytest.approx(score_text(trained.eval(), IDS), abs=1e-6)
    other, _, _ = load_reward_model(path, tokenizer=tokenizer, new_head_seed=43)
    assert not torch.equal(other.score.weight, base.score.weight)


def test_the_load_report_of_a_new_score_head_is_quiet_and_any_other_shows():
    import logging

    from finetune.quiet import _DropNewScoreHeadReport

    def record(*rows: str) -> logging.LogRecord:
        table = "\n".join(["Key | Status | ", "---+---+-", *rows])
        message = f"\x1b[1mLlamaForSequenceClassification LOAD REPORT\x1b[0m from: x\n{table}\n\nNotes: ..."
        return logging.LogRecord("transformers.modeling_utils", logging.WARNING, "f", 1, message, None, None)

    keep = _DropNewScoreHeadReport().filter
    assert not keep(record("score.weight | MISSING | ", "lm_head.weight | UNEXPECTED | "))
    assert keep(record("score.weight | MISSING | ", "model.norm.weight | MISSING | "))
    assert keep(record("score.weight | MISMATCH | shape"))
    assert keep(logging.LogRecord("t", logging.WARNING, "f", 1, "another warning", None, None))
