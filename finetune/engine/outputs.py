"""What a run writes besides checkpoints: the progress record of a step, trackers, the profiler trace,
and the final Hub push."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from finetune import trackers
from finetune.metrics import ProgressLog, host_peak_rss_gib, peak_memory_gib


def log_step(run, result: dict, interval: dict, log: ProgressLog) -> None:
    """One progress.jsonl record (and tracker scalars) for the steps since the last one."""
    acc, st = run.accelerator, run.state
    # Time spent evaluating and checkpointing during the interval ("paused") is not training time.
    elapsed = max(time.perf_counter() - interval["t0"] - interval.get("paused", 0.0), 1e-9)
    st.train_seconds += elapsed
    counts = {k: v for k, v in interval.items() if k not in ("t0", "paused")}
    record = {
        "step": st.step,
        "epoch": st.epoch + st.micro_step_in_epoch / max(len(run.train_loader), 1),
        "loss": result.get("loss"),
        "lr": result["lr"],
        "grad_norm": result.get("grad_norm"),
        **result.get("metrics", {}),
        **run.objective.log_fields(counts, elapsed, st.totals),
        "peak_mem_gib": peak_memory_gib(acc.device),
        "host_rss_gib": host_peak_rss_gib(),
        "fp16_skipped_steps": st.fp16_skipped_steps if run.train.mixed_precision == "fp16" else None,
        "loss_scale": acc.scaler.get_scale() if acc.scaler is not None else None,
        "nonfinite_steps": st.nonfinite_steps,
    }
    log.log(record)
    trackers.log_scalars(acc, record, st.step)
    interval.clear()
    interval["t0"] = time.perf_counter()


def flat(data: dict, prefix: str = "") -> dict:
    """Nested settings as one level of dotted keys with scalar values (what trackers accept)."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def start_profiler(acc):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if acc.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
    profiler.__enter__()
    return profiler


def stop_profiler(profiler, run) -> None:
    profiler.__exit__(None, None, None)
    trace_dir = run.output_dir / run.train.profile_trace_dir
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"trace_rank{run.accelerator.process_index}.json"
    profiler.export_chrome_trace(str(path))
    run.accelerator.print(f"profiler trace written to {path}")


def push_final(run, extra_files: list[Path] = (), *, attempts: int = 3, wait_s: float = 2.0) -> str | None:
    """Upload the final outputs: the top-level files of output_dir (adapter or model, tokenizer, card,
    resolved recipe, progress log) plus `extra_files` under output_dir (the diffusion samples the card
    shows); not checkpoints/, base_model/, the trace or tracker folders. Returns the commit sha.

    They are hard-linked (copied where links fail) into a staging folder beside them, so nothing
    large is copied and push_folder uploads exactly that set. A Hub that stays unreachable is a
    warning, not a failure of the finished run (returns None): the staging folder is kept as
    output_dir/hub-upload and the warning gives the command that pushes it later.
    """
    from finetune.hub import push_folder
    from finetune.notices import warn

    hub = run.hub
    files = [
        path
        for path in sorted(run.output_dir.iterdir())
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(".lock")
    ]
    staging = Path(tempfile.mkdtemp(dir=run.output_dir, prefix=".hub-upload-"))
    try:
        for path in [*files, *extra_files]:
            target = staging / Path(path).relative_to(run.output_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
        sha, error = push_with_retries(
            lambda: push_folder(
                staging, hub.model_id, private=hub.private, commit_message=f"finetune: step {run.state.step}"
            ),
            attempts=attempts,
            wait_s=wait_s,
        )
        if error is not None:
            kept = run.output_dir / "hub-upload"
            shutil.rmtree(kept, ignore_errors=True)  # an earlier failed push's copy of older files
            os.replace(staging, kept)
            warn(
                f"hub: pushing the final outputs to {hub.model_id} failed {attempts} times ({type(error).__name__}: "
                f"{error}); the run is complete and its outputs are in {run.output_dir}. Push them later "
                f"with: {push_later_command(hub.model_id, kept, private=hub.private)}",
                emit=run.accelerator.print,
            )
            return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    run.accelerator.print(f"pushed {run.output_dir} to {hub.model_id} (commit {sha})")
    return sha


def push_with_retries(push, *, attempts: int, wait_s: float):
    """(push(), None), retrying `attempts` times with a growing wait; (None, the last error) when every
    attempt failed. Network, HTTP and Hub errors alike: a push never stops or fails a run."""
    for attempt in range(1, attempts + 1):
        try:
            return push(), None
        except Exception as exc:
            if attempt == attempts:
                return None, exc
            time.sleep(wait_s * attempt)
    return None, None


def push_later_command(repo_id: str, folder: Path, *, private: bool) -> str:
    """The huggingface_hub CLI command that uploads `folder` as the repository's top level.

    >>> push_later_command("me/run", Path("out/hub-upload"), private=True)
    'hf upload me/run out/hub-upload . --private'
    """
    return f"hf upload {repo_id} {folder} ." + (" --private" if private else "")
