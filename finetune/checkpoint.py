"""Checkpoints: `accelerator.save_state` plus our train state, written atomically and verifiable.

Layout: output_dir/checkpoints/step-N/ (accelerate state + train_state.json + recipe.resolved.yaml +
checksums.json) and output_dir/checkpoints/latest (a text file naming the newest complete
checkpoint). A checkpoint is built in a temporary folder and renamed into place; `latest` is replaced
only after that, so a run killed mid-save never leaves a half-written checkpoint that resume would
pick.

checksums.json records every file's size and xxh3-128 digest when the checkpoint is written (by the
main process, over the files it can see: on several machines without a shared filesystem, its own).
Resume verifies them: `auto` takes the newest checkpoint that verifies and says which ones it skipped
and why; an explicit path that fails is an error naming the file. A truncated copy, a flipped bit or
a missing RNG file is caught before anything loads.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import FinetuneError, write_error, write_failure_reason
from finetune.notices import warn

if TYPE_CHECKING:
    import torch

STATE_FILE = "train_state.json"
CHECKSUMS_FILE = "checksums.json"
PAUSE_ENV = "FINETUNE_CHECKPOINT_PAUSE_STEP"
_STEP_NAME = re.compile(r"step-(\d+)")
_CHUNK = 8 * 2**20


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    step: int,
    train_state: dict[str, Any],
    recipe_yaml: str,
    *,
    total_limit: int | None,
    keep: Path | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Save model/optimizer/scheduler/RNG state and our train state as checkpoints/step-<step>.

    Every process must call this (sharded engines save from every rank); only the main process
    writes the train state, `write_extra(folder)` (states kept besides accelerate's), the checksums,
    renames, updates `latest` and rotates (never deleting `keep`). A full disk
    or an unwritable folder is a FinetuneError saying that the previous checkpoints are intact.
    """
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    try:
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        save_rng_state(tmp, accelerator.process_index)  # every process its own (not accelerate's pickle)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(train_state, indent=2))
            (tmp / "recipe.resolved.yaml").write_text(recipe_yaml)
            if write_extra is not None:
                write_extra(tmp)
            _test_pause(tmp, step)
            write_checksums(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_atomic(root / "latest", final.name + "\n")
            if total_limit:
                rotate(root, keep=total_limit, protect=keep)
    except BaseException as exc:
        # Whatever stopped the save, the half-written folder goes (it would fill the disk, and the
        # next save of this step would have to remove it); the complete checkpoints are untouched.
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if write_failure_reason(exc) is None:
            raise
        raise write_error(
            exc,
            f"writing checkpoint {final}",
            root,
            f"The checkpoints already in {root} are intact and the partial one was removed; free space "
            "(or fix the folder's permissions), or choose another train.output_dir, then resume with "
            "--train.load_checkpoint_path auto",
        ) from None
    accelerator.wait_for_everyone()
    return final


def _test_pause(folder: Path, step: int) -> None:
    """Tests only (FINETUNE_CHECKPOINT_PAUSE_STEP=N): hold the write of checkpoint step-N open for up
    to a minute, its files written but not yet recorded or renamed into place, so that a test can kill
    the run at that very moment."""
    from finetune.notices import hold_for_test

    if os.environ.get(PAUSE_ENV) == str(step):
        hold_for_test("checkpoint", 60, detail=f"writing {folder}")


# ------------------------------------------------------------------------------------- checksums


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, read in chunks (fast enough to hash a 16 GB checkpoint in seconds)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(folder: Path, files: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {size, xxh3_128}} for `files` (default: every file under `folder` except
    checksums.json)."""
    if files is None:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / CHECKSUMS_FILE)
    out = {}
    for path in files:
        out[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "xxh3_128": file_digest(path),
        }
    return out


def write_checksums(folder: Path, files: list[Path] | None = None) -> None:
    """folder/checksums.json for `files` (default: every file in the folder), written atomically."""
    _write_atomic(folder / CHECKSUMS_FILE, json.dumps(checksums(folder, files), indent=1, sort_keys=True))


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete and every recorded file matches; else why not (one line,
    naming the file)."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    if not (folder / STATE_FILE).is_file():
        return f"{folder / STATE_FILE} is missing (the checkpoint was not finished)"
    if not (folder / CHECKSUMS_FILE).is_file():
        return (
            f"{folder / CHECKSUMS_FILE} is missing (written by an older finetune, or not finished): it "
            "cannot be verified"
        )
    return verify_checksums(folder)


def verify_checksums(folder: Path) -> str | None:
    """None when `folder` has no checksums.json or every file it records matches; else why not (one
    line, naming the file)."""
    record = folder / CHECKSUMS_FILE
    if not record.is_file():
        return None
    try:
        expected = json.loads(record.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"{record} is damaged ({exc})"
    if not isinstance(expected, dict) or not all(
        isinstance(w, dict) and {"size", "xxh3_128"} <= w.keys() for w in expected.values()
    ):
        return f"{record} is damaged (not a record of file sizes and digests)"
    for rel, want in expected.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path} has {size:,} bytes, {want['size']:,} were written (truncated or replaced)"
        if file_digest(path) != want["xxh3_128"]:
            return f"{path} does not match its checksum (its bytes changed after it was written)"
    return None


# ----------------------------------------------------------------------------------- final outputs


def file_stamps(folder: Path) -> dict[str, tuple[int, int, int]]:
    """{name: (mtime_ns, size, inode)} of the files directly in `folder` (none when it is absent)."""
    if not folder.is_dir():
        return {}
    return {
        p.name: (st.st_mtime_ns, st.st_size, st.st_ino)
        for p in folder.iterdir()
        if p.is_file() and (st := p.stat())
    }


def record_written(folder: Path, before: dict[str, tuple[int, int, int]]) -> list[str]:
    """Write folder/checksums.json over the files written into `folder` since `before` (its
    `file_stamps` then): a final model, adapter or merged model and its tokenizer, as checkpoints are
    recorded. The model card (README.md) is left out: people edit it and nothing loads it. Returns the
    names recorded; loading the folder verifies them (finetune.model)."""
    written = [
        folder / name
        for name, stamp in sorted(file_stamps(folder).items())
        if before.get(name) != stamp
        and name not in (CHECKSUMS_FILE, "README.md")
        and not name.startswith(".")
    ]
    write_checksums(folder, written)
    return [p.name for p in written]


# ------------------------------------------------------------------------------------- listing


def step_of(path: Path) -> int | None:
    match = _STEP_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path, *, complete_only: bool = True) -> list[Path]:
    """Checkpoint folders (by default only those with a train state file), oldest first."""
    found = [p for p in root.glob("step-*") if p.is_dir() and step_of(p) is not None]
    if complete_only:
        found = [p for p in found if (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of)


def rotate(root: Path, keep: int, protect: Path | None = None) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names, nor `protect`)."""
    latest = read_latest(root)
    for old in list_checkpoints(root)[:-keep]:
        if old.name != latest and (protect is None or old.resolve() != protect.resolve()):
            shutil.rmtree(old, ignore_errors=True)


def read_latest(root: Path) -> str | None:
    """The folder name `latest` points at, or None when the file is absent or holds no step name."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    text = pointer.read_bytes()[:256].decode("utf-8", errors="replace").strip()
    return text if _STEP_NAME.fullmatch(text) else None


def find_checkpoint(
    spec: str | None, output_dir: str | Path, *, say: Callable[[str], None] = print
) -> Path | None:
    """Resolve train.load_checkpoint_path: None, `auto`, or a path; every checkpoint is verified.

    `auto`: the newest checkpoint that verifies, `latest` first; each one passed over is reported
    through `say` with the reason; None when there is none (a fresh start, said too). A path: that
    checkpoint, or a FinetuneError naming what is wrong with it.
    """
    if spec is None:
        return None
    if spec != "auto":
        path = Path(spec)
        problem = verify(path)
        if problem is not None:
            raise FinetuneError(
                f"train.load_checkpoint_path: {path} cannot be resumed: {problem}. Point at another "
                "output_dir/checkpoints/step-N (`finetune checkpoints OUTPUT_DIR` lists them) or use `auto`"
            )
        return path
    root = checkpoints_dir(output_dir)
    candidates = _auto_candidates(root, say)
    for path in candidates:
        problem = verify(path)
        if problem is None:
            return path
        warn(f"resume: skipping {path}: {problem}", emit=say)
    if candidates:
        warn(f"resume: no checkpoint in {root} verifies; starting fresh from step 0", emit=say)
    else:
        say(f"load_checkpoint_path: auto found no checkpoint in {output_dir}; starting fresh")
    return None


def _auto_candidates(root: Path, say: Callable[[str], None]) -> list[Path]:
    """Checkpoints newest first, the one `latest` names first of all."""
    folders = list_checkpoints(root, complete_only=False)[::-1] if root.is_dir() else []
    pointer = root / "latest"
    if pointer.is_file():
        name = read_latest(root)
        if name is None:
            warn(f"resume: {pointer} does not name a checkpoint; looking at the folders instead", emit=say)
        elif not (root / name).is_dir():
            warn(f"resume: {pointer} names {name}, which does not exist; looking at the others", emit=say)
        else:
            folders = [root / name, *[p for p in folders if p.name != name]]
    return folders


def load_train_state(path: Path) -> dict[str, Any]:
    return json.loads((path / STATE_FILE).read_text())


def describe_checkpoints(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every checkpoint folder, oldest first, with its step, size, verification result (None = it
    verifies), and whether `auto` would resume from it."""
    root = checkpoints_dir(output_dir)
    folders = list_checkpoints(root, complete_only=False) if root.is_dir() else []
    problems = {path: verify(path) for path in folders}
    pick = next((p for p in _auto_candidates(root, lambda _: None) if problems.get(p) is None), None)
    return [
        {
            "path": str(path),
            "step": step_of(path),
            "bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
            "problem": problems[path],
            "auto": path == pick,
        }
        for path in folders
    ]


# ------------------------------------------------------------------------------ RNG states
# The random number generators' states in a checkpoint, one file pair per process, without pickle.
#
# accelerate saves them as random_states_N.pkl and, on resume, loads that file inside a bare
# `except Exception`: a truncated, wrong-shape or replaced file (its checksum rewritten to match) resumed
# silently with fresh RNG states, and the losses after the resume differed from an uninterrupted run.
# finetune writes them itself instead, as rng_state_N.safetensors (the torch and CUDA generators' byte
# states, numpy's key) and rng_state_N.json (Python's and numpy's other fields), removes accelerate's
# pickle from the checkpoint, and on resume restores every state or stops with an error naming the file:
# there is no resume that is silently not exact.

RNG_ACCELERATE_FILE = "random_states_{rank}.pkl"
RNG_JSON_FILE = "rng_state_{rank}.json"
RNG_TENSORS_FILE = "rng_state_{rank}.safetensors"


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able fields, tensors) of this process's Python, numpy, torch and CUDA generators."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    plain = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cuda_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    tensors = {"torch": torch.get_rng_state(), "numpy_key": torch.from_numpy(key.astype(np.int64))}
    for k, cuda in enumerate(torch.cuda.get_rng_state_all() if plain["torch_cuda_count"] else []):
        tensors[f"cuda_{k}"] = cuda
    return plain, tensors


