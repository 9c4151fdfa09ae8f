"""finetune.optim: weight-decay groups, optimizers (torch, transformers' table, bitsandbytes 8-bit on CPU,
muon), LR schedules."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from finetune.errors import FinetuneError
from finetune.optim import build_optimizer, build_scheduler, param_groups
from tests.tiny import tiny_model

ADAM = {"betas": (0.9, 0.999), "eps": 1e-8}


def _model(bias: bool = True) -> torch.nn.Module:
    return tiny_model(vocab_size=128, attention_bias=bias, mlp_bias=bias)


def _group_names(model, groups) -> list[set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in g["params"]} for g in groups]


def test_no_weight_decay_on_biases_and_norms():
    model = _model()
    groups = param_groups(model, 0.1, ["bias", "norm"])
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decay, no_decay = _group_names(model, groups)
    assert decay and no_decay and not decay & no_decay
    assert decay | no_decay == {n for n, _ in model.named_parameters()}
    assert any(n.endswith("q_proj.bias") for n in no_decay) and any(
        n.endswith("up_proj.bias") for n in no_decay
    )
    assert "model.norm.weight" in no_decay and "model.layers.0.input_layernorm.weight" in no_decay
    for name in decay:
        assert "bias" not in name and "norm" not in name
        assert dict(model.named_parameters())[name].ndim == 2
    assert "model.embed_tokens.weight" in decay and "model.layers.1.mlp.down_proj.weight" in decay


def test_no_decay_params_are_configurable_and_frozen_params_left_out():
    model = _model(bias=False)
    model.lm_head.weight.requires_grad_(False)
    decay, no_decay = _group_names(model, param_groups(model, 0.1, ["embed", "norm"]))
    assert "model.embed_tokens.weight" in no_decay
    assert "lm_head.weight" not in decay | no_decay


def test_adamw_decays_weights_but_not_biases_or_norms():
    """One AdamW step with zero gradients: only decoupled weight decay moves anything."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(
        model, name="adamw", lr=0.1, weight_decay=0.5, no_decay_params=["bias", "norm"], **ADAM
    )
    assert isinstance(optimizer, torch.optim.AdamW)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        if "bias" in name or "norm" in name:
            torch.testing.assert_close(p, before[name], msg=name)
        else:
            torch.testing.assert_close(p, before[name] * (1 - 0.1 * 0.5), msg=name)


def test_sgd_uses_the_lr_and_no_momentum():
    model = _model(bias=False)
    optimizer = build_optimizer(model, name="sgd", lr=0.5, weight_decay=0.0, no_decay_params=[], **ADAM)
    assert isinstance(optimizer, torch.optim.SGD)
    assert all(g["lr"] == 0.5 for g in optimizer.param_groups)
    weight = model.lm_head.weight
    before = weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    torch.testing.assert_close(weight, before - 0.5)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_adamw_8bit_runs_on_cpu_with_8bit_state():
    import bitsandbytes as bnb

    model = _model(bias=False)
    optimizer = build_optimizer(
        model, name="adamw_8bit", lr=1e-2, weight_decay=0.1, no_decay_params=["norm"], **ADAM
    )
    # transformers' table builds bitsandbytes' AdamW with 8-bit states (what bnb.optim.AdamW8bit is).
    assert isinstance(optimizer, bnb.optim.AdamW) and optimizer.args.optim_bits == 8
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    ids = torch.randint(0, 128, (2, 16))
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < losses[0]
    # Large tensors keep their Adam moments in 8 bits (small ones stay 32-bit in bitsandbytes).
    state = optimizer.state[model.model.embed_tokens.weight]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8


def test_adamw_8bit_without_bitsandbytes_says_how_to_install(without_bitsandbytes):
    with pytest.raises(FinetuneError, match=r"adamw_8bit needs the bitsandbytes package.*\[qlora\]"):
        build_optimizer(_model(), name="adamw_8bit", lr=1e-3, weight_decay=0, no_decay_params=[], **ADAM)


