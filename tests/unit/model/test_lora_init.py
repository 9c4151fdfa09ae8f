"""Data-driven LoRA inits (finetune.model.lora_init): EVA and CorDA through finetune give the adapter (and,
for CorDA, the residual base) that PEFT computes when called directly on the same model and batches; a
resume loads the saved init instead of reading data; padding never enters the statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import EvaConfig, LoraConfig, get_peft_model, initialize_lora_eva_weights
from peft.tuners.lora.config import CordaConfig
from peft.tuners.lora.corda import preprocess_corda

from finetune.data.batching.collate import collate_rows
from finetune.errors import FinetuneError
from finetune.model.adapters import apply_lora, init_modifies_base
from finetune.model.lora_init import CORDA_FILE, EVA_FILE, InitData, real_tokens
from finetune.recipe import LoraSection
from tests.tiny import tiny_model

PAD = 0


def _model():
    """A one-layer tiny Llama: EVA's incremental SVD runs until convergence, which the default tiny
    model makes take seconds per init on the 2-core machine."""
    return tiny_model(num_hidden_layers=1, hidden_size=32, intermediate_size=48)


def _rows(count: int = 12, seed: int = 3) -> list[dict]:
    """Rows of varied lengths, the first tokens of each untrained (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        length = 10 + (i * 7) % 13
        ids = torch.randint(4, 97, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return rows


def _batches(packed: bool = False, size: int = 3) -> list[dict]:
    rows = _rows()
    return [
        collate_rows(rows[i : i + size], pad_token_id=PAD, packed=packed) for i in range(0, len(rows), size)
    ]


def _data(tmp_path, batches, *, num_batches=None) -> InitData:
    return InitData(lambda: list(batches), num_batches, PAD, tmp_path / "lora_init")


def _peft_config(init: str, r: int = 4, **extra) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=8, target_modules="all-linear", init_lora_weights=init, **extra)


def _assert_same_params(ours, theirs, atol: float = 1e-6) -> None:
    expected = dict(theirs.named_parameters())
    params = dict(ours.named_parameters())
    assert set(params) == set(expected)
    for name, param in params.items():
        torch.testing.assert_close(param, expected[name], atol=atol, rtol=0, msg=name)


# rho 4 with rank 2 redistributes this model's ranks (measured; rank 4 with rho 2 does not). The
# second case feeds finetune packed rows (one sequence each, then a padding segment, no attention mask)
# and PEFT the padded ones: without the label mask only the padding tells them apart.
@pytest.mark.parametrize(
    ("settings", "packed"),
    [({"rho": 4.0}, False), ({"rho": 1.0, "whiten": True, "use_label_mask": False}, True)],
)
def test_eva_weights_are_pefts(tmp_path, settings, packed):
    """PEFT's initialize_lora_eva_weights called directly with its default language-modeling hooks
    (attention mask and label mask) on the same padded batches gives the same adapter, ranks included."""
    lora = LoraSection(enable_lora=True, lora_rank=2, lora_alpha=8, init_lora_weights="eva", eva=settings)
    ours = apply_lora(
        _model(), lora, gradient_checkpointing=False, init_data=_data(tmp_path, _batches(packed))
    )
    config = _peft_config("eva", r=2, eva_config=EvaConfig(**settings))
    theirs = get_peft_model(_model(), config, low_cpu_mem_usage=True)
    initialize_lora_eva_weights(theirs, dataloader=_batches(), show_progress_bar=False)
    _assert_same_params(ours, theirs, atol=1e-6)
    assert ours.peft_config["default"].rank_pattern == theirs.peft_config["default"].rank_pattern
    if settings.get("rho", 2.0) > 1:
        assert ours.peft_config["default"].rank_pattern, "EVA redistributed no rank: the test shows nothing"
    lora_b = [p for n, p in ours.named_parameters() if "lora_B" in n]
    assert lora_b and all(not p.any() for p in lora_b)  # the adapter starts as a no-op
    assert (tmp_path / "lora_init" / EVA_FILE).is_file()


def test_real_tokens_of_a_packed_batch():
    batch = collate_rows(_rows()[:3], pad_token_id=PAD, packed=True)
    lengths = [len(r["input_ids"]) for r in _rows()[:3]]
    assert real_tokens(batch, PAD).sum(dim=1).tolist() == lengths


@pytest.mark.parametrize("method", ["ipm", "kpm"])
def test_corda_weights_are_pefts(tmp_path, method):
    """PEFT's preprocess_corda called directly, its run_model feeding each row unpadded, then
    get_peft_model: the same adapter and the same residual base weights."""
    batches = _batches()
    lora = LoraSection(
        enable_lora=True, lora_rank=4, lora_alpha=8, init_lora_weights="corda", corda={"corda_method": method}
    )
    ours = apply_lora(_model(), lora, gradient_checkpointing=False, init_data=_data(tmp_path, batches))
    assert init_modifies_base(ours)
    net = _model()
    config = _peft_config("corda", corda_config=CordaConfig(corda_method=method))
    config.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(config.target_modules) == len(ours.peft_config["default"].target_modules)

    def run_model():
        for row in _rows():
            net(input_ids=torch.tensor([row["input_ids"]]))

    preprocess_corda(net, config, run_model=run_model)
    theirs = get_peft_model(net, config)
    _assert_same_params(ours, theirs)
    assert (tmp_path / "lora_init" / CORDA_FILE).is_file()


@pytest.mark.parametrize("init", ["eva", "corda"])
def test_a_resume_loads_the_saved_init_and_reads_no_data(tmp_path, init):
    lora = LoraSection(enable_lora=True, lora_rank=4, lora_alpha=8, init_lora_weights=init)
    first = apply_lora(_model(), lora, gradient_checkpointing=False, init_data=_data(tmp_path, _batches()))

    def no_data():
        raise AssertionError("a resume read the training data")

    data = InitData(no_data, None, PAD, tmp_path / "resumed" / "lora_init", tmp_path / "lora_init")
    resumed = apply_lora(_model(), lora, gradient_checkpointing=False, init_data=data)
    _assert_same_params(resumed, first, atol=0)
    assert (data.folder / (EVA_FILE if init == "eva" else CORDA_FILE)).is_file()  # for its own resume
    data.resume_from = tmp_path / "elsewhere"
    with pytest.raises(FinetuneError, match="is missing: a resumed run"):
        apply_lora(_model(), lora, gradient_checkpointing=False, init_data=data)


def test_num_batches_limits_what_eva_reads(tmp_path):
    """EVA cycles its batches until convergence: with num_batches 2 only the first two are ever read."""
    read = []
    batches = _batches()

    class Loader:
        def __len__(self):
            return len(batches)

        def __iter__(self):
            for index, batch in enumerate(batches):
                read.append(index)
                yield batch

    lora = LoraSection(
        enable_lora=True, lora_rank=2, lora_alpha=8, init_lora_weights="eva", eva={"num_batches": 2}
    )
    apply_lora(_model(), lora, gradient_checkpointing=False, init_data=InitData(Loader, 2, PAD, tmp_path))
    assert read and set(read) == {0, 1}


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"init_lora_weights": "pissa", "eva": {"rho": 1.0}}, "does nothing unless init_lora_weights: eva"),
        ({"corda": {"corda_method": "kpm"}}, "does nothing unless init_lora_weights: corda"),
        ({"init_lora_weights": "corda", "enable_qlora": True}, "a 4-bit base cannot hold"),
        ({"init_lora_weights": "eva", "eva": {"rho": 0.5}}, "greater than or equal to 1"),
    ],
)
def test_data_init_settings_are_checked(settings, expected):
    with pytest.raises(ValueError, match=expected):
        LoraSection(enable_lora=True, **settings)