def restore_rng(state: tuple[dict[str, Any], dict[str, torch.Tensor]], where: str) -> None:
    """Set every generator from `state` (capture's), checking each part first; a part that does not fit
    is a FinetuneError naming `where` (the checkpoint files), with nothing half-restored."""
    import numpy as np
    import torch

    plain, tensors = state
    try:
        python = plain["python"]
        internal = tuple(int(x) for x in python["internal"])
        python_state = (int(python["version"]), internal, python["gauss_next"])
        numpy = plain["numpy"]
        key = tensors["numpy_key"]
        torch_state = tensors["torch"]
        if torch_state.dtype != torch.uint8 or torch_state.shape != torch.get_rng_state().shape:
            raise ValueError(
                f"the torch generator state has shape {tuple(torch_state.shape)} {torch_state.dtype}"
            )
        if key.shape != (624,) or len(internal) != 625:
            raise ValueError("the numpy or Python Mersenne Twister state has the wrong length")
        numpy_state = (str(numpy["kind"]), key.numpy().astype(np.uint32), int(numpy["pos"]),
                       int(numpy["has_gauss"]), float(numpy["cached_gaussian"]))  # fmt: skip
        cuda = [tensors[f"cuda_{k}"] for k in range(int(plain["torch_cuda_count"]))]
        check = random.Random()
        check.setstate(python_state)  # raises on a malformed state, before anything is changed
        np.random.RandomState().set_state(numpy_state)
    except (KeyError, TypeError, ValueError) as exc:
        raise FinetuneError(
            f"{where}: the random number generators' state cannot be restored ({type(exc).__name__}: {exc}); "
            "the resumed run would not continue the interrupted one exactly. Resume from another checkpoint "
            "(`finetune checkpoints OUTPUT_DIR` lists them)"
        ) from None
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise FinetuneError(
                f"{where}: the checkpoint holds {len(cuda)} CUDA generators' states and this process sees "
                f"{torch.cuda.device_count()} devices: resume with the same devices (CUDA_VISIBLE_DEVICES)"
            )
        torch.cuda.set_rng_state_all(cuda)