def _built_by_transformers(name: str, model, **settings):
    """What a transformers Trainer run with optim=`name` builds: its class and keyword arguments."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir="unused", optim=name, learning_rate=1e-3, report_to="none", **settings
    )
    return Trainer.get_optimizer_cls_and_kwargs(args, model)


@pytest.mark.parametrize(
    "name",
    ["adafactor", "paged_adamw_8bit", "lion_32bit", "ademamix_8bit", "rmsprop", "adagrad", "adamw_torch"],
)
def test_transformers_optimizers_are_built_by_transformers_table(name):
    """The class and settings are exactly transformers' (passed through, not rewritten), on finetune's
    weight-decay groups, and a step on CPU lowers the loss."""
    model = _model(bias=False)
    optimizer = build_optimizer(model, name=name, lr=1e-3, weight_decay=0.1, no_decay_params=["norm"], **ADAM)
    cls, kwargs = _built_by_transformers(name, model, weight_decay=0.1)
    assert type(optimizer) is cls
    for key, value in kwargs.items():
        if key in ("optim_bits", "is_paged"):  # bitsandbytes keeps these in optimizer.args
            assert getattr(optimizer.args, key, value) == value, key
        else:
            assert optimizer.param_groups[0][key] == value, key
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    ids = torch.randint(0, 128, (2, 16))
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < losses[0]


def test_optim_args_reach_transformers():
    model = _model(bias=False)
    optimizer = build_optimizer(
        model, name="sgd", lr=0.1, weight_decay=0.0, no_decay_params=[], optim_args={"momentum": 0.5}, **ADAM
    )
    assert all(g["momentum"] == 0.5 for g in optimizer.param_groups)


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="needs galore-torch")
def test_galore_projects_the_target_modules_only():
    from galore_torch import GaLoreAdamW

    model = _model(bias=False)
    optimizer = build_optimizer(
        model, name="galore_adamw", lr=1e-3, weight_decay=0.0, no_decay_params=[], **ADAM,
        optim_args={"rank": 4, "update_proj_gap": 2}, optim_target_modules=["q_proj", "v_proj"],
    )  # fmt: skip
    assert isinstance(optimizer, GaLoreAdamW)
    projected = [g for g in optimizer.param_groups if "rank" in g]
    assert len(projected) == 1 and projected[0]["rank"] == 4 and projected[0]["update_proj_gap"] == 2
    targets = {id(p) for n, p in model.named_parameters() if n.endswith(("q_proj.weight", "v_proj.weight"))}
    assert {id(p) for p in projected[0]["params"]} == targets


def test_a_missing_optimizer_package_names_the_pip_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "schedulefree" else real(n, *a)
    )
    with pytest.raises(
        FinetuneError, match=r"schedule_free_adamw needs the schedulefree package.*pip install schedulefree"
    ):
        build_optimizer(
            _model(), name="schedule_free_adamw", lr=1e-3, weight_decay=0, no_decay_params=[], **ADAM
        )


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = _model(bias=True)
    optimizer = build_optimizer(
        model, name="muon", lr=1e-2, weight_decay=0.1, no_decay_params=["bias", "norm"], **ADAM
    )
    names = {id(p): n for n, p in model.named_parameters()}
    by_kind = {
        (g["use_muon"], g["weight_decay"]): {names[id(p)] for p in g["params"]}
        for g in optimizer.param_groups
    }
    muon = by_kind[(True, 0.1)]
    assert muon == {
        n for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n
    }
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= by_kind[(False, 0.1)]
    assert all("bias" in n or "norm" in n for n in by_kind[(False, 0.0)])
    muon_group = next(g for g in optimizer.param_groups if g["use_muon"])
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw" and muon_group["momentum"] == 0.95
    # One step equals torch's Muon and AdamW each stepped on their own parameters.
    reference = _model(bias=True)
    ref_params = dict(reference.named_parameters())
    ref_muon = torch.optim.Muon(
        [ref_params[n] for n in sorted(muon)], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    rest = [n for n in ref_params if n not in muon]
    ref_adam = torch.optim.AdamW(
        [{"params": [ref_params[n] for n in rest if not ("bias" in n or "norm" in n)], "weight_decay": 0.1},
         {"params": [ref_params[n] for n in rest if "bias" in n or "norm" in n], "weight_decay": 0.0}],
        lr=1e-2, **ADAM,
    )  # fmt: skip
    ids = torch.randint(0, 128, (2, 16))
    for net, steps in ((model, [optimizer]), (reference, [ref_muon, ref_adam])):
        net(input_ids=ids, labels=ids).loss.backward()
        for opt in steps:
            opt.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, ref_params[name], msg=name)


def test_muon_state_dict_round_trips_into_a_new_optimizer():
    model = _model(bias=False)
    kwargs = dict(name="muon", lr=1e-2, weight_decay=0.0, no_decay_params=["norm"], **ADAM)
    optimizer = build_optimizer(model, **kwargs)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    fresh = build_optimizer(model, **kwargs)
    fresh.load_state_dict(optimizer.state_dict())
    for part in fresh._parts:  # the inner optimizers see the loaded state and groups
        assert part.state is fresh.state and all(g in fresh.param_groups for g in part.param_groups)
    assert torch.equal(
        fresh.state[model.lm_head.weight]["exp_avg"], optimizer.state[model.lm_head.weight]["exp_avg"]
    )


def test_no_trainable_parameters_is_an_error():
    model = _model().requires_grad_(False)
    with pytest.raises(FinetuneError, match="no trainable parameters"):
        build_optimizer(model, name="adamw", lr=1e-3, weight_decay=0, no_decay_params=[], **ADAM)


# ------------------------------------------------------------------------------------------ schedules

LR, LR_MIN, WARMUP, TOTAL = 1e-3, 1e-4, 4, 20


def _lrs(style: str, lr: float = LR, lr_min: float = LR_MIN, warmup: int = WARMUP, total: int = TOTAL):
    """The LR after k scheduler steps, k = 0..total (k = the LR optimizer step k+1 uses)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(
        optimizer, style=style, num_warmup_steps=warmup, num_training_steps=total, lr=lr, lr_min=lr_min
    )
    out = [scheduler.get_last_lr()[0]]
    for _ in range(total):
        optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_reaches_lr_then_decays_to_lr_min(style):
    lrs = _lrs(style)
    assert lrs[0] == 0.0
    for k in range(1, WARMUP + 1):  # linear warmup
        assert lrs[k] == pytest.approx(LR * k / WARMUP)
    assert lrs[WARMUP] == pytest.approx(LR)
    after = lrs[WARMUP:]
    if style == "constant":
        assert after == pytest.approx([LR] * len(after))
        return
    assert lrs[TOTAL] == pytest.approx(LR_MIN)
    assert all(a > b for a, b in itertools.pairwise(after))
    assert min(lrs[1:]) == pytest.approx(LR_MIN)
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert lrs[middle] == pytest.approx((LR + LR_MIN) / 2)  # both are symmetric around the midpoint
    quarter = WARMUP + (TOTAL - WARMUP) // 4
    progress = 0.25
    expected = {
        "linear": LR_MIN + (LR - LR_MIN) * (1 - progress),
        "cosine": LR_MIN + (LR - LR_MIN) * 0.5 * (1 + math.cos(math.pi * progress)),
    }[style]
    assert lrs[quarter] == pytest.approx(expected)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_to_zero_without_warmup(style):
    lrs = _lrs(style, lr_min=0.0, warmup=0)
    assert lrs[0] == pytest.approx(LR) and lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_linear_with_lr_min_equal_to_lr_is_constant():
    # The recipe allows lr_min == lr; transformers' polynomial schedule alone would raise.
    assert _lrs("linear", lr_min=LR, warmup=0) == pytest.approx([LR] * (TOTAL + 1))