def test_without_training_batches_eva_is_refused():
    lora = LoraSection(enable_lora=True, init_lora_weights="eva")
    with pytest.raises(FinetuneError, match="eva needs the training batches"):
        apply_lora(_model(), lora, gradient_checkpointing=False)


def test_grpo_with_a_data_driven_init_is_a_recipe_error(tmp_path):
    """GRPO's rows are prompts (completions come during training): EVA has no token rows to read."""
    from finetune.errors import RecipeError
    from finetune.recipe import load_recipe
    from tests.unit.recipe.test_recipe_field_types import GRPO

    path = tmp_path / "grpo.yaml"
    path.write_text(GRPO)
    with pytest.raises(
        RecipeError, match=r"lora.init_lora_weights.*trains on completions sampled during training"
    ):
        load_recipe(path, ["--lora.enable_lora", "true", "--lora.init_lora_weights", "eva"])
    assert load_recipe(path, ["--lora.enable_lora", "true"]).lora.init_lora_weights is True


def test_eva_runs_on_a_4bit_base(tmp_path):
    """QLoRA: EVA hooks the 4-bit layers' inputs (PEFT supports it); the init is set and runs."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the test extra")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # bitsandbytes' CPU 4-bit kernels need dimensions that are multiples of 64.
    tiny_model(num_hidden_layers=1, hidden_size=64, intermediate_size=128).save_pretrained(tmp_path / "base")
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    net = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantized)
    lora = LoraSection(
        enable_lora=True, enable_qlora=True, lora_rank=2, lora_alpha=8, init_lora_weights="eva"
    )
    model = apply_lora(net, lora, gradient_checkpointing=False, init_data=_data(tmp_path, _batches()))
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert lora_a and all(p.device.type != "meta" and p.abs().sum() > 0 for p in lora_a)
    assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()


def test_a_vision_language_recipe_with_a_data_driven_init_is_a_recipe_error():
    from finetune.errors import RecipeError
    from finetune.recipe import load_recipe

    demo = Path(__file__).resolve().parents[3] / "recipes" / "demo" / "tiny_vlm_cpu.yaml"
    with pytest.raises(
        RecipeError, match=r"lora.init_lora_weights.*vision-language recipe's batches carry pixels"
    ):
        load_recipe(demo, ["--lora.enable_lora", "true", "--lora.init_lora_weights", "eva"])
