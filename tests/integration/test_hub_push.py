"""Pushing the trained adapter (and checkpoints with hub.strategy every_save) to the test Hub, the
token staying out of every output; and the model card's Hub metadata.

The push runs in this process (tests/inprocess.py); the outage is a subprocess (slow tier): the Hub
clients read HF_ENDPOINT once, at import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, snapshot_download
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.integration._run import (
    DEMO,
    accelerate_cmd,
    demo_overrides,
    progress,
    run,
    step_losses,
    train_here,
)


def _split(text: str) -> list[str]:
    """Overrides written as one string (no value holds a space)."""
    return text.split()


def _files_containing(root: Path, needles: list[bytes]) -> list[str]:
    """Every file under root (text or binary) whose bytes contain one of the needles."""
    return [str(p) for p in root.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in needles)]


def test_push_at_the_end_and_every_save_without_leaking_the_token(
    tmp_path, hub_server, hub_repo_id, demo_prepared
):
    token = hub_server.token
    needles = [token.encode(), token[3:19].encode()]  # the whole token, and a piece of it
    hub_server.clear_requests()
    result = train_here(
        DEMO,
        *demo_overrides(
            tmp_path,
            *_split(
                "--train.max_steps 4 --train.save_steps 2 --train.save_epochs 0 --train.eval_steps null "
                "--train.log_format structured --train.log_steps 1 --hub.model_id"
            ),
            hub_repo_id,
            "--hub.strategy",
            "every_save",
            "--data.dataset_prepared_path",
            str(demo_prepared),  # the session's (tests/conftest.py)
        ),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert sorted(step_losses(progress(out))) == [1, 2, 3, 4]
    assert f"pushed {out} to {hub_repo_id}" in result.stdout

    # Three authenticated commits: checkpoint step-2, checkpoint step-4, the final outputs.
    commits = hub_server.find_requests("POST", rf"/api/models/{hub_repo_id}/commit/")
    assert len(commits) == 3 and all(r.authenticated and r.status == 200 for r in commits)

    api = HfApi()
    assert api.model_info(hub_repo_id).private is True
    files = set(api.list_repo_files(hub_repo_id))
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "README.md",
        "tokenizer.json",
        "recipe.resolved.yaml",
        "progress.jsonl",
    ):
        assert name in files, name
    for step in (2, 4):  # every_save pushed both, although save_total_limit 1 keeps only one locally
        # A LoRA checkpoint holds the trained tensors only, not the frozen base.
        in_checkpoint = ("trainable_0.safetensors", "train_state.json", "checksums.json")
        assert {f"checkpoints/step-{step}/{n}" for n in in_checkpoint} <= files
        assert f"checkpoints/step-{step}/model.safetensors" not in files
    assert not (out / "checkpoints" / "step-2").exists()
    pushed = files - {".gitattributes"}  # created with the repo
    assert not any(f.startswith(("base_model/", ".")) or "/." in f for f in pushed), sorted(files)

    snapshot = Path(snapshot_download(hub_repo_id, local_dir=tmp_path / "snapshot"))
    assert (
        json.loads((snapshot / "checkpoints" / "step-4" / "train_state.json").read_text())["state"]["step"]
        == 4
    )
    base_dir = out / "base_model"  # a random-init base: it stays local (the adapter points at it)
    ids = torch.randint(4, 704, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_hub = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), snapshot).eval()
        local = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out).eval()
        torch.testing.assert_close(from_hub(input_ids=ids).logits, local(input_ids=ids).logits)
    card = (snapshot / "README.md").read_text()
    assert "library_name: peft" in card and "base_model:" not in card

    # The token was used (authenticated pushes above) but is written or printed nowhere.
    assert (
        token not in result.stdout + result.stderr
        and needles[1].decode() not in result.stdout + result.stderr
    )
    for name in ("progress.jsonl", "recipe.resolved.yaml", "README.md"):
        assert (out / name).is_file()
    assert _files_containing(out, needles) == []
    assert _files_containing(snapshot, needles) == []


@pytest.mark.slow  # subprocesses: the Hub clients read HF_ENDPOINT at import
def test_a_hub_outage_at_the_final_push_is_a_warning_and_the_outputs_stay(
    tmp_path, hub_server, hub_repo_id, demo_prepared
):
    """The Hub unreachable at the end: the finished run exits 0, its outputs intact, with the command that
    pushes them later; that command works once the Hub is back."""
    import socket
    import sys

    with socket.socket() as probe:  # a port nobody listens on: connections are refused at once
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    args = _split("--train.max_steps 2 --train.save_steps 0 --train.save_epochs 0 --train.eval_steps null")
    args += ["--data.dataset_prepared_path", str(demo_prepared)]  # the session's (tests/conftest.py)
    result = run(
        accelerate_cmd(DEMO, *demo_overrides(tmp_path, *args, "--hub.model_id", hub_repo_id)),
        extra_env={"HF_ENDPOINT": dead},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output[-4000:]
    out, kept = tmp_path / "out", tmp_path / "out" / "hub-upload"
    assert f"warning: hub: pushing the final outputs to {hub_repo_id} failed 3 times" in result.stdout
    command = f"hf upload {hub_repo_id} {kept} . --private"
    assert f"Push them later with: {command}" in result.stdout
    for name in ("adapter_model.safetensors", "README.md", "recipe.resolved.yaml"):
        assert (out / name).is_file() and (kept / name).is_file(), name
    assert progress(out)[-1] == {"step": 2, "event": "finished"}

    hf = Path(sys.executable).parent / "hf"  # huggingface_hub's CLI, beside this Python
    pushed = run([str(hf), *command.split()[1:]], quiet=False)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    files = set(HfApi().list_repo_files(hub_repo_id))
    assert {"adapter_model.safetensors", "README.md", "recipe.resolved.yaml"} <= files
