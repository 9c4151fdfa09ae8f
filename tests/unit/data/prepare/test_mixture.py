"""Weighted mixtures: the draw (finetune.data.prepare.mixture) and what prepare makes of it (counts, shares,
eval rows held out first, determinism, the preference and prompt kinds)."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import datasets
import numpy as np
import pytest

from finetune.data.prepare import build as prepare_mod
from finetune.data.prepare.build import prepare
from finetune.data.prepare.cache import compute_fingerprint
from finetune.data.prepare.fingerprint import fingerprint_inputs
from finetune.data.prepare.mixture import draw, draw_count, mix, smallest_weight
from finetune.errors import DataError
from finetune.recipe import validate_recipe

# --------------------------------------------------------------------------------------------- draw

WEIGHTS = [0.001, 0.1, 0.25, 0.5, 0.75, 1.0, 1.15, 1.5, 2.0, 2.3, 3.0, 7.999]
SIZES = [0, 1, 2, 3, 7, 10, 101, 1000]


def _expected_count(weight: float, n: int) -> int:
    """k * n + round(f * n), half up, f taken from the weight as written (an independent computation)."""
    exact = Decimal(str(weight))
    whole = int(exact)
    return whole * n + int(((exact - whole) * n).quantize(Decimal(1), rounding=ROUND_HALF_UP))


@pytest.mark.parametrize("weight", WEIGHTS)
def test_draw_counts_are_k_copies_plus_the_rounded_fraction(weight: float):
    for n in SIZES:
        rows, passes = draw(n, weight, seed=42, index=0)
        assert len(rows) == len(passes) == draw_count(weight, n) == _expected_count(weight, n)
        whole = math.floor(weight)
        copies = Counter(rows.tolist())
        extra = draw_count(weight, n) - whole * n
        # Every row k times, round(f * n) distinct rows once more.
        assert all(copies[r] in (whole, whole + 1) for r in range(n)) and not set(copies) - set(range(n))
        assert sum(c == whole + 1 for c in copies.values()) == extra
        assert Counter(passes.tolist()) == {p: n for p in range(whole) if n} | (
            {whole: extra} if extra else {}
        )


def test_draw_rounds_half_up_on_the_decimal_weight():
    assert draw_count(0.25, 10) == 3  # 2.5 -> 3
    assert draw_count(0.5, 3) == 2  # 1.5 -> 2
    assert draw_count(1.15, 10) == 12  # 1.5 -> 2, though 1.15 - 1 is 0.1499... in binary
    assert draw_count(2.5, 3) == 8
    assert draw_count(0.3, 10) == 3 and draw_count(0.001, 499) == 0 and draw_count(0.001, 500) == 1
    for n in (1, 3, 7, 25, 99, 1000, 12345):  # the weight the zero-draw error suggests draws a row
        assert draw_count(smallest_weight(n), n) == 1


def test_draw_is_deterministic_seeded_and_nested():
    first, again = draw(1000, 0.3, seed=7, index=2)[0], draw(1000, 0.3, seed=7, index=2)[0]
    assert np.array_equal(first, again)
    assert not np.array_equal(first, draw(1000, 0.3, seed=8, index=2)[0])  # another seed
    assert not np.array_equal(first, draw(1000, 0.3, seed=7, index=3)[0])  # another entry
    # A larger fraction keeps the rows a smaller one drew.
    quarter = set(draw(1000, 0.25, seed=7, index=2)[0].tolist())
    half = set(draw(1000, 0.5, seed=7, index=2)[0].tolist())
    assert quarter < half and len(half) == 500
    assert np.array_equal(np.sort(draw(1000, 2.25, seed=7, index=2)[0][2000:]), np.sort(list(quarter)))


def _drawn_keys(positions: np.ndarray, keys: np.ndarray, sources: np.ndarray, index: int) -> Counter:
    return Counter(keys[positions][sources[positions] == index].tolist())


def test_mix_draws_an_entry_independently_of_the_other_weights_and_of_the_row_order():
    rng = np.random.default_rng(0)
    sources = rng.permutation(np.repeat([0, 1, 2], [300, 50, 120]))
    keys = np.zeros(len(sources), dtype=np.int64)
    for i in range(3):
        keys[sources == i] = rng.permutation(int((sources == i).sum()))
    base = mix(keys, sources, [0.4, 2.0, 1.5], seed=3, shuffle=True)
    other = mix(keys, sources, [0.4, 0.5, 3.7], seed=3, shuffle=False)
    assert _drawn_keys(base, keys, sources, 0) == _drawn_keys(other, keys, sources, 0)
    # The same rows in another order of the split: the same rows drawn.
    perm = rng.permutation(len(sources))
    moved = mix(keys[perm], sources[perm], [0.4, 2.0, 1.5], seed=3, shuffle=True)
    for i in range(3):
        assert _drawn_keys(moved, keys[perm], sources[perm], i) == _drawn_keys(base, keys, sources, i)
    assert Counter(sources[base].tolist()) == {0: 120, 1: 100, 2: 180}


def test_mix_order():
    sources = np.array([0, 1, 0, 1, 0])
    keys = np.array([0, 0, 1, 1, 2])
    # Every weight 1: the split itself, shuffled or not.
    assert mix(keys, sources, [1.0, 1.0], seed=0, shuffle=True).tolist() == [0, 1, 2, 3, 4]
    # No shuffle: the split's order, pass after pass.
    assert mix(keys, sources, [2.0, 1.0], seed=0, shuffle=False).tolist() == [0, 1, 2, 3, 4, 0, 2, 4]
    shuffled = mix(keys, sources, [2.0, 1.0], seed=0, shuffle=True)
    assert sorted(shuffled.tolist()) == [0, 0, 1, 2, 2, 3, 4, 4]
    assert np.array_equal(shuffled, mix(keys, sources, [2.0, 1.0], seed=0, shuffle=True))
    assert len(mix(keys, sources, [2.0, 1.0], seed=-5, shuffle=True)) == 8  # any int seed


# ------------------------------------------------------------------------------------------ prepare


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """The demo tokenizer and two small datasets whose rows are all distinct: alpaca sums, texts."""
    tokenizer = repo_root / "recipes" / "demo" / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        pytest.skip(
            f"demo tokenizer not generated yet at {tokenizer} (python recipes/demo/make_demo_data.py)"
        )
    root = tmp_path_factory.mktemp("mixture")
    shutil.copytree(tokenizer, root / "tokenizer")
    sums = [
        {"instruction": f"Add {i} and {i % 7}.", "input": "", "output": str(i + i % 7)} for i in range(40)
    ]
    sums.append({"instruction": "Say nothing.", "input": "", "output": None})  # a bad row, counted
    texts = [{"text": f"the {i} red birds sing {i * 3} songs"} for i in range(25)]
    for name, rows in (("sums.jsonl", sums), ("texts.jsonl", texts)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def _recipe(workdir: Path, weights=(1.0, 1.0), *, name: str = "prepared", **data):
    entries = [
        {"path": str(workdir / "sums.jsonl"), "type": "alpaca", "weight": weights[0]},
        {"path": str(workdir / "texts.jsonl"), "type": "completion", "weight": weights[1]},
    ]
    return _tiny_recipe(
        workdir,
        name,
        {"datasets": entries, "sequence_len": 64, "pad_to_multiple_of": 8, "on_bad_row": "skip", **data},
    )


def _tiny_recipe(workdir: Path, name: str, data: dict, **sections):
    """The recipe every prepare here uses: a 1-layer llama with the demo tokenizer, `data` prepared
    under ``workdir/name`` with one process unless `data` says otherwise."""
    return validate_recipe(
        {
            "model": {
                "config_path": {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1},
                "tokenizer_path": str(workdir / "tokenizer"),
            },
            "data": {"dataset_num_proc": 1, "dataset_prepared_path": str(workdir / name), **data},
            **sections,
            "train": {"output_dir": str(workdir / "out"), **sections.get("train", {})},
        }
    )


def _quiet(_: str) -> None:
    pass


def _sequences(rows) -> list[tuple[int, ...]]:
    """The examples of unpacked rows (one per row), padding stripped by their seq_lens."""
    return [tuple(ids[: lens[0]]) for ids, lens in zip(rows["input_ids"], rows["seq_lens"], strict=True)]


def test_weighted_prepare_draws_counts_and_reports_shares(workdir: Path):
    unpacked = {"sample_packing": False, "eval_sample_packing": False}
    logs: list[str] = []
    prepared = prepare(_recipe(workdir, (0.5, 3.0), val_set_size=0.2, **unpacked), log=logs.append)
    m, train = prepared.manifest, _sequences(prepared.train)
    a, b = m["mixture"]
    assert (a["weight"], b["weight"]) == (0.5, 3.0)
    # Every input row accounted for; the eval rows held out before weighting.
    for d in (a, b):
        assert (
            d["rows_in"]
            == d["rows_kept"] + next(s for s in m["sources"] if s["dataset"] == d["dataset"])["rows_dropped"]
        )
        assert d["rows_kept"] == d["rows_eval"] + d["rows_train"]
        assert d["rows_drawn"] == _expected_count(d["weight"], d["rows_train"])
    assert (a["rows_in"], a["rows_kept"], b["rows_kept"]) == (41, 40, 25)
    assert a["rows_eval"] + b["rows_eval"] == round(0.2 * 65) == m["splits"]["eval"]["examples"]
    eval_rows = set(_sequences(prepared.eval))
    assert not eval_rows & set(train)  # a repeated row never lands in both splits
    # Texts: each training row exactly 3 times; sums: distinct, half of them.
    copies = Counter(train)
    assert sorted(Counter(copies.values()).items()) == [(1, a["rows_drawn"]), (3, b["rows_train"])]
    assert len(train) == m["splits"]["train"]["examples"] == a["rows_drawn"] + b["rows_drawn"]
    # Trained tokens per dataset, counted from the prepared rows' labels.
    trained = Counter()
    for ids, labels, lens in zip(
        *(prepared.train[c] for c in ("input_ids", "labels", "seq_lens")), strict=True
    ):
        trained[copies[tuple(ids[: lens[0]])] == 3] += sum(x != -100 for x in labels)
    assert (trained[False], trained[True]) == (a["num_trained_tokens"], b["num_trained_tokens"])
    total = m["num_trainable_tokens"]
    assert a["share_of_trained_tokens"] == pytest.approx(trained[False] / total, abs=1e-6)
    assert a["share_of_rows"] + b["share_of_rows"] == pytest.approx(1.0)
    assert any("data.datasets[1] (texts.jsonl): weight 3" in line for line in logs)


@pytest.mark.parametrize(
    ("weights", "want"),
    [
        ((0.5, 0.5), (20, 13)),  # 25 texts x 0.5 = 12.5: half up to 13 (floor: 12)
        (
            (1.15, 2.5),
            (46, 63),
        ),  # 40 x 1.15 = 46 (1.15 - 1 is 0.1499... in binary: 45); 25 x 2.5 = 62.5 -> 63
        ((0.0125, 0.02), (1, 1)),  # half a row each: 1 (floor: 0, an error)
    ],
    ids=["half", "binary", "half-a-row"],
)
def test_prepared_rows_per_dataset_are_the_half_up_counts(workdir: Path, weights, want):
    """The rows each dataset has in the prepared training split, counted from the rows themselves, against
    counts worked out by hand (40 sums and 25 texts kept, nothing held out): rounding half up on the
    weight as written, which the project's own draw_count would not catch if it rounded otherwise."""
    from transformers import AutoTokenizer

    name = "half-" + "-".join(map(str, weights))
    prepared = prepare(_recipe(workdir, weights, name=name, val_set_size=0, sample_packing=False), log=_quiet)
    tok = AutoTokenizer.from_pretrained(workdir / "tokenizer")
    texts = Counter(
        tok.decode(seq, skip_special_tokens=True).startswith("the ") for seq in _sequences(prepared.train)
    )
    assert (texts[False], texts[True]) == want
    assert want == tuple(_expected_count(w, n) for w, n in zip(weights, (40, 25), strict=True))
    assert [d["rows_drawn"] for d in prepared.manifest["mixture"]] == list(want)