def test_unknown_schedule_is_an_error():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(FinetuneError, match="lr_decay_style"):
        build_scheduler(optimizer, style="step", num_warmup_steps=0, num_training_steps=2, lr=1.0, lr_min=0)


@pytest.mark.parametrize("args", [{"momentum": "x"}, {"nope": 1}])
def test_muon_arguments_it_refuses_are_a_clear_error(args):
    """train.optim_args that torch's Muon cannot take (a string where a number goes, an unknown name) are a
    FinetuneError naming the field and what Muon takes, not a traceback from inside torch."""
    from finetune.errors import FinetuneError
    from finetune.optim import muon_optimizer
    from tests.tiny import tiny_model

    with pytest.raises(FinetuneError, match=r"train\.optim_args .*it takes weight_decay, momentum"):
        muon_optimizer(
            tiny_model(),
            lr=1e-3,
            weight_decay=0.0,
            no_decay_params=[],
            betas=(0.9, 0.99),
            eps=1e-8,
            muon_args=args,
        )


def test_lr_by_prefix_gives_a_part_its_own_lr_that_the_schedule_scales():
    """diffusion.text_encoder_lr: the prefixed parameters form their own decay / no-decay groups at their
    lr; torch's AdamW and transformers' schedule treat each group's lr as its own peak."""
    model = torch.nn.ModuleDict({"denoiser": torch.nn.Linear(4, 4), "text_encoders": torch.nn.Linear(4, 4)})
    groups = param_groups(model, 0.1, [], {"text_encoders.": 1e-5})
    assert [(len(g["params"]), g["weight_decay"], g.get("lr")) for g in groups] == [
        (1, 0.1, None), (1, 0.0, None), (1, 0.1, 1e-5), (1, 0.0, 1e-5)
    ]  # fmt: skip
    optimizer = build_optimizer(
        model, name="adamw", lr=1e-3, weight_decay=0.1, no_decay_params=[], betas=(0.9, 0.999), eps=1e-8,
        lr_by_prefix={"text_encoders.": 1e-5},
    )  # fmt: skip
    assert optimizer.param_groups[2]["params"][0] is model["text_encoders"].weight
    scheduler = build_scheduler(
        optimizer, style="cosine", num_warmup_steps=2, num_training_steps=10, lr=1e-3, lr_min=0.0
    )
    optimizer.step()
    scheduler.step()
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[2] == pytest.approx(0.5e-5)


def test_lr_by_prefix_is_refused_where_the_optimizer_makes_its_own_groups():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "text_encoders": torch.nn.Linear(4, 4)})
    with pytest.raises(FinetuneError, match="per-part learning rates"):
        build_optimizer(
            model, name="muon", lr=1e-3, weight_decay=0.0, no_decay_params=[], betas=(0.9, 0.999), eps=1e-8,
            lr_by_prefix={"text_encoders.": 1e-5},
        )  # fmt: skip
