"""The fingerprint of every demo recipe, pinned: moving or refactoring the code that computes it (what
identifies a source, the settings hashed per entry, the data section's) must not change it, or every
prepared cache would be rebuilt. A change that alters the prepared output changes it on purpose
(then bump FORMAT_VERSION and update these); so does regenerating the demo data or tokenizer (then
update the `files` column only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.data.prepare.cache import compute_fingerprint
from finetune.data.prepare.fingerprint import fingerprint_inputs
from finetune.recipe import load_recipe

# recipe -> (fingerprint of the recipe's settings alone, fingerprint with its data and tokenizer files)
PINNED = {
    "tiny_dpo_cpu.yaml": ("06cb603e49f9c70f", "ebf04f51deb9863d"),
    "tiny_grpo_cpu.yaml": ("96d3726b093837f2", "441b1ce9dd3a6005"),
    "tiny_grpo_env_cpu.yaml": ("96d3726b093837f2", "441b1ce9dd3a6005"),  # the same prompts as tiny_grpo_cpu
    "tiny_mix_cpu.yaml": ("eca9d69aa492d21f", "33ad359361a4f7b5"),
    "tiny_reward_cpu.yaml": ("788792903732197d", "b8399560408a693d"),
    "tiny_sft_cpu.yaml": ("e74cadbd8c0af1b0", "1ca646e6b1593f9a"),
    "tiny_sft_stream_cpu.yaml": ("1c9adb602626b907", "57ea59dd10261b44"),
    "tiny_vlm_cpu.yaml": ("19e6f86afb0bce94", "6ceb58aa20fc8e94"),
    "tiny_vlm_dpo_cpu.yaml": ("afb53e8e723e52ac", "0017fede09df8a72"),
    "tiny_vlm_grpo_cpu.yaml": ("caed553609236417", "550ca9379ae8c4c6"),
    "tiny_vlm_kto_cpu.yaml": ("4c22a312ef53dfd4", "a8e0f8786229e67b"),
}


def test_every_demo_recipe_is_pinned(repo_root: Path):
    assert sorted(PINNED) == sorted(p.name for p in (repo_root / "recipes" / "demo").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(PINNED))
def test_demo_recipe_fingerprint_is_unchanged(name: str, repo_root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(repo_root)  # the demo recipes' paths are relative to the repository root
    recipe = load_recipe(Path("recipes") / "demo" / name)
    settings, files = PINNED[name]
    assert compute_fingerprint(fingerprint_inputs(recipe, with_files=False)) == settings
    assert compute_fingerprint(fingerprint_inputs(recipe)) == files