def test_packed_shares_match_the_packed_rows_and_do_not_depend_on_num_proc(workdir: Path):
    one = prepare(_recipe(workdir, (0.3, 2.5), name="np1", val_set_size=4), log=_quiet)
    two = prepare(_recipe(workdir, (0.3, 2.5), name="np2", val_set_size=4, dataset_num_proc=2), log=_quiet)
    assert one.path.name == two.path.name
    for split in ("train", "eval"):
        assert getattr(one, split)[:] == getattr(two, split)[:]
    m = one.manifest
    packed_trained = sum(sum(x != -100 for x in labels) for labels in one.train["labels"])
    assert sum(d["num_trained_tokens"] for d in m["mixture"]) == packed_trained == m["num_trainable_tokens"]
    assert sum(d["num_tokens"] for d in m["mixture"]) == m["num_tokens"]
    assert [d["rows_drawn"] for d in m["mixture"]] == [
        _expected_count(0.3, d["rows_train"]) if i == 0 else _expected_count(2.5, d["rows_train"])
        for i, d in enumerate(m["mixture"])
    ]


def test_changing_one_weight_keeps_the_other_datasets_draw(workdir: Path):
    unpacked = {"sample_packing": False}
    first = prepare(_recipe(workdir, (0.5, 1.0), name="w1", **unpacked), log=_quiet)
    second = prepare(_recipe(workdir, (0.5, 2.0), name="w2", **unpacked), log=_quiet)
    texts = {s for s, n in Counter(_sequences(second.train)).items() if n == 2}
    sums = [Counter(s for s in _sequences(p.train) if s not in texts) for p in (first, second)]
    assert sums[0] == sums[1] and sum(sums[0].values()) == 20
    other_seed = _recipe(workdir, (0.5, 2.0), name="w3", **unpacked).model_copy(deep=True)
    other_seed.train.seed = 7
    third = prepare(other_seed, log=_quiet)
    assert Counter(s for s in _sequences(third.train) if s not in texts) != sums[1]


