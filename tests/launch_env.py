"""The environment `accelerate launch` gives training processes, from Accelerate's own launcher code."""

from __future__ import annotations

from finetune.accelerate_config import ACCELERATE_CONFIGS


def launch_env(name: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file <name>` gives the training processes, from
    Accelerate's own launcher code (nothing is started)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(ACCELERATE_CONFIGS / f"{name}.yaml"), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    env["WORLD_SIZE"] = str(args.num_processes)
    return env
