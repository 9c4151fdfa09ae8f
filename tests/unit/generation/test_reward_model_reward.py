"""A trained reward model as an online-RL reward (grpo.rewards[].model): it scores the prompt and the
completion as text re-tokenized with its own tokenizer (rendered as its training pairs were), so a policy
with another tokenizer is scored right; packing several completions per forward changes nothing; its
place in the recipe (exactly one of name / function / model) and its errors at start name the recipe path."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig

from finetune.data.formats.tokenize import tokenize_dataset
from finetune.errors import FinetuneError
from finetune.generation.protocol import Completion
from finetune.generation.reward_model import reward_model_reward, reward_text_ids
from finetune.generation.rewards import Reward
from finetune.objectives import rollout as ro
from finetune.recipe import dataset_entry, validate_recipe
from tests.tiny import TINY_LLAMA
from tests.unit.losses.test_preference_losses import word_tokenizer

DEMO_TOKENIZER = Path(__file__).resolve().parents[3] / "recipes" / "demo" / "tokenizer"
ROWS = [
    {"question": "What is 2 + 3?", "answer": "#### 5"},
    {"question": [{"role": "user", "content": "What is 7 * 3?"}], "answer": "#### 21"},
    {"question": "Is 4 less than 9?", "answer": "yes"},
]
COMPLETIONS = ["2 + 3 = 5.", "7 * 3 = 24.", "Yes, 4 is less than 9."]


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, demo_tokenizer) -> str:
    """A tiny reward model saved with the demo tokenizer (642 tokens: not the word-level policy's)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{**TINY_LLAMA, "vocab_size": 704, "hidden_size": 32, "intermediate_size": 64},
        initializer_range=0.2, num_labels=1, pad_token_id=demo_tokenizer.pad_token_id,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("rm")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    demo_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("chat", [True, False])
def test_the_reward_model_reads_what_its_training_pairs_held(demo_tokenizer, chat):
    """The ids of (prompt, completion) are the chosen sequence the preference format prepares for the
    reward run: rendered with the chat template, or `[bos] prompt completion eos`."""
    pair = {"prompt": "What is 2 + 3?", "chosen": " 2 + 3 = 5.", "rejected": " 2 + 3 = 6."}
    entry = dataset_entry(path="p.jsonl", type="preference", apply_chat_template=chat)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    if not chat:  # a tokenizer without a template: the reward model reads plain prompt + completion
        tokenizer.chat_template = None
    row = tokenize_dataset(
        datasets.Dataset.from_list([pair]), entry, tokenizer, sequence_len=256,
        excess_length_strategy="raise", on_bad_row="raise",
    ).dataset[0]  # fmt: skip
    chosen = row["input_ids"][: row["chosen_len"]]
    assert reward_text_ids(tokenizer, pair["prompt"], pair["chosen"]) == chosen


def direct_scores(folder: str, tokenizer) -> list[float]:
    """transformers' own forward and pooling, one text at a time, with the reward model's tokenizer."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for row, completion in zip(ROWS, COMPLETIONS, strict=True):
            ids = reward_text_ids(tokenizer, row["question"], completion)
            out.append(model(input_ids=torch.tensor([ids])).logits.item())
    return out


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_policy_with_another_tokenizer_is_scored_from_the_text(
    reward_model_dir, demo_tokenizer, batch_size
):
    """The policy speaks a word-level vocabulary; its completions are decoded to text and re-tokenized by
    the reward model's tokenizer, so the rewards are the reward model's scores of those texts (packed
    batch_size at a time)."""
    policy_tokenizer = word_tokenizer()
    assert policy_tokenizer.get_vocab() != demo_tokenizer.get_vocab()
    words = [f"w{k}" for k in range(3)]  # what the policy generated, in its own ids
    completions = [
        Completion(policy_tokenizer(w, add_special_tokens=False)["input_ids"], True) for w in words
    ]
    backend = type("Backend", (), {"tokenizer": policy_tokenizer, "stops": []})()
    fn = reward_model_reward(
        reward_model_dir,
        batch_size=batch_size,
        device="cpu",
        prompt_fields=("question",),
        where="grpo.rewards.0.model",
    )
    texts, per_reward, total = ro.score([Reward("rm", 2.0, fn)], backend, completions, ROWS)
    assert texts == words
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.no_grad():
        expected = [
            model(
                input_ids=torch.tensor([reward_text_ids(demo_tokenizer, row["question"], text)])
            ).logits.item()
            for row, text in zip(ROWS, texts, strict=True)
        ]
    torch.testing.assert_close(per_reward[:, 0], torch.tensor(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, 2.0 * per_reward[:, 0])
    again = fn(COMPLETIONS, ROWS)
    assert again == pytest.approx(direct_scores(reward_model_dir, demo_tokenizer), abs=1e-5)


def test_the_prompt_column_is_the_rewards_field_prompt_else_the_entries(reward_model_dir):
    rows = [{"q": "What is 2 + 3?"}]
    fn = reward_model_reward(
        reward_model_dir, batch_size=4, device="cpu", prompt_fields=("question", "q"), where="w"
    )
    assert fn(["5"], rows) == pytest.approx(fn(["5"], [{"question": "What is 2 + 3?"}]), abs=1e-6)
    missing = reward_model_reward(reward_model_dir, batch_size=4, device="cpu", prompt_fields=("question",),
                                  where="grpo.rewards.2.model")  # fmt: skip
    with pytest.raises(FinetuneError, match=r"grpo.rewards.2.model: .* set grpo.rewards.2.field_prompt"):
        missing(["5"], rows)


def _grpo(rewards: list[dict], **entry) -> dict:
    return {
        "model": {"model_path": "org/base"},
        "data": {"datasets": [{"path": "p.jsonl", "type": "prompt", "field_prompt": "question", **entry}]},
        "train": {"output_dir": "out", "objective": "grpo", "micro_batch_size": 8},
        "grpo": {"rewards": rewards},
    }


def test_the_recipe_takes_exactly_one_of_name_function_or_model():
    recipe = validate_recipe(_grpo([{"model": "outputs/rm", "batch_size": 4, "weight": 0.5}]))
    spec = recipe.grpo.rewards[0]
    assert (spec.label, spec.batch_size, spec.weight) == ("rm", 4, 0.5)
    assert ro.prompt_fields(recipe.data) == ("question",)
    cases = [
        ({"model": "outputs/rm", "name": "format", "pattern": "x"}, "give exactly one of name"),
        (
            {"model": "outputs/rm", "field_expected": "answer"},
            "field_expected: is read by built-in rewards only",
        ),
        ({"name": "format", "pattern": "x", "batch_size": 2}, "batch_size: is read by model rewards only"),
    ]
    for reward, message in cases:
        with pytest.raises(ValidationError, match=message):
            validate_recipe(_grpo([reward]))


def test_an_unreachable_reward_model_or_one_with_the_wrong_head_stops_the_start(tmp_path, monkeypatch):
    """rewards_for (the online objective's build, before the first step) loads the reward models: what
    is no reward model is an error naming grpo.rewards.<i>.model and the fix."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_dir = tmp_path / "sft"
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(lm_dir)
    for path, message in ((str(tmp_path / "nothing"), "does not exist"), (str(lm_dir), "no score head")):
        recipe = validate_recipe(_grpo([{"name": "format", "pattern": "x"}, {"model": path}]))
        with pytest.raises(
            FinetuneError, match=rf"^grpo.rewards.1.model: .*{message}.*train.objective reward"
        ):
            ro.rewards_for(recipe.grpo, word_tokenizer(), recipe_path=None, prompt_fields=("question",))


def test_a_text_longer_than_the_reward_models_positions_keeps_its_end(reward_model_dir, demo_tokenizer):
    fn = reward_model_reward(
        reward_model_dir, batch_size=2, device="cpu", prompt_fields=("question",), where="w"
    )
    completion = "1 2 " * 100  # 400 tokens: beyond the tiny model's 128 positions
    ids = reward_text_ids(demo_tokenizer, "Count.", completion)
    assert len(ids) > TINY_LLAMA["max_position_embeddings"]
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.no_grad():
        expected = model(
            input_ids=torch.tensor([ids[-TINY_LLAMA["max_position_embeddings"] :]])
        ).logits.item()
    assert fn([completion, "5"], [{"question": "Count."}, {"question": "2 + 3?"}])[0] == pytest.approx(
        expected, abs=1e-5
    )