def test_weight_one_prepares_the_rows_prepared_before_weights(workdir: Path):
    """Every weight 1: the same rows as datasets' own shuffle / concatenate / seeded split made."""
    recipe = _recipe(workdir, val_set_size=5)
    parts = [
        prepare_mod._Part(label, "train", ds)
        for label, ds in (
            ("a", datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(30)], "labels": [[-100, i] for i in range(30)]})),
            ("b", datasets.Dataset.from_dict({"input_ids": [[100 + i] for i in range(12)], "labels": [[-100] for _ in range(12)]})),
        )
    ]  # fmt: skip
    split = prepare_mod._merge_and_split(recipe, parts)
    seed = recipe.train.seed
    merged = datasets.concatenate_datasets([p.dataset.shuffle(seed=seed) for p in parts]).shuffle(seed=seed)
    perm = np.random.default_rng(seed).permutation(len(merged))
    assert split.train[:] == merged.select(np.sort(perm[5:]))[:]
    assert split.val[:] == merged.select(np.sort(perm[:5]))[:]
    assert split.rows_train.tolist() == np.bincount(split.train_sources).tolist()


def test_fingerprint_records_the_weight_and_weight_one_changes_nothing(workdir: Path):
    def fp(recipe) -> str:
        return compute_fingerprint(fingerprint_inputs(recipe))

    weighted = _recipe(workdir, (0.5, 1.0))
    assert fp(weighted) != fp(_recipe(workdir)) != fp(_recipe(workdir, (1.0, 2.0)))
    assert fingerprint_inputs(weighted)["datasets"][0]["settings"]["weight"] == 0.5
    assert "weight" not in fingerprint_inputs(weighted)["datasets"][1]["settings"]
    unweighted = _recipe(workdir).model_dump()
    for entry in unweighted["data"]["datasets"]:
        del entry["weight"]
    assert fp(validate_recipe(unweighted)) == fp(_recipe(workdir))


