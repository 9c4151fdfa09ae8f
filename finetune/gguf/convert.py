"""GGUF checkpoints as ordinary Hugging Face models.

A recipe names a GGUF file with `model.model_path` (a `.gguf` file, or a `package://` reference to
one inside an installed Python package) or with `model.model_path` + `model.gguf_file` (a file in a
folder or Hub repository; finetune.gguf.names reads these names). The file is converted once into a Hugging Face folder (config.json,
safetensors weights, tokenizer with its chat template, generation_config.json), cached under
`$FINETUNE_GGUF_CACHE` (default `~/.cache/finetune/gguf`) in a folder named by the file's content
hash, and that folder is the base model everywhere: training, prepare-dataset's tokenizer and
fingerprint, merge-lora, eval and chat. An adapter records the file's portable name instead (the
`package://` reference, `hf://<repo>/<file>` for a file on the Hub, or the local file's path; see
`finetune.gguf.names.portable_base`), from which finetune rebuilds the folder on any machine.

The cache heals itself: the marker written last into a converted folder lists every file's size,
modification time and sha256; a folder whose files are missing, cut short or rewritten is reported
(a warning naming the folder and the file) and converted again. A damaged `.gguf` input is an error
naming the file and what is wrong, and a conversion that fails (a full disk) leaves no temporary
folder behind.

Why convert rather than load the GGUF each time:
* transformers dequantizes a GGUF on every load, parsing the file once for the config, once for
  the weights and once for the tokenizer (about 18 s for the 135M SmolLM2 on 2 CPU cores); the
  converted folder loads in well under a second.
* An adapter must name a base that loads again with plain `from_pretrained(path)`; a GGUF needs
  the extra `gguf_file=` argument, which PEFT does not record.
* A model loaded with plain `from_pretrained(dir, gguf_file=...)` refuses `save_pretrained`: for
  architectures that transformers 5.23 still loads through its legacy GGUF path (llama among them)
  every weight is dequantized into a dense tensor, yet the `GgufHfQuantizer` stays attached as
  `model.hf_quantizer` with `config.quantization_config = {quant_method: gguf, dequantize: false}`,
  and `save_pretrained` refuses any model whose quantizer's `is_serializable()` is False (the GGUF
  quantizer's always is). Asking for dense weights explicitly, `GgufConfig(dequantize=True)`, makes
  the quantizer's `postprocess_model` call `remove_quantization_config` (its public way out): the
  model comes back with no quantizer and no quantization config, like any dense model. That is
  also right where the packed path would apply (an architecture it supports, with the `kernels`
  package installed), whose packed `GgufLinear` layers could be neither trained nor saved.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import FinetuneError, is_disk_full, write_failure_reason
from finetune.gguf.names import gguf_path, is_gguf_name, is_package_ref, portable_base, resolve_package_path
from finetune.notices import warn

if TYPE_CHECKING:
    import torch


CACHE_ENV = "FINETUNE_GGUF_CACHE"


# Part of the cache key: bump it when the conversion writes something different (2: the marker lists
# the files' checksums).
CONVERSION_VERSION = 2


# Written last into a converted folder (a dot file: prepare's tokenizer fingerprint skips it).
MARKER_NAME = ".finetune-gguf.json"


# A temporary conversion folder older than this is stale whoever wrote it (a conversion takes minutes).
STALE_TEMP_AGE_S = 24 * 3600


_sha256_memo: dict[tuple[str, int, int], str] = {}


_told: set[str] = set()


# -------------------------------------------------------------------------------------- the cache


def cache_root() -> Path:
    """Where converted GGUF folders live: $FINETUNE_GGUF_CACHE, else $XDG_CACHE_HOME/finetune/gguf,
    else ~/.cache/finetune/gguf (absolute: adapters record the path of their base)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return (Path(base).expanduser() / "finetune" / "gguf").resolve()


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, remembered in this process per (path, size, mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _sha256_memo:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 23):
                digest.update(chunk)
        _sha256_memo[key] = digest.hexdigest()
    return _sha256_memo[key]


