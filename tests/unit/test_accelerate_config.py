"""Reading accelerate configs into an DistributedSetup: plain, FSDP and DeepSpeed configs, with Accelerate's
defaults and the command line's process counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.accelerate_config import (
    ACCELERATE_CONFIGS,
    DistributedSetup,
    read_accelerate_config,
    setup_from_env,
)
from finetune.errors import FinetuneError
from finetune.plan import States, shard_states
from tests.launch_env import launch_env

P = 7_500_000_000


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _deepspeed(path: Path, section: str, *, num_processes: int | None = None) -> Path:
    """A DeepSpeed accelerate config whose deepspeed_config holds `section` (indented lines)."""
    processes = "" if num_processes is None else f"num_processes: {num_processes}\n"
    return _write(path, f"distributed_type: DEEPSPEED\n{processes}deepspeed_config:\n{section}")


def test_engine_defaults_and_plain_configs(tmp_path):
    assert read_accelerate_config(None) == DistributedSetup()
    assert read_accelerate_config(None, num_processes=4).kind == "ddp"
    ddp = read_accelerate_config(
        _write(tmp_path / "a.yaml", "distributed_type: MULTI_GPU\nnum_processes: 8\n")
    )
    assert (ddp.kind, ddp.num_processes, ddp.shard_degree) == ("ddp", 8, 1)
    cpu = read_accelerate_config(
        _write(tmp_path / "b.yaml", "distributed_type: MULTI_CPU\nnum_processes: 2\n")
    )
    assert cpu.use_cpu and cpu.kind == "ddp"
    single = read_accelerate_config(_write(tmp_path / "c.yaml", 'distributed_type: "NO"\nnum_processes: 1\n'))
    assert single.kind == "single"
    with pytest.raises(FinetuneError, match="TPU"):
        read_accelerate_config(_write(tmp_path / "d.yaml", "distributed_type: TPU\n"))
    with pytest.raises(FinetuneError, match="multiple of --num-nodes"):
        read_accelerate_config(None, num_processes=3, num_machines=2)


def test_engine_fsdp(tmp_path):
    base = "distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nfsdp_config:\n  fsdp_version: 2\n"
    full = read_accelerate_config(_write(tmp_path / "f.yaml", base + "  fsdp_reshard_after_forward: true\n"))
    assert (full.name, full.shard_degree) == ("fsdp2", 16)
    offload = read_accelerate_config(_write(tmp_path / "o.yaml", base + "  fsdp_offload_params: true\n"))
    assert offload.offload_params == offload.offload_optimizer == "cpu"
    assert offload.name == "fsdp2_offload"
    hsdp = base + (
        "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 8\n"
    )
    hybrid = read_accelerate_config(_write(tmp_path / "h.yaml", hsdp))
    assert (hybrid.name, hybrid.shard_degree) == ("fsdp2_hybrid", 8)
    strategy = read_accelerate_config(
        _write(tmp_path / "s.yaml", base + "  fsdp_sharding_strategy: HYBRID_SHARD\n")
    )
    assert strategy.hybrid and strategy.shard_degree == 8  # GPUs per node
    assert read_accelerate_config(tmp_path / "s.yaml", num_processes=32, num_machines=4).shard_degree == 8
    grad_op = read_accelerate_config(
        _write(tmp_path / "g.yaml", base + "  fsdp_reshard_after_forward: false\n")
    )
    assert grad_op.zero_stage == 2
    assert read_accelerate_config(tmp_path / "f.yaml", num_processes=4, num_machines=1).shard_degree == 4


def test_engine_deepspeed_inline_and_json(tmp_path):
    section = "  zero_stage: 2\n  offload_optimizer_device: cpu\n  offload_param_device: none\n"
    inline = read_accelerate_config(_deepspeed(tmp_path / "z2.yaml", section, num_processes=8))
    assert (inline.zero_stage, inline.offload_optimizer, inline.offload_params) == (2, "cpu", "none")
    assert inline.name == "zero2_offload"
    (tmp_path / "ds").mkdir()
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}
    _write(
        tmp_path / "ds" / "zero3.json", json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": zero})
    )
    section = "  deepspeed_config_file: ds/zero3.json\n  zero3_init_flag: true\n"
    from_file = read_accelerate_config(_deepspeed(tmp_path / "z3.yaml", section, num_processes=8))
    assert (from_file.zero_stage, from_file.offload_optimizer, from_file.offload_params) == (3, "cpu", "nvme")
    parts = {p.name: p for p in shard_states(States(P, 2 * P, 2 * P, 12 * P), from_file)}
    assert parts["weights"].nvme_bytes == 2 * P / 8 and parts["weights"].host_bytes == 0
    _deepspeed(tmp_path / "bad.yaml", "  deepspeed_config_file: nope.json\n")
    with pytest.raises(FinetuneError, match=r"nope\.json.*not found"):
        read_accelerate_config(tmp_path / "bad.yaml")
    _deepspeed(tmp_path / "p.yaml", "  zero_stage: 2\n  offload_param_device: cpu\n")
    with pytest.raises(FinetuneError, match="stage 3"):
        read_accelerate_config(tmp_path / "p.yaml")


# ------------------------------------------------------------------------------- shipped configs


EXPECTED = {
    "single_gpu": dict(kind="single"),
    "multi_gpu": dict(kind="ddp", num_processes=8),
    "multi_cpu": dict(kind="ddp", num_processes=2, use_cpu=True),
    "fsdp2": dict(kind="fsdp", fsdp_version=2, offload_params="none", hybrid=False),
    "fsdp2_offload": dict(kind="fsdp", fsdp_version=2, offload_params="cpu"),
    "fsdp2_hybrid": dict(kind="fsdp", fsdp_version=2, hybrid=True, num_machines=2, num_processes=16),
    "multi_node": dict(kind="fsdp", fsdp_version=2, num_machines=2, num_processes=16),
    "zero1": dict(kind="deepspeed", zero_stage=1, offload_optimizer="none", offload_params="none"),
    "zero2": dict(kind="deepspeed", zero_stage=2, offload_optimizer="none"),
    "zero2_offload": dict(kind="deepspeed", zero_stage=2, offload_optimizer="cpu", offload_params="none"),
    "zero3": dict(kind="deepspeed", zero_stage=3, offload_optimizer="none", offload_params="none"),
    "zero3_offload": dict(kind="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_params="cpu"),
}


def test_every_shipped_config_is_described_here():
    assert sorted(EXPECTED) == sorted(p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_read_shipped_config(name: str):
    engine = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
    for field, value in EXPECTED[name].items():
        assert getattr(engine, field) == value, field
    if engine.kind == "deepspeed":
        assert engine.ds_config_path == (ACCELERATE_CONFIGS / "deepspeed" / f"{name}.json").resolve()


def test_offload_without_an_engine_is_refused(tmp_path: Path):
    path = tmp_path / "ddp_offload.yaml"
    path.write_text(
        "distributed_type: MULTI_GPU\nnum_processes: 2\nfsdp_config:\n  fsdp_offload_params: true\n"
    )
    with pytest.raises(FinetuneError) as info:
        read_accelerate_config(path)
    message = str(info.value)
    assert str(path) in message and "fsdp_offload_params" in message and "MULTI_GPU" in message
    assert "zero2_offload, zero3_offload or fsdp2_offload" in message


def test_deepspeed_json_found_beside_the_config(tmp_path: Path):
    (tmp_path / "my.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    path = tmp_path / "ds.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: my.json\n")
    engine = read_accelerate_config(path)
    assert engine.zero_stage == 2 and engine.ds_config_path == (tmp_path / "my.json").resolve()
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: missing.json\n")
    with pytest.raises(FinetuneError, match=r"deepspeed_config_file 'missing\.json' not found"):
        read_accelerate_config(path)


@pytest.mark.parametrize(
    "name", [n for n in sorted(EXPECTED) if EXPECTED[n]["kind"] in ("fsdp", "deepspeed")]
)
def test_launch_environment_describes_the_same_engine(name: str):
    from_file = read_accelerate_config(ACCELERATE_CONFIGS / f"{name}.yaml")
    from_env = setup_from_env(launch_env(name))
    for field in (
        "kind",
        "zero_stage",
        "offload_optimizer",
        "offload_params",
        "fsdp_version",
        "hybrid",
    ):
        assert getattr(from_env, field) == getattr(from_file, field), field
    assert from_env.num_processes == from_file.num_processes