def test_a_weight_that_draws_nothing_is_an_error_and_a_poor_fit_a_warning(workdir: Path):
    with pytest.raises(DataError) as error:
        prepare(_recipe(workdir, (1.0, 0.01), name="zero"), log=_quiet)  # 0.25 rows -> 0
    assert re.match(
        r"data\.datasets\[1\]\.weight \(0\.01, .*texts\.jsonl\) draws 0 of the dataset's 25 ",
        str(error.value),
    )
    assert "raise the weight to at least 0.02 " in str(error.value)
    assert not list((workdir / "zero").rglob("manifest.json"))  # nothing written
    logs: list[str] = []
    prepare(_recipe(workdir, (1.0, 0.05), name="poor"), log=logs.append)  # 1.25 rows -> 1: 0.04
    assert any(line.startswith("warning: data.datasets[1].weight (0.05") and "0.04" in line for line in logs)


# ------------------------------------------------------------------------------- other kinds of data


def _demo_recipe(repo_root: Path, workdir: Path, entry: dict, objective: str, name: str, **extra):
    path = repo_root / "recipes" / "demo" / "data" / entry["path"]
    entries = [{**entry, "path": str(path), "weight": 0.25}, {**entry, "path": str(path), "weight": 1.5}]
    data = {"datasets": entries, "val_set_size": 8, "sequence_len": 128, "sample_packing_sequence_len": 512}
    train = {"objective": objective, **extra.get("train", {})}
    return _tiny_recipe(workdir, name, data, **{**extra, "train": train})