def converted_folder(gguf: Path, *, root: Path | None = None) -> Path:
    """The Hugging Face folder converted from `gguf`, converting it first when it is not cached yet or
    its cached conversion is damaged.

    The folder is `root/<first 16 hex of the file's sha256>-v<CONVERSION_VERSION>` (root defaults to
    `cache_root()`): the same file under any name or path converts once. The conversion is written
    to a temporary folder and renamed into place under a file lock, so concurrent processes (one per
    GPU) convert it once and never see a partial folder. A cached folder is checked against the
    checksums its marker lists (`cache_damage`); a damaged one is reported and converted again.
    """
    from filelock import FileLock

    root = root or cache_root()
    sha = file_sha256(gguf)
    folder = root / f"{sha[:16]}-v{CONVERSION_VERSION}"
    if cache_damage(folder) is not None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(folder) + ".lock")
            lock.acquire()
        except OSError as exc:
            raise FinetuneError(
                f"cannot write the GGUF conversion cache {root}: {exc}. Set {CACHE_ENV} to a writable folder"
            ) from None
        try:
            damage = cache_damage(folder)  # again under the lock: another process may have converted it
            if damage is not None:
                if (folder / MARKER_NAME).is_file():
                    warn(f"the GGUF conversion {folder} is damaged: {damage}; converting {gguf.name} again")
                remove_stale_temp_folders(root)
                _tell(f"{gguf.name}: converting the GGUF file (dequantizing; once per file) to {folder}")
                _convert_atomically(gguf, folder, sha)
        finally:
            lock.release()
    _tell(f"{gguf.name}: using its Hugging Face conversion {folder} as the base model")
    return folder


def cache_damage(folder: Path) -> str | None:
    """What is wrong with a converted folder ("not converted" when it has no marker), or None when every
    file its marker lists is there with its recorded size and content.

    Cost on a cache hit: one stat per file (microseconds). A file whose size and modification time are
    the recorded ones is trusted, as make and rsync trust them: anything written through the file
    system (a truncation, a byte rewritten in place, a file replaced) changes one of them. A file
    whose size matches but whose modification time does not (a rewrite in place, or a copy of the
    cache without its times) is hashed in full and compared with the recorded sha256 (1.8 s for
    SmolLM2-135M's 542 MB on a busy 2-core machine, benchmarks/RESULTS.md); if it matches, the new time is recorded so the next run skips the
    hash. Bytes changed under the file system (bit rot with the old time) are not looked for: that
    would read every weight on every run.
    """
    marker_file = folder / MARKER_NAME
    if not marker_file.is_file():
        return "not converted"
    try:
        files = json.loads(marker_file.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its marker {MARKER_NAME} is unreadable ({type(exc).__name__}: {exc})"
    retimed = {}
    for name, want in files.items():
        path = folder / name
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != want["size"]:
            return f"{name} has {stat.st_size} bytes, the conversion wrote {want['size']}"
        if stat.st_mtime_ns != want["mtime_ns"]:
            if file_sha256(path) != want["sha256"]:
                return f"{name} was changed after the conversion (its sha256 differs from the recorded one)"
            retimed[name] = {**want, "mtime_ns": stat.st_mtime_ns}
    if retimed:
        with contextlib.suppress(OSError, ValueError):  # an unwritable cache just hashes again next time
            marker = json.loads(marker_file.read_text())
            _write_marker(folder, {**marker, "files": {**files, **retimed}})
    return None


def _file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """Size, modification time and sha256 of every file in `folder` (the marker's `files`)."""
    records = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER_NAME):
        stat = path.stat()
        records[path.relative_to(folder).as_posix()] = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "sha256": file_sha256(path),
        }
    return records


def _write_marker(folder: Path, marker: dict[str, Any]) -> None:
    """Write the marker whole or not at all (a temporary file renamed over it)."""
    tmp = folder / f"{MARKER_NAME}.{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, folder / MARKER_NAME)


