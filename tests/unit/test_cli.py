"""The `finetune` command: help, validate (resolved recipe, --explain, light imports), train launching."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

import finetune.cli as cli
import finetune.recipe as config
import finetune.recipe.schema as schema
from finetune.accelerate_config import ACCELERATE_CONFIGS, REPO_ROOT, list_configs, resolve_accelerate_config
from finetune.cli import TRAIN_SCRIPT, build_parser, explain_lines, launch_command, main
from finetune.errors import FinetuneError
from finetune.recipe import load_recipe, recipe_to_dict

SUBCOMMANDS = ["validate", "prepare-dataset", "train", "list-configs", "merge-lora"]
RECIPE = {
    "model": {"model_path": "org/base", "special_tokens": {"pad_token": "<pad>"}},
    "data": {
        "datasets": [{"path": "a.jsonl", "type": "alpaca"}, {"path": "b.jsonl", "type": "chat_template"}]
    },
    "train": {"output_dir": "out", "lr": 3e-5},
}
CONFIG_NAMES = sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))


@pytest.fixture
def recipe_path(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    return path


class Exec(Exception):
    """Raised by the fake launcher: `finetune train` got as far as launching."""


@pytest.fixture
def fake_execv(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []

    def launch(argv: list[str], env: dict) -> int:
        calls.append(list(argv))
        raise Exec

    monkeypatch.setattr(cli, "run_supervised", launch)
    return calls


# ------------------------------------------------------------------------------------------- help


def test_top_level_help_lists_subcommands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help(name: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: finetune {name}")
    if name in ("validate", "prepare-dataset", "train"):
        assert "--section.field" in out  # how to override


def test_train_help_mentions_config_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--accelerate-config" in out and "--list-configs" in out


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: finetune" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "r.yaml", "--explain"],
        ["prepare-dataset", "r.yaml", "--push"],
        ["train", "r.yaml", "--accelerate-config", "x"],
        ["list-configs"],
        ["merge-lora", "adapter", "--output", "out", "--dtype", "bf16"],
    ],
)
def test_parser_knows_every_subcommand(argv: list[str]) -> None:
    args, extra = build_parser().parse_known_args([*argv, "--train.seed", "1"])
    assert args.command == argv[0] and extra == ["--train.seed", "1"]


# --------------------------------------------------------------------------------------- validate


def test_validate_prints_the_resolved_recipe(recipe_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(recipe_path)]) == 0
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert printed == recipe_to_dict(load_recipe(recipe_path))
    # Defaults the file does not set are filled in.
    assert printed["train"]["seed"] == 42 and printed["data"]["sample_packing_group_size"] == 100_000
    assert printed["data"]["datasets"][1]["roles_to_train"] == ["assistant"]
    assert printed["lora"]["lora_target_modules"] == "all-linear" and printed["hub"]["strategy"] == "end"
    assert f"{recipe_path}: valid" in err


def test_validate_applies_overrides(recipe_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["validate", str(recipe_path), "--train.lr", "1e-4", "--data.datasets.1.path=c.jsonl"]
    assert main([*args, "--lora.enable_lora", "true", "--lora.modules_to_save", "[lm_head]"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["lr"] == 1e-4 and printed["data"]["datasets"][1]["path"] == "c.jsonl"
    assert printed["lora"]["enable_lora"] is True


def test_validate_explain_prints_descriptions(recipe_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(recipe_path), "--explain"]) == 0
    out = capsys.readouterr().out
    recipe = load_recipe(recipe_path)
    # Still the resolved recipe: comments are YAML comments.
    assert yaml.safe_load(out) == recipe_to_dict(recipe)
    comments = {line.strip()[2:] for line in out.splitlines() if line.strip().startswith("# ")}
    for section_name, section_field in config.Recipe.model_fields.items():
        assert section_field.description in comments, section_name
        if getattr(recipe, section_name) is None:  # an optional section left out (diffusion)
            continue
        section_cls = next(
            a
            for a in (section_field.annotation, *typing.get_args(section_field.annotation))
            if hasattr(a, "model_fields")
        )
        for name, field in section_cls.model_fields.items():
            assert field.description in comments, f"{section_name}.{name}"
    # Dataset entries are explained too (the fields of their type), and the description sits right
    # above its field.
    for i, entry in enumerate(recipe.data.datasets):
        for name, field in type(entry).model_fields.items():
            assert field.description in comments, f"data.datasets[{i}].{name}"
    lines = out.splitlines()
    at = lines.index("  # Training datasets, merged in order.")
    assert lines[at + 1] == "  datasets:"
    assert lines[at + 2].strip() == "-"
    path_field = type(recipe.data.datasets[0]).model_fields["path"]
    assert lines[at + 3].strip() == f"# {path_field.description}"
    assert lines[at + 4].strip() == "path: a.jsonl"


def test_explain_lines_match_print(recipe_path: Path) -> None:
    lines = explain_lines(load_recipe(recipe_path))
    assert lines[0] == f"# {config.Recipe.model_fields['model'].description}"
    assert lines[1] == "model:"


def test_validate_bad_override_is_exit_2(recipe_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(recipe_path), "--train.lrr", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown override --train.lrr" in err and "did you mean 'train.lr'" in err
    assert "Traceback" not in err


def test_validate_not_supported_yet(recipe_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.setattr(
        schema,
        "NOT_SUPPORTED_YET",
        {
            "train.gradient_checkpointing": "lands with FSDP2",
            "data.datasets.*.max_seq_len": "per-dataset length",
        },
    )
    assert main(["validate", str(recipe_path)]) == 0  # defaults are fine
    capsys.readouterr()
    args = ["--train.gradient_checkpointing", "true", "--data.datasets.1.max_seq_len", "64"]
    assert main(["validate", str(recipe_path), *args]) == 2
    err = capsys.readouterr().err
    assert (
        "train.gradient_checkpointing (from --train.gradient_checkpointing): got True: "
        "not supported yet (lands with FSDP2)" in err
    )
    assert (
        "data.datasets[1].max_seq_len (from --data.datasets.1.max_seq_len): got 64: not supported yet" in err
    )
    assert "datasets[0].max_seq_len" not in err


@pytest.mark.slow  # a fresh interpreter (a subprocess)
def test_validate_does_not_import_heavy_libraries(recipe_path: Path) -> None:
    code = (
        "import sys\n"
        "from finetune.cli import main\n"
        f"assert main(['validate', {str(recipe_path)!r}, '--explain']) == 0\n"
        f"assert main(['validate', {str(recipe_path)!r}, '--train.seed', 'x']) == 2\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'accelerate', 'peft') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow  # a fresh interpreter (a subprocess)
def test_console_entry_exit_code_and_no_traceback(recipe_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "validate", str(recipe_path), "--train.seed", "abc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "train.seed (from --train.seed): got 'abc'" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- accelerate configs


def test_shipped_configs_exist() -> None:
    assert CONFIG_NAMES, f"no accelerate configs in {ACCELERATE_CONFIGS}"


@pytest.mark.parametrize("spelling", ["{name}", "{name}.yaml"])
def test_resolve_config_by_name(spelling: str) -> None:
    name = CONFIG_NAMES[0]
    assert resolve_accelerate_config(spelling.format(name=name)) == ACCELERATE_CONFIGS / f"{name}.yaml"


def test_resolve_config_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("distributed_type: 'NO'\n")
    assert resolve_accelerate_config(str(path)) == path
    monkeypatch.chdir(tmp_path)
    assert resolve_accelerate_config("mine.yaml") == Path("mine.yaml")


def test_resolve_config_none() -> None:
    assert resolve_accelerate_config(None) is None


def test_resolve_unknown_config_lists_the_names() -> None:
    with pytest.raises(FinetuneError) as info:
        resolve_accelerate_config("zero9")
    message = str(info.value)
    assert "'zero9'" in message and f"available: {', '.join(CONFIG_NAMES)}" in message


def test_list_configs() -> None:
    rows = list_configs()
    assert [name for name, _ in rows] == CONFIG_NAMES
    for name, description in rows:
        first = (ACCELERATE_CONFIGS / f"{name}.yaml").read_text().splitlines()[0]
        assert description == (first[1:].strip() if first.startswith("#") else description)


@pytest.mark.parametrize("argv", [["list-configs"], ["train", "--list-configs"]])
def test_list_configs_commands(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == CONFIG_NAMES


def test_list_configs_rejects_stray_arguments(capsys: pytest.CaptureFixture) -> None:
    assert main(["list-configs", "--train.lr", "1"]) == 2
    assert "unexpected arguments" in capsys.readouterr().err


def test_train_needs_a_recipe(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2
    assert "recipe" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ launching


@pytest.fixture
def gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine with GPUs: the shipped multi-GPU configs pass the pre-launch checks."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_launch_command_with_config() -> None:
    config_path = ACCELERATE_CONFIGS / f"{CONFIG_NAMES[0]}.yaml"
    cmd = launch_command("r.yaml", ["--train.lr", "1e-4", "--train.seed=3"], config_path)
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert cmd[3:5] == ["--config_file", str(config_path)]
    # One machine, no port given: accelerate picks a free one (not 29500), so runs side by side do not collide.
    assert cmd[5:7] == ["--main_process_port", "0"]
    assert cmd[7:] == [str(TRAIN_SCRIPT), "r.yaml", "--train.lr", "1e-4", "--train.seed=3"]
    assert TRAIN_SCRIPT.is_file()


def test_launch_command_keeps_a_given_port() -> None:
    given = launch_command("r.yaml", [], ACCELERATE_CONFIGS / "zero2.yaml", {"main_process_port": 29501})
    assert given[given.index("--main_process_port") + 1] == "29501"
    multi_node = launch_command("r.yaml", [], ACCELERATE_CONFIGS / "multi_node.yaml")
    assert "--main_process_port" not in multi_node  # the config's port: every machine must agree on it


def test_launch_command_without_config_is_one_process() -> None:
    cmd = launch_command("r.yaml", [], None)
    assert "--config_file" not in cmd
    assert cmd[cmd.index("--num_processes") + 1] == "1"
    assert cmd[-2:] == [str(TRAIN_SCRIPT), "r.yaml"]


def test_train_execs_accelerate_launch(recipe_path: Path, fake_execv: list, capsys, gpu_node) -> None:
    name = "zero2"
    with pytest.raises(Exec):
        main(["train", str(recipe_path), "--accelerate-config", name, "--train.seed", "3"])
    expected = launch_command(str(recipe_path), ["--train.seed", "3"], ACCELERATE_CONFIGS / f"{name}.yaml")
    assert fake_execv == [expected]
    assert "+ " + " ".join(expected) in capsys.readouterr().err


def test_train_uses_the_recipe_accelerate_config(recipe_path: Path, fake_execv: list, gpu_node) -> None:
    name = "zero3"
    with pytest.raises(Exec):
        main(["train", str(recipe_path), "--train.accelerate_config", name])
    assert fake_execv[0][3:5] == ["--config_file", str(ACCELERATE_CONFIGS / f"{name}.yaml")]
    # The flag wins over the recipe.
    with pytest.raises(Exec):
        main(
            [
                "train",
                str(recipe_path),
                "--accelerate-config",
                "multi_gpu",
                "--train.accelerate_config",
                name,
            ]
        )
    assert fake_execv[1][3:5] == ["--config_file", str(ACCELERATE_CONFIGS / "multi_gpu.yaml")]


def test_train_without_config_runs_one_process(recipe_path: Path, fake_execv: list) -> None:
    with pytest.raises(Exec):
        main(["train", str(recipe_path)])
    # The recipe's mixed precision is passed on, so accelerate launch has no default to warn about.
    assert fake_execv == [launch_command(str(recipe_path), [], None, mixed_precision="bf16")]
    assert fake_execv[0][fake_execv[0].index("--mixed_precision") + 1] == "bf16"


def test_train_unknown_config_is_exit_2(recipe_path: Path, fake_execv: list, capsys) -> None:
    assert main(["train", str(recipe_path), "--accelerate-config", "zero9"]) == 2
    err = capsys.readouterr().err
    assert "'zero9'" in err and f"available: {', '.join(CONFIG_NAMES)}" in err
    assert fake_execv == []


def test_train_validates_before_launching(recipe_path: Path, fake_execv: list, capsys) -> None:
    assert main(["train", str(recipe_path), "--train.lr", "-1"]) == 2
    assert "train.lr (from --train.lr)" in capsys.readouterr().err
    assert fake_execv == []


def test_merge_lora_takes_no_overrides(capsys: pytest.CaptureFixture) -> None:
    assert main(["merge-lora", "adapter", "--output", "out", "--train.lr", "1"]) == 2
    assert "merge-lora takes no recipe overrides" in capsys.readouterr().err


def test_multi_cpu_config_launches_through_torchrun():
    """accelerate launch starts one process for CPU configs; torchrun gives a real 2-process run."""
    cmd = launch_command("r.yaml", ["--train.seed", "3"], ACCELERATE_CONFIGS / "multi_cpu.yaml")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    assert cmd[-3:] == ["r.yaml", "--train.seed", "3"]


def test_launch_options_reach_accelerate_launch(recipe_path: Path, fake_execv: list, gpu_node) -> None:
    args = ["--num-processes", "16", "--num-machines", "2", "--machine-rank", "1"]
    args += ["--main-process-ip", "node0", "--main-process-port", "29501"]
    with pytest.raises(Exec):
        main(["train", str(recipe_path), "--accelerate-config", "zero3", *args, "--train.seed", "3"])
    cmd = fake_execv[0]
    expected = {
        "--num_processes": "16",
        "--num_machines": "2",
        "--machine_rank": "1",
        "--main_process_ip": "node0",
        "--main_process_port": "29501",
    }
    for flag, value in expected.items():
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd.index("--main_process_port") < cmd.index(str(TRAIN_SCRIPT))
    assert cmd[-2:] == ["--train.seed", "3"]  # recipe overrides pass through untouched


def test_multi_cpu_num_processes_override() -> None:
    cmd = launch_command("r.yaml", [], ACCELERATE_CONFIGS / "multi_cpu.yaml", {"num_processes": 3})
    assert cmd[3:5] == ["--nproc_per_node", "3"]


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_offload", "fsdp2_hybrid", "multi_node"])
def test_train_refuses_fsdp_without_gpu(
    recipe_path: Path, fake_execv: list, capsys, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", str(recipe_path), "--accelerate-config", name]) == 2
    err = capsys.readouterr().err
    assert f"{name}.yaml: FSDP in Accelerate needs CUDA GPUs" in err and "use multi_cpu" in err
    assert fake_execv == []


def test_train_refuses_optimizer_offload_without_adamw(
    recipe_path: Path, fake_execv: list, capsys, gpu_node
) -> None:
    args = ["--train.optimizer", "sgd"]
    assert main(["train", str(recipe_path), "--accelerate-config", "zero3_offload", *args]) == 2
    err = capsys.readouterr().err
    assert "zero3_offload.yaml: optimizer offload runs DeepSpeed's CPU Adam" in err
    assert "set train.optimizer: adamw (not sgd)" in err
    assert fake_execv == []


def test_slurm_script_uses_real_train_options(recipe_path: Path, fake_execv: list, monkeypatch) -> None:
    """docs/slurm/finetune.sbatch passes only options `finetune train` has, and they reach the launcher."""
    import re

    import torch

    script = (REPO_ROOT / "docs" / "slurm" / "finetune.sbatch").read_text()
    used = set(re.findall(r"(--[a-z][a-z-]+) ", script.split("srun", 1)[1]))
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    known = {opt for action in train_parser._actions for opt in action.option_strings}
    assert used and used <= known, used - known
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node
    config = re.search(r"CONFIG=\$\{CONFIG:-(\w+)\}", script).group(1)
    args = ["--num-machines", "2", "--num-processes", "16", "--machine-rank", "1"]
    args += ["--main-process-ip", "node0", "--main-process-port", "29500"]
    with pytest.raises(Exec):
        main(["train", str(recipe_path), "--accelerate-config", config, *args])
    assert fake_execv[0][fake_execv[0].index("--machine_rank") + 1] == "1"


def test_train_refuses_multi_process_deepspeed_without_gpus(
    recipe_path: Path, fake_execv: list, capsys, monkeypatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", str(recipe_path), "--accelerate-config", "zero3", "--num-processes", "2"]) == 2
    assert "DeepSpeed without GPUs runs one process, not 2" in capsys.readouterr().err
    assert fake_execv == []
    with pytest.raises(Exec):  # one process is what runs on CPU
        main(["train", str(recipe_path), "--accelerate-config", "zero3", "--num-processes", "1"])


def test_checkpoints_lists_steps_status_and_the_auto_pick(tmp_path: Path, capsys) -> None:
    import json as _json

    from finetune.checkpoint import CHECKSUMS_FILE, STATE_FILE, checksums

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        folder = root / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 2048)
        (folder / STATE_FILE).write_text(_json.dumps({"state": {"step": step}}))
        (folder / CHECKSUMS_FILE).write_text(_json.dumps(checksums(folder)))
    (root / "step-4" / "model.safetensors").write_bytes(b"cut")
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "size", "auto", "status"]
    assert lines[1].split()[0] == "2" and "<-" in lines[1] and lines[1].endswith("verifies")
    assert lines[2].split()[0] == "4" and "DAMAGED:" in lines[2] and "has 3 bytes" in lines[2]
    assert lines[3] == f"--train.load_checkpoint_path auto resumes from {root / 'step-2'}"
    assert main(["checkpoints", str(tmp_path / "none")]) == 1
    assert "no checkpoints in" in capsys.readouterr().out