KINDS = {
    "preference": (
        {"path": "preferences.jsonl", "type": "preference", "apply_chat_template": True},
        "dpo",
        {},
    ),
    "kto": ({"path": "kto.jsonl", "type": "kto", "apply_chat_template": True}, "kto", {}),
    "prompt": (
        {"path": "prompts.jsonl", "type": "prompt", "field_prompt": "question", "apply_chat_template": True},
        "grpo",
        {
            "grpo": {"num_generations": 2, "rewards": [{"name": "exact_match", "field_expected": "answer"}]},
            "train": {"micro_batch_size": 2},
        },
    ),
}


@pytest.mark.parametrize("kind", KINDS)
def test_weights_apply_to_kto_examples_and_prompts(repo_root: Path, workdir: Path, kind: str):
    entry, objective, extra = KINDS[kind]
    prepared = prepare(
        _demo_recipe(repo_root, workdir, entry, objective, f"kind-{kind}", **extra), log=_quiet
    )
    m = prepared.manifest
    assert m["kind"] == kind
    drawn = [d["rows_drawn"] for d in m["mixture"]]
    assert drawn == [_expected_count(d["weight"], d["rows_train"]) for d in m["mixture"]]
    assert m["splits"]["train"]["examples"] == sum(drawn)
    if kind in ("preference", "kto"):  # pairs or examples packed several to a row, each once
        assert sum(prepared.train["num_units"]) == sum(drawn)
        assert sum(d["num_trained_tokens"] for d in m["mixture"]) == m["num_trainable_tokens"] > 0
    else:  # a prompt per row, nothing trained: the shares are of rows only
        assert len(prepared.train) == sum(drawn)
        assert [d["share_of_trained_tokens"] for d in m["mixture"]] == [None, None]
        assert [d["share_of_rows"] for d in m["mixture"]] == pytest.approx([x / sum(drawn) for x in drawn])