def _convert_atomically(gguf: Path, folder: Path, sha: str) -> None:
    tmp = folder.parent / _temp_name(folder)
    # os.mkdir with the default mode, so the folder gets the user's umask (tempfile.mkdtemp's 0700
    # would hide a shared cache from its other users).
    tmp.mkdir()
    try:
        dtype = convert_gguf(gguf, tmp)
        with _writing(tmp, what="the conversion's marker"):
            marker = {"source": gguf.name, "sha256": sha, "conversion_version": CONVERSION_VERSION}
            marker |= {"dtype": str(dtype).removeprefix("torch."), **_versions(), "files": _file_records(tmp)}
            _write_marker(tmp, marker)
            _share(tmp)  # chmod leaves the recorded modification times alone
        if folder.exists():  # a damaged folder, or one without a marker: set it aside, then remove it
            old = folder.parent / _temp_name(folder)
            os.replace(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _share(folder: Path) -> None:
    """Give `folder` and what is in it the modes a plain mkdir and open give (0755 / 0644 under umask
    022): some writers (safetensors) create their files 0600, which would hide a shared cache."""
    umask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _temp_name(folder: Path) -> str:
    """A temporary folder's name beside `folder`, naming the host and process that own it (so a later
    conversion can tell one left by a killed process)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    return f".{folder.name}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_temp_folders(root: Path, *, max_age_s: float = STALE_TEMP_AGE_S) -> list[Path]:
    """Remove the temporary folders that conversions killed before the end left in `root`: those of a
    process of this host that is no longer running, and any older than `max_age_s`. Returns them."""
    removed = []
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"
    for entry in root.glob(".*.tmp-*"):
        found = re.search(r"\.tmp-(.+)-(\d+)-[0-9a-f]{8}$", entry.name)
        dead = found is not None and found[1] == host and not _running(int(found[2]))
        with contextlib.suppress(OSError):
            if dead or time.time() - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                removed.append(entry)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


@contextlib.contextmanager
def _writing(out: Path, *, what: str, need_bytes: int | None = None):
    """Say a failure to write `what` into `out` (a full disk above all) as an error naming the cache
    and the fix. safetensors reports a full disk as SafetensorError or RuntimeError ("os error 28"),
    Python's own writes as OSError(ENOSPC)."""
    try:
        yield
    except Exception as exc:
        full = is_disk_full(exc)
        if not (
            full
            or isinstance(exc, OSError)
            or write_failure_reason(exc)
            or type(exc).__name__ == "SafetensorError"
        ):
            raise
        root = out.parent
        fix = f"Free space there, or set {CACHE_ENV} to a folder on a disk with room"
        if full:
            sizes = [f"about {need_bytes / 1e6:,.0f} MB needed"] if need_bytes else []
            with contextlib.suppress(OSError):
                sizes.append(f"{shutil.disk_usage(root).free / 1e6:,.0f} MB free")
            raise FinetuneError(
                f"no space left on the disk of the GGUF conversion cache {root} while writing {what}"
                f"{' (' + '; '.join(sizes) + ')' if sizes else ''}. Nothing was kept. {fix}"
            ) from None
        raise FinetuneError(
            f"cannot write {what} into the GGUF conversion cache {root}: {type(exc).__name__}: {exc}. "
            f"Nothing was kept. {fix}"
        ) from None


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "gguf"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _tell(message: str) -> None:
    """Print a notice once per process, and only on the main process of a distributed run."""
    if message not in _told and os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    _told.add(message)


# --------------------------------------------------------------------------------- the conversion


def read_gguf(gguf: Path) -> dict[str, Any]:
    """The `general.*` metadata of a GGUF file (name, organization, source repository ...), after
    checking that the file is whole: an error names the file and what is wrong with it (empty, not
    GGUF, its header or its tensor data cut short or damaged).

    Reads the header and memory-maps the tensor data (gguf's GGUFReader): nothing is dequantized.
    """
    if importlib.util.find_spec("gguf") is None:
        raise FinetuneError(f"{gguf}: reading GGUF files needs the gguf package: pip install gguf")
    from gguf import GGUFReader

    again = "Download or copy the file again (an interrupted download or copy leaves it cut short)"
    size = gguf.stat().st_size
    if size == 0:
        raise FinetuneError(f"{gguf}: the file is empty (0 bytes), not a GGUF model. {again}")
    with open(gguf, "rb") as f:
        head = f.read(64)
    if not head.startswith(b"GGUF"):
        what = (
            "it is a Git LFS pointer, not the file it points to (run git lfs pull)"
            if head.startswith(b"version https://git-lfs")
            else f"it starts with {head[:8]!r}, not the GGUF magic b'GGUF'"
        )
        raise FinetuneError(f"{gguf}: not a GGUF file: {what}. Point model.model_path at a .gguf model file")
    try:
        reader = GGUFReader(gguf)
    except Exception as exc:  # whatever the parser trips on (ValueError, IndexError ...) means a bad file
        # The reader parses the header, then maps each tensor's bytes (_build_tensors): where it stopped
        # tells which part is cut short.
        frames = {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
        part = "tensor data" if "_build_tensors" in frames else "header"
        raise FinetuneError(
            f"{gguf}: the GGUF {part} is cut short or damaged (the file has {size:,} bytes; reading it "
            f"stopped at: {type(exc).__name__}: {exc}). {again}"
        ) from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("general."):
            with contextlib.suppress(Exception):  # a value the reader cannot decode is left out
                metadata[key] = field.contents()
    return metadata


def source_repo(metadata: dict[str, Any]) -> str | None:
    """The Hugging Face Hub repository a GGUF file was converted from, where its metadata names one
    (general.source.* or a single general.base_model.0.*, as llama.cpp's converter writes them).

    >>> source_repo({"general.source.url": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"})
    'HuggingFaceTB/SmolLM2-135M-Instruct'
    >>> source_repo({"general.name": "Smollm2 135M", "general.organization": "HuggingFaceTB"}) is None
    True
    """
    keys = ["general.source.repo_url", "general.source.url"]
    if metadata.get("general.base_model.count", 1) == 1:
        keys += ["general.base_model.0.repo_url", "general.base_model.0.url"]
    for key in keys:
        found = re.match(r"https?://huggingface\.co/([\w.-]+/[\w.-]+)/?$", str(metadata.get(key, "")))
        if found:
            return found[1]
    return None


def load_gguf(gguf: Path, *, dtype: torch.dtype | None = None):
    """(model, tokenizer) from a GGUF file: every weight dequantized into a plain dense transformers
    model, which trains and saves like one loaded from safetensors (see the module docstring).

    dtype defaults to float32, which holds every dequantized value exactly.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    read_gguf(gguf)  # a damaged file is said plainly here, not as a parser's traceback
    try:
        net = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=dtype or torch.float32,
        )
    except (ValueError, KeyError) as exc:  # an architecture or tensor type transformers cannot read
        raise FinetuneError(
            f"{gguf}: transformers cannot load this GGUF file: {exc}. Use a GGUF file of an architecture "
            "transformers reads (its GGUF documentation lists them), or the model's Hugging Face repository"
        ) from None
    if getattr(net, "hf_quantizer", None) is not None or getattr(net.config, "quantization_config", None):
        raise FinetuneError(
            f"{gguf}: transformers left the model quantized although dense weights were asked for "
            "(GgufConfig(dequantize=True)); this transformers version is not supported for GGUF"
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return net, tokenizer


def convert_gguf(gguf: Path, out: Path) -> torch.dtype:
    """Write `gguf` as a Hugging Face folder in `out`; returns the dtype the weights were saved in.

    Weights are saved in the narrowest float dtype that holds every dequantized value exactly (float32
    for quantized files: a block's scale times its integers is rarely a 16-bit float), so the folder
    reproduces the GGUF load exactly. The tokenizer is saved with its chat template; the generation
    config carries the file's bos/eos/pad ids.
    """
    net, tokenizer = load_gguf(gguf)
    dtype = narrowest_exact_dtype(net.state_dict().values())
    net.to(dtype)
    need_bytes = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    with _writing(out, what=f"the conversion of {gguf.name}", need_bytes=need_bytes):
        net.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return dtype


def narrowest_exact_dtype(tensors) -> torch.dtype:
    """The narrowest float dtype (bfloat16, then float16, else float32) holding every value exactly.

    >>> import torch
    >>> narrowest_exact_dtype([torch.tensor([0.5, -2.0, 2.0**100])])
    torch.bfloat16
    >>> narrowest_exact_dtype([torch.tensor([1.0 + 2**-10])]), narrowest_exact_dtype([torch.tensor([0.1])])
    (torch.float16, torch.float32)
    """
    import torch

    tensors = [t for t in tensors if t.is_floating_point()]
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(t, t.to(dtype).to(t.dtype)) for t in tensors):
            return dtype
    return torch.float32


# ----------------------------------------------------------------------------- the recipe's model


def resolve_model_source(model: Any) -> Any:
    """`model` itself when model_path is an ordinary folder or Hub id; otherwise a copy whose model_path
    is local: a GGUF file's converted Hugging Face folder (converted now if not cached, gguf_file then
    None), or the folder a `package://` reference names.

    config_path and tokenizer_path, when unset, follow model_path to that folder; set to a GGUF file
    or a `package://` reference, they are resolved the same way.
    """
    update: dict[str, Any] = {}
    gguf = gguf_path(model.model_path, model.gguf_file, revision=model.revision)
    if gguf is not None:
        update = {"model_path": str(converted_folder(gguf)), "gguf_file": None}
    elif is_package_ref(model.model_path):
        update = {"model_path": str(resolve_package_path(model.model_path))}
    for name in ("config_path", "tokenizer_path"):  # set apart from model_path: the same forms work
        value = getattr(model, name)
        if isinstance(value, str) and (is_gguf_name(value) or is_package_ref(value)):
            update[name] = resolve_path(value)
    return model.model_copy(update=update) if update else model


def resolve_path(path: str) -> str:
    """A model location made loadable by plain `from_pretrained`: a GGUF file (or a `package://`
    reference to one) becomes its converted folder, another `package://` reference its local path;
    any other folder or Hub id is returned unchanged.

    >>> resolve_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    gguf = gguf_path(path)
    if gguf is not None:
        return str(converted_folder(gguf))
    return str(resolve_package_path(path)) if is_package_ref(path) else path


def describe_gguf(model_path: str | None, gguf_file: str | None = None, revision: str | None = None):
    """For a model card: {"reference": portable_base, "source_repo": the Hub repository the file was
    converted from (or None), "name": its general.name} when model_path names a GGUF file, else None."""
    reference = portable_base(model_path, gguf_file, revision)
    if reference is None:
        return None
    gguf = gguf_path(model_path, gguf_file, revision=revision)
    metadata = read_gguf(gguf) if gguf is not None else {}
    return {
        "reference": reference,
        "source_repo": source_repo(metadata),
        "name": metadata.get("general.name"),
    }