def save_rng_state(folder: Path, rank: int) -> None:
    """This process's generators into `folder`, replacing accelerate's pickled file of them."""
    from safetensors.torch import save_file

    plain, tensors = capture_rng()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / RNG_TENSORS_FILE.format(rank=rank))
    )
    (folder / RNG_JSON_FILE.format(rank=rank)).write_text(json.dumps(plain))
    (folder / RNG_ACCELERATE_FILE.format(rank=rank)).unlink(missing_ok=True)


def load_rng_state(folder: Path, rank: int) -> None:
    """Restore this process's generators from `folder` (after accelerate's load_state, which finds no
    RNG file of its own there). A checkpoint from before finetune kept them itself has only
    accelerate's pickle, which accelerate loaded tensors-only or skipped without a word: said loudly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    json_path, tensors_path = (
        folder / RNG_JSON_FILE.format(rank=rank),
        folder / RNG_TENSORS_FILE.format(rank=rank),
    )
    if not json_path.exists() and not tensors_path.exists():
        if (folder / RNG_ACCELERATE_FILE.format(rank=rank)).exists():
            warn(
                f"{folder} keeps its random number generators only in accelerate's pickle, which is loaded "
                "without checks (an older finetune wrote it): the resumed run may not repeat the interrupted "
                "one exactly; resume from a checkpoint this version wrote for that"
            )
            return
        raise FinetuneError(
            f"{folder}: no {json_path.name} for process {rank}: the checkpoint was written by fewer processes "
            "or is incomplete; resume with the number of processes that wrote it, or from another checkpoint"
        )
    where = f"{json_path} / {tensors_path.name}"
    try:
        plain = json.loads(json_path.read_text())
        tensors = load_file(str(tensors_path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise FinetuneError(
            f"{where}: unreadable ({type(exc).__name__}: {exc}); resume from another checkpoint "
            "(`finetune checkpoints OUTPUT_DIR` lists them)"
        ) from None
    restore_rng((plain, tensors), where)
