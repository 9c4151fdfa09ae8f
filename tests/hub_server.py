"""A Hugging Face Hub-compatible HTTP server on loopback, for tests.

It speaks the subset of the Hub protocol that `huggingface_hub` (with Xet disabled) and `datasets`
really use, so tests exercise the real client code paths over real HTTP:

    GET  /api/whoami-v2                                   who the token belongs to
    GET  /api/agent-harnesses                             (queried by huggingface_hub's user agent)
    POST /api/repos/create, DELETE /api/repos/delete      repo life cycle (409 + url when it exists)
    POST /api/validate-yaml                               README front matter check before a commit
    GET  /api/{type}s/{id}[/revision/{rev}]               repo info: sha, siblings, private, cardData
    GET  /api/{type}s/{id}/tree/{rev}[/{path}]            listing (recursive, expand, Link pagination)
    POST /api/{type}s/{id}/paths-info/{rev}               info on given paths
    POST /api/{type}s/{id}/preupload/{rev}                regular vs lfs decision per file
    POST /api/{type}s/{id}/commit/{rev}                   NDJSON commit (file/lfsFile/deleted*)
    GET  /api/{type}s/{id}/refs | commits/{rev}           branches and history
    POST/DELETE /api/{type}s/{id}/branch/{name}           branches
    PUT  /api/{type}s/{id}/settings                       visibility
    POST /{prefix}{id}.git/info/lfs/objects/batch         LFS batch: upload actions to our own URL
    PUT  /_lfs/upload/{oid}?ticket=...                    "presigned" LFS upload (size + sha256 checked)
    POST /{prefix}{id}.git/info/lfs/objects/verify        LFS verify
    GET|HEAD /{prefix}{id}/resolve/{rev}/{path}           file download (ETag, X-Repo-Commit, Range)
    GET|HEAD /_cdn/{sha256}                               where LFS files redirect to, like the Hub CDN

Anything else answers 404 without a Hub error code (e.g. the parquet-conversion refs do not exist).

Repos live under a temporary directory: file contents in a content-addressed store (by sha256),
each repo as a linear history of commits (40-hex ids) on `main` plus optional branches. Every
request is logged (method, path, status) so tests can assert that real HTTP happened, e.g. that
an LFS upload went through the batch endpoint.

Auth: writes need `Authorization: Bearer <token>` with the server's token, else 401. A wrong
token is a 401 everywhere. Private repos are invisible (404) without the token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import shutil
import socket
import tempfile
import threading
import traceback
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

TEST_TOKEN = "hf_finetune_fake_test_token_0123456789"
TEST_USER = "test-user"

# Files with these endings always go through LFS, whatever their size (as the Hub's default
# .gitattributes does); other files go LFS above `lfs_threshold_bytes` or when they look binary.
LFS_SUFFIXES = (
    ".arrow", ".bin", ".ckpt", ".gguf", ".gz", ".h5", ".jpeg", ".jpg", ".model", ".msgpack", ".npy",
    ".npz", ".onnx", ".parquet", ".pickle", ".pkl", ".png", ".pt", ".pth", ".safetensors", ".tar",
    ".wav", ".zip", ".zst",
)  # fmt: skip
PLURAL_TO_TYPE = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
REPO_ACTIONS = {
    "revision", "tree", "paths-info", "preupload", "commit", "commits", "refs", "branch", "tag",
    "settings", "parquet", "lfs-files", "discussions", "resolve", "treesize", "super-squash",
}  # fmt: skip
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_HEX_RE = re.compile(r"^[0-9a-f]{7,40}$")
_FRONT_MATTER_RE = re.compile(r"^\s*---\r?\n([\s\S]*?)\r?\n---(?:\r?\n|$)")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def git_blob_oid(data: bytes) -> str:
    """The git blob id of `data` (what the Hub reports as a regular file's oid / ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file that stands in the git tree for an LFS file."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the server saw it (path is the raw path, without the query string)."""

    method: str
    path: str
    query: str
    status: int
    authenticated: bool


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str  # key in the object store
    blob_id: str  # git oid: of the content (regular) or of the LFS pointer (lfs)
    lfs: bool
    last_commit: str = ""

    def to_api(self, commits: dict[str, Commit] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.path}
        if self.lfs:
            pointer_size = len(lfs_pointer(self.sha256, self.size))
            out["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": pointer_size}
        if commits is not None:
            out["lastCommit"] = commits[self.last_commit].summary()
            out["securityFileStatus"] = {"status": "safe", "avScan": None, "pickleImportScan": None}
        return out


@dataclass(frozen=True)
class Commit:
    oid: str
    title: str
    message: str
    date: str
    parent: str | None
    files: dict[str, FileEntry]

    def summary(self) -> dict[str, str]:
        return {"id": self.oid, "title": self.title, "date": self.date}


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    @property
    def url_path(self) -> str:
        return URL_PREFIX[self.repo_type] + self.repo_id

    def resolve(self, revision: str) -> Commit | None:
        """A branch name, a full commit id or an unambiguous prefix of one (7+ hex chars)."""
        if revision in self.branches:
            return self.commits[self.branches[revision]]
        if revision.startswith("refs/heads/") and revision[11:] in self.branches:
            return self.commits[self.branches[revision[11:]]]
        if _HEX_RE.match(revision):
            matches = [oid for oid in self.commits if oid.startswith(revision)]
            if len(matches) == 1:
                return self.commits[matches[0]]
        return None


class HubError(Exception):
    """An error answered as the Hub does: JSON `{"error": ...}` plus X-Error-Code/Message headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})

    def response(self) -> Response:
        headers = {"X-Error-Message": self.message, **self.headers}
        if self.code:
            headers["X-Error-Code"] = self.code
        return Response.json({"error": self.message}, status=self.status, headers=headers)


@dataclass
class Response:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @classmethod
    def json(
        cls, payload: Any, status: int = 200, headers: dict | None = None, ctype: str = "application/json"
    ):
        body = json.dumps(payload).encode()
        return cls(status, {"Content-Type": ctype, **(headers or {})}, body)


@dataclass
class Request:
    method: str
    path: str  # raw, still percent-encoded
    query: dict[str, list[str]]
    headers: Any  # email.message.Message: case-insensitive get()
    body: bytes

    def param(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else default

    def flag(self, name: str) -> bool:
        return (self.param(name) or "").lower() in ("1", "true", "yes")

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as err:
            raise HubError(400, f"Invalid JSON body: {err}") from err


class HubServer:
    """A Hub on `http://127.0.0.1:<port>`, serving from a background thread.

    The socket is bound in the constructor (port 0: the OS picks a free port, no race), so
    `endpoint` is known before `start()`. Use as a context manager or call `start()`/`stop()`.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        token: str = TEST_TOKEN,
        user: str = TEST_USER,
        lfs_threshold_bytes: int = 10 * 1024,
        tree_page_size: int = 1000,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._owns_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="hub-server-") if root is None else root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self.token, self.user = token, user
        self.lfs_threshold_bytes = lfs_threshold_bytes
        self.tree_page_size = tree_page_size
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], Repo] = {}
        self._upload_tickets: dict[str, tuple[str, int]] = {}
        self._log: list[LoggedRequest] = []
        self._commit_counter = 0
        self._httpd = _Server((host, port), _Handler)
        self._httpd.hub = self
        self.host, self.port = self._httpd.server_address[:2]
        self.endpoint = f"http://{self.host}:{self.port}"
        # LFS downloads redirect to a "CDN" on another origin (localhost vs 127.0.0.1), as the Hub
        # does: the client must then drop its auth header and take the file metadata from the 302.
        self.cdn_endpoint = f"http://localhost:{self.port}" if _localhost_is_loopback() else None
        self._thread: threading.Thread | None = None

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> HubServer:
        if self._thread is None:
            # A short poll interval makes stop() quick (shutdown() waits for the next poll).
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="hub-server",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers for tests ----------------------------------------------------------------
    @property
    def requests(self) -> list[LoggedRequest]:
        """A copy of the request log, oldest first."""
        with self._lock:
            return list(self._log)

    def find_requests(self, method: str | None = None, path_regex: str | None = None) -> list[LoggedRequest]:
        """Logged requests with this method and a path matching `path_regex` (re.search)."""
        pattern = re.compile(path_regex) if path_regex else None
        return [
            r
            for r in self.requests
            if (method is None or r.method == method) and (pattern is None or pattern.search(r.path))
        ]

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    def repo_exists(self, repo_id: str, *, repo_type: str = "model") -> bool:
        with self._lock:
            return (repo_type, repo_id) in self._repos

    def list_files(self, repo_id: str, *, repo_type: str = "model", revision: str = "main") -> list[str]:
        return sorted(self._commit_for(repo_id, repo_type, revision).files)

    def file_entry(
        self, repo_id: str, path: str, *, repo_type: str = "model", revision: str = "main"
    ) -> FileEntry:
        """How a file is stored: size, sha256, git blob id, and whether it went through LFS."""
        entry = self._commit_for(repo_id, repo_type, revision).files.get(path)
        if entry is None:
            raise KeyError(f"{path!r} not in {repo_type} repo {repo_id!r} at {revision!r}")
        return entry

    def read_file(
        self, repo_id: str, path: str, *, repo_type: str = "model", revision: str = "main"
    ) -> bytes:
        return self._object_path(
            self.file_entry(repo_id, path, repo_type=repo_type, revision=revision).sha256
        ).read_bytes()

    def head_sha(self, repo_id: str, *, repo_type: str = "model", revision: str = "main") -> str:
        return self._commit_for(repo_id, repo_type, revision).oid

    def _commit_for(self, repo_id: str, repo_type: str, revision: str) -> Commit:
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
            if repo is None:
                raise KeyError(f"No {repo_type} repo {repo_id!r}")
            commit = repo.resolve(revision)
            if commit is None:
                raise KeyError(f"No revision {revision!r} in {repo_type} repo {repo_id!r}")
            return commit

    # -- storage --------------------------------------------------------------------------
    def _object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / sha256

    def _has_object(self, sha256: str, size: int | None = None) -> bool:
        if not _SHA256_RE.match(sha256):  # also keeps client-given ids from naming other paths
            return False
        path = self._object_path(sha256)
        return path.is_file() and (size is None or path.stat().st_size == size)

    def _store_object(self, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        path = self._object_path(sha256)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{sha256}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: concurrent readers never see a partial object
        return sha256

    def _save_repo(self, repo: Repo) -> None:
        """Mirror a repo's refs and history to disk (for debugging; the server reads memory)."""
        folder = self.root / "repos" / repo.repo_type / repo.repo_id
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "private": repo.private,
            "branches": repo.branches,
            "commits": [
                {**c.summary(), "parent": c.parent, "files": {p: e.__dict__ for p, e in c.files.items()}}
                for c in repo.commits.values()
            ],
        }
        (folder / "repo.json").write_text(json.dumps(state, indent=1))

    def _new_commit(
        self, repo: Repo, parent: Commit | None, files: dict[str, FileEntry], title: str, message: str
    ) -> Commit:
        self._commit_counter += 1
        seed = f"{repo.repo_type}/{repo.repo_id}\n{parent.oid if parent else ''}\n{title}\n{self._commit_counter}"
        seed += "".join(f"\n{p} {e.blob_id}" for p, e in sorted(files.items()))
        oid = hashlib.sha1(seed.encode()).hexdigest()
        files = {p: (e if e.last_commit else replace(e, last_commit=oid)) for p, e in files.items()}
        commit = Commit(oid, title, message, _now(), parent.oid if parent else None, files)
        repo.commits[oid] = commit
        return commit

    def _entry_for(self, path: str, data: bytes | None, sha256: str, size: int, lfs: bool) -> FileEntry:
        blob_id = git_blob_oid(lfs_pointer(sha256, size) if lfs else data or b"")
        return FileEntry(path=path, size=size, sha256=sha256, blob_id=blob_id, lfs=lfs)

    def _should_use_lfs(self, path: str, size: int, sample: bytes) -> bool:
        if size == 0 or path == ".gitattributes":
            return False
        return path.lower().endswith(LFS_SUFFIXES) or size > self.lfs_threshold_bytes or b"\0" in sample

    def _gitattributes(self) -> bytes:
        lines = [f"*{suffix} filter=lfs diff=lfs merge=lfs -text" for suffix in LFS_SUFFIXES]
        return ("\n".join(lines) + "\n").encode()

    # -- auth and lookup ------------------------------------------------------------------
    def _authenticated(self, req: Request) -> bool:
        """True with the right token, False with none; a wrong token is a 401 on any endpoint."""
        header = req.headers.get("Authorization") or ""
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip(), self.token):
            raise HubError(401, "Invalid credentials in Authorization header")
        return True

    def _require_write(self, req: Request) -> None:
        if not self._authenticated(req):
            raise HubError(401, "You must be authenticated to do this (no token in the Authorization header)")

    def _get_repo(self, req: Request, repo_type: str, repo_id: str, write: bool = False) -> Repo:
        if write:
            self._require_write(req)
        authenticated = self._authenticated(req)
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not authenticated):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _resolve(self, repo: Repo, revision: str) -> Commit:
        with self._lock:
            commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # -- routing --------------------------------------------------------------------------
    def handle(self, req: Request) -> Response:
        segments = [unquote(s) for s in req.path.split("/")[1:]]
        if segments and segments[-1] == "" and len(segments) > 1:
            segments = segments[:-1]
        method = "GET" if req.method == "HEAD" else req.method
        match segments:
            case ["api", "whoami-v2"] if method == "GET":
                return self._whoami(req)
            case ["api", "agent-harnesses"] if method == "GET":
                return Response.json({"standardEnvVars": [], "harnesses": {}})
            case ["api", "repos", "create"] if method == "POST":
                return self._create_repo(req)
            case ["api", "repos", "delete"] if method == "DELETE":
                return self._delete_repo(req)
            case ["api", "validate-yaml"] if method == "POST":
                return self._validate_yaml(req)
            case ["api", plural, *rest] if plural in PLURAL_TO_TYPE and rest:
                return self._repo_api(req, method, PLURAL_TO_TYPE[plural], rest)
            case ["_lfs", "upload", oid] if method == "PUT":
                return self._lfs_upload(req, oid)
            case ["_cdn", sha256] if method == "GET":
                if not _SHA256_RE.match(sha256) or not self._has_object(sha256):
                    raise HubError(404, "Object not found")
                return self._serve_object(req, sha256, {"ETag": f'"{sha256}"'})
        if any(s.endswith(".git") for s in segments[:3]):
            return self._lfs_api(req, method, segments)
        if "resolve" in segments[1:4] and method == "GET":
            return self._resolve_file(req, segments)
        raise HubError(404, f"Not found: {req.method} {req.path}")

    def _split_repo(self, rest: list[str]) -> tuple[str, list[str]]:
        """`['ns', 'name', 'tree', 'main']` -> ('ns/name', ['tree', 'main']); ids may lack a namespace."""
        if len(rest) >= 2 and rest[1] not in REPO_ACTIONS:
            return f"{rest[0]}/{rest[1]}", rest[2:]
        return rest[0], rest[1:]

    def _repo_api(self, req: Request, method: str, repo_type: str, rest: list[str]) -> Response:
        repo_id, action = self._split_repo(rest)
        match action:
            case [] if method == "GET":
                return self._repo_info(req, repo_type, repo_id, "main")
            case ["revision", revision] if method == "GET":
                return self._repo_info(req, repo_type, repo_id, revision)
            case ["tree", revision, *path] if method == "GET":
                return self._tree(req, repo_type, repo_id, revision, "/".join(path))
            case ["paths-info", revision] if method == "POST":
                return self._paths_info(req, repo_type, repo_id, revision)
            case ["preupload", revision] if method == "POST":
                return self._preupload(req, repo_type, repo_id, revision)
            case ["commit", revision] if method == "POST":
                return self._commit(req, repo_type, repo_id, revision)
            case ["refs"] if method == "GET":
                return self._refs(req, repo_type, repo_id)
            case ["commits", revision] if method == "GET":
                return self._commits(req, repo_type, repo_id, revision)
            case ["branch", branch] if method in ("POST", "DELETE"):
                return self._branch(req, method, repo_type, repo_id, branch)
            case ["settings"] if method == "PUT":
                return self._settings(req, repo_type, repo_id)
        raise HubError(404, f"Not found: {req.method} {req.path}")

    # -- account and repo life cycle -----------------------------------------------------
    def _whoami(self, req: Request) -> Response:
        if not self._authenticated(req):
            raise HubError(401, "Invalid username or password.")
        return Response.json(
            {
                "type": "user",
                "id": "0" * 24,
                "name": self.user,
                "fullname": "Test User",
                "email": None,
                "emailVerified": True,
                "isPro": False,
                "canPay": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "tests", "role": "write"}},
            }
        )

    def _create_repo(self, req: Request) -> Response:
        self._require_write(req)
        body = req.json()
        repo_type = body.get("type") or "model"
        name, namespace = body.get("name") or "", body.get("organization") or self.user
        if repo_type not in URL_PREFIX:
            raise HubError(400, f"Invalid repo type: {repo_type}")
        if not _NAME_RE.match(name) or "--" in name or ".." in name or not _NAME_RE.match(namespace):
            raise HubError(400, f"Invalid repo name: {namespace}/{name}")
        private = body.get("private") is True or body.get("visibility") == "private"
        repo_id = f"{namespace}/{name}"
        url = f"{self.endpoint}/{URL_PREFIX[repo_type]}{repo_id}"
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                return Response.json({"error": f"You already created this {repo_type} repo", "url": url}, 409)
            repo = Repo(repo_type, repo_id, private, _now())
            content = self._gitattributes()
            sha256 = self._store_object(content)
            entry = self._entry_for(".gitattributes", content, sha256, len(content), lfs=False)
            first = self._new_commit(repo, None, {entry.path: entry}, "initial commit", "")
            repo.branches["main"] = first.oid
            self._repos[(repo_type, repo_id)] = repo
            self._save_repo(repo)
        return Response.json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, req: Request) -> Response:
        self._require_write(req)
        body = req.json()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or self.user}/{body.get('name')}"
        with self._lock:
            if self._repos.pop((repo_type, repo_id), None) is None:
                raise HubError(404, "Repository not found", "RepoNotFound")
            shutil.rmtree(self.root / "repos" / repo_type / repo_id, ignore_errors=True)
        return Response.json({})

    def _settings(self, req: Request, repo_type: str, repo_id: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id, write=True)
        body = req.json()
        with self._lock:
            if "private" in body:
                repo.private = bool(body["private"])
            if "visibility" in body:
                repo.private = body["visibility"] == "private"
            self._save_repo(repo)
        return Response.json({})

    def _validate_yaml(self, req: Request) -> Response:
        content = req.json().get("content") or ""
        _, error = _front_matter(content)
        if error:
            return Response.json({"errors": [{"message": error}], "warnings": []}, status=400)
        return Response.json({"errors": [], "warnings": []})

    # -- read API ---------------------------------------------------------------------------
    def _repo_info(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id)
        commit = self._resolve(repo, revision)
        blobs = req.flag("blobs")
        siblings = []
        for path, entry in sorted(commit.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=entry.size, blobId=entry.blob_id)
                if entry.lfs:
                    pointer_size = len(lfs_pointer(entry.sha256, entry.size))
                    sibling["lfs"] = {"size": entry.size, "sha256": entry.sha256, "pointerSize": pointer_size}
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": hashlib.sha1(f"{repo_type}/{repo_id}".encode()).hexdigest()[:24],
            "id": repo_id,
            "author": repo_id.split("/")[0] if "/" in repo_id else None,
            "sha": commit.oid,
            "createdAt": repo.created_at,
            "lastModified": commit.date,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(e.size for e in commit.files.values()),
        }
        card_data = self._card_data(commit)
        if card_data is not None:
            info["cardData"] = card_data
        expand = req.query.get("expand") or req.query.get("expand[]")
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return Response.json(info)

    def _card_data(self, commit: Commit) -> dict | None:
        entry = commit.files.get("README.md")
        if entry is None:
            return None
        data, _ = _front_matter(self._object_path(entry.sha256).read_text(encoding="utf-8"))
        return data

    def _tree_entries(
        self, commit: Commit, prefix: str, recursive: bool, expand: bool
    ) -> list[dict[str, Any]]:
        """Files and folders under `prefix` ('' = root), folders first at each level like the Hub."""
        base = f"{prefix}/" if prefix else ""
        under = {p: e for p, e in commit.files.items() if p.startswith(base)}
        if prefix and not under:
            if prefix in commit.files:
                raise HubError(404, f"{prefix} is a file, not a folder", "EntryNotFound")
            raise HubError(404, f"Entry not found: {prefix}", "EntryNotFound")
        folders: dict[str, list[FileEntry]] = {}
        files: list[FileEntry] = []
        for path, entry in under.items():
            rel_parts = path[len(base) :].split("/")
            for depth in range(1, len(rel_parts)):
                if depth > 1 and not recursive:
                    break
                folders.setdefault(base + "/".join(rel_parts[:depth]), []).append(entry)
            if recursive or len(rel_parts) == 1:
                files.append(entry)
        commits = self._repos_commits(commit) if expand else None
        out = [_folder_to_api(path, folders[path], commits) for path in sorted(folders)]
        out.extend(entry.to_api(commits) for entry in sorted(files, key=lambda e: e.path))
        return out

    def _repos_commits(self, commit: Commit) -> dict[str, Commit]:
        """All commits of the repo holding `commit` (to describe files' last commits)."""
        with self._lock:
            for repo in self._repos.values():
                if repo.commits.get(commit.oid) is commit:
                    return dict(repo.commits)
        return {}

    def _tree(self, req: Request, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id)
        commit = self._resolve(repo, revision)
        expand = req.flag("expand")
        entries = self._tree_entries(commit, path.strip("/"), req.flag("recursive"), expand)
        page_size = min(self.tree_page_size, 50) if expand else self.tree_page_size
        return self._paginate(req, entries, page_size)

    def _paginate(self, req: Request, items: list, page_size: int) -> Response:
        """Cursor pagination through a `Link: <...>; rel="next"` header, as the Hub does."""
        start = int(req.param("cursor") or 0)
        page = items[start : start + page_size]
        headers = {}
        if start + page_size < len(items):
            query = {k: v[-1] for k, v in req.query.items() if k != "cursor"}
            query["cursor"] = str(start + page_size)
            headers["Link"] = f'<{self.endpoint}{req.path}?{urlencode(query)}>; rel="next"'
        return Response.json(page, headers=headers)

    def _paths_info(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id)
        commit = self._resolve(repo, revision)
        if "json" in (req.headers.get("Content-Type") or ""):
            body = req.json()
            paths, expand = body.get("paths") or [], bool(body.get("expand"))
        else:
            form = parse_qs(req.body.decode(), keep_blank_values=True)
            paths, expand = form.get("paths", []), (form.get("expand") or ["false"])[-1].lower() == "true"
        commits = self._repos_commits(commit) if expand else None
        out = []
        for path in dict.fromkeys(p.strip("/") for p in paths):  # unknown paths are left out
            under = [e for p, e in commit.files.items() if p.startswith(path + "/")]
            if path in commit.files:
                out.append(commit.files[path].to_api(commits))
            elif path and under:
                out.append(_folder_to_api(path, under, commits))
        return Response.json(out)

    def _refs(self, req: Request, repo_type: str, repo_id: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id)
        with self._lock:
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid}
                for name, oid in repo.branches.items()
            ]
        return Response.json({"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    def _commits(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id)
        commit: Commit | None = self._resolve(repo, revision)
        history = []
        with self._lock:
            while commit is not None:
                history.append(
                    {
                        "id": commit.oid,
                        "title": commit.title,
                        "message": commit.message,
                        "authors": [{"user": self.user}],
                        "date": commit.date,
                    }
                )
                commit = repo.commits.get(commit.parent) if commit.parent else None
        return self._paginate(req, history, 50)

    def _branch(self, req: Request, method: str, repo_type: str, repo_id: str, branch: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id, write=True)
        with self._lock:
            if method == "DELETE":
                if branch == "main" or branch not in repo.branches:
                    raise HubError(400 if branch == "main" else 404, f"Cannot delete branch {branch}")
                del repo.branches[branch]
            else:
                if branch.startswith("refs/") or not branch:
                    raise HubError(400, f"Invalid reference for a branch: {branch}")
                if branch in repo.branches:
                    raise HubError(409, f"Reference already exists: refs/heads/{branch}")
                start = self._resolve(repo, req.json().get("startingPoint") or "main")
                repo.branches[branch] = start.oid
            self._save_repo(repo)
        return Response.json({})

    # -- file download --------------------------------------------------------------------
    def _resolve_file(self, req: Request, segments: list[str]) -> Response:
        repo_type = "model"
        if segments[0] in PLURAL_TO_TYPE and segments[0] != "models":
            repo_type, segments = PLURAL_TO_TYPE[segments[0]], segments[1:]
        at = segments.index("resolve")
        repo_id, rest = "/".join(segments[:at]), segments[at + 1 :]
        if not rest:
            raise HubError(404, "Missing revision", "RevisionNotFound")
        repo = self._get_repo(req, repo_type, repo_id)
        commit = self._resolve(repo, rest[0])
        path = "/".join(rest[1:])
        entry = commit.files.get(path)
        headers = {"X-Repo-Commit": commit.oid}
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers=headers)
        if entry.lfs:
            headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)})
            if self.cdn_endpoint is not None:
                headers.update(
                    {"ETag": f'"{entry.blob_id}"', "Location": f"{self.cdn_endpoint}/_cdn/{entry.sha256}"}
                )
                return Response(302, headers)
            headers["ETag"] = f'"{entry.sha256}"'
        else:
            headers["ETag"] = f'"{entry.blob_id}"'
        return self._serve_object(req, entry.sha256, headers)

    def _serve_object(self, req: Request, sha256: str, headers: dict[str, str]) -> Response:
        data = self._object_path(sha256).read_bytes()
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers}
        range_header = req.headers.get("Range")
        if not range_header:
            return Response(200, headers, data)
        match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", range_header)
        if match is None or match.groups() == ("", ""):
            raise HubError(400, f"Unsupported Range header: {range_header}")
        first, last = match.groups()
        size = len(data)
        if first == "":  # suffix range: the last N bytes
            start, end = max(size - int(last), 0), size - 1
        else:
            start, end = int(first), min(int(last), size - 1) if last else size - 1
        if start >= size or start > end:
            raise HubError(416, "Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"})
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return Response(206, headers, data[start : end + 1])

    # -- upload: preupload, LFS, commit ---------------------------------------------------
    def _preupload(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id, write=True)
        commit = self._resolve(repo, revision)
        out = []
        for item in req.json().get("files") or []:
            path, size = item.get("path"), item.get("size")
            if not isinstance(path, str) or not isinstance(size, int):
                raise HubError(400, "Each file needs a 'path' (str) and a 'size' (int)")
            sample = base64.b64decode(item.get("sample") or "")
            existing = commit.files.get(path)
            remote_oid = None if existing is None else existing.sha256 if existing.lfs else existing.blob_id
            mode = "lfs" if self._should_use_lfs(path, size, sample) else "regular"
            out.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": remote_oid})
        return Response.json({"files": out, "commitOid": commit.oid})

    def _lfs_api(self, req: Request, method: str, segments: list[str]) -> Response:
        repo_type = "model"
        if segments[0] in PLURAL_TO_TYPE and segments[0] != "models":
            repo_type, segments = PLURAL_TO_TYPE[segments[0]], segments[1:]
        at = next(i for i, s in enumerate(segments) if s.endswith(".git"))
        repo_id = "/".join([*segments[:at], segments[at][: -len(".git")]])
        action = segments[at + 1 :]
        if method == "POST" and action == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(req, repo_type, repo_id)
        if method == "POST" and action == ["info", "lfs", "objects", "verify"]:
            self._get_repo(req, repo_type, repo_id, write=True)
            body = req.json()
            if not self._has_object(str(body.get("oid")), body.get("size")):
                return Response.json(
                    {"message": "Object not found"}, 404, ctype="application/vnd.git-lfs+json"
                )
            return Response.json({}, ctype="application/vnd.git-lfs+json")
        raise HubError(404, f"Not found: {req.method} {req.path}")

    def _lfs_batch(self, req: Request, repo_type: str, repo_id: str) -> Response:
        body = req.json()
        operation = body.get("operation")
        repo = self._get_repo(req, repo_type, repo_id, write=operation == "upload")
        objects = []
        for obj in body.get("objects") or []:
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not _SHA256_RE.match(oid) or not isinstance(size, int) or size < 0:
                objects.append(
                    {
                        "oid": str(oid),
                        "size": int(size or 0),
                        "error": {"code": 422, "message": "Invalid object"},
                    }
                )
                continue
            item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if operation == "upload" and not self._has_object(oid, size):
                ticket = secrets.token_urlsafe(16)
                with self._lock:
                    self._upload_tickets[ticket] = (oid, size)
                item["actions"] = {
                    "upload": {"href": f"{self.endpoint}/_lfs/upload/{oid}?ticket={ticket}"},
                    "verify": {"href": f"{self.endpoint}/{repo.url_path}.git/info/lfs/objects/verify"},
                }
            elif operation == "download":
                if not self._has_object(oid, size):
                    item["error"] = {"code": 404, "message": "Object does not exist"}
                else:
                    item["actions"] = {
                        "download": {"href": f"{self.cdn_endpoint or self.endpoint}/_cdn/{oid}"}
                    }
            objects.append(item)
        payload = {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}
        return Response.json(payload, ctype="application/vnd.git-lfs+json")

    def _lfs_upload(self, req: Request, oid: str) -> Response:
        # Like a presigned S3 URL: the ticket from the batch answer is the credential.
        with self._lock:
            expected = self._upload_tickets.get(req.param("ticket") or "")
        if expected is None or expected[0] != oid:
            raise HubError(403, "Invalid or expired upload URL")
        if len(req.body) != expected[1]:
            raise HubError(400, f"Size mismatch: announced {expected[1]} bytes, received {len(req.body)}")
        if hashlib.sha256(req.body).hexdigest() != oid:
            raise HubError(400, "sha256 of the uploaded content does not match the object id")
        self._store_object(req.body)
        return Response(200, {"ETag": f'"{oid}"'})

    def _commit(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
        repo = self._get_repo(req, repo_type, repo_id, write=True)
        if req.flag("create_pr"):
            raise HubError(400, "Pull requests are not supported by this test server")
        lines = [json.loads(line) for line in req.body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first NDJSON line of a commit must be the header")
        header = lines[0].get("value") or {}
        title = header.get("summary") or ""
        if not title:
            raise HubError(400, "A commit needs a summary")
        with self._lock:
            if revision not in repo.branches:
                self._resolve(repo, revision)  # 404 when unknown
                raise HubError(400, f"Can only commit to a branch, not to {revision}")
            head = repo.commits[repo.branches[revision]]
            parent = header.get("parentCommit")
            if parent and not head.oid.startswith(parent):
                raise HubError(412, f"Parent commit {parent} is not the head of {revision} ({head.oid})")
            files = self._apply_operations(dict(head.files), lines[1:])
            commit = self._new_commit(repo, head, files, title, header.get("description") or "")
            repo.branches[revision] = commit.oid
            self._save_repo(repo)
        commit_url = f"{self.endpoint}/{repo.url_path}/commit/{commit.oid}"
        return Response.json(
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": commit_url,
                "hookOutput": "",
                "pullRequestUrl": None,
            }
        )

    def _apply_operations(self, files: dict[str, FileEntry], operations: list[dict]) -> dict[str, FileEntry]:
        for op in operations:
            key, value = op.get("key"), op.get("value") or {}
            path = str(value.get("path") or "").strip("/")
            if (
                not path
                or any(part in ("", ".", "..") for part in path.split("/"))
                or path.startswith(".git/")
            ):
                raise HubError(400, f"Invalid path in commit: {path!r}")
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, f"Unsupported encoding {value.get('encoding')!r}")
                data = base64.b64decode(value.get("content") or "")
                files[path] = self._entry_for(path, data, self._store_object(data), len(data), lfs=False)
            elif key == "lfsFile":
                oid = str(value.get("oid") or "")
                if value.get("algo", "sha256") != "sha256" or not self._has_object(oid, value.get("size")):
                    raise HubError(
                        422, f"LFS object {oid} of {path} was not uploaded (call the batch API first)"
                    )
                size = self._object_path(oid).stat().st_size
                files[path] = self._entry_for(path, None, oid, size, lfs=True)
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            elif key == "deletedFolder":
                doomed = [p for p in files if p.startswith(path + "/")]
                if not doomed:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in doomed:
                    del files[p]
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        return files


def _folder_to_api(path: str, entries: list[FileEntry], commits: dict[str, Commit] | None) -> dict[str, Any]:
    """A folder as the tree and paths-info endpoints describe it; `commits` given = expanded."""
    item: dict[str, Any] = {"type": "directory", "oid": _tree_oid(entries), "path": path}
    if commits is not None:
        latest = max(entries, key=lambda e: commits[e.last_commit].date)
        item["lastCommit"] = commits[latest.last_commit].summary()
    return item


def _tree_oid(entries: list[FileEntry]) -> str:
    return hashlib.sha1(
        "".join(f"{e.path}:{e.blob_id}\n" for e in sorted(entries, key=lambda e: e.path)).encode()
    ).hexdigest()


def _front_matter(content: str) -> tuple[dict | None, str | None]:
    """A README's YAML front matter and what is wrong with it: (mapping, None), (None, error), or
    (None, None) where there is none (or no PyYAML: a dependency of the project, needed only here)."""
    match = _FRONT_MATTER_RE.match(content)
    if match is None:
        return None, None
    try:
        import yaml
    except ImportError:
        return None, None
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        return None, f"Invalid YAML in README.md front matter: {err}"
    if data is not None and not isinstance(data, dict):
        return None, "README.md front matter must be a YAML mapping"
    return data, None


def _localhost_is_loopback() -> bool:
    try:
        return any(
            info[4][0] == "127.0.0.1" for info in socket.getaddrinfo("localhost", None, socket.AF_INET)
        )
    except OSError:
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # keep-alive handler threads must not block interpreter exit
    allow_reuse_address = True
    hub: HubServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients' connection pools expect
    timeout = 60  # an idle keep-alive connection frees its thread after this
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm
        # holds the body until the client's delayed ACK (~40 ms per request).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def log_message(self, format: str, *args: Any) -> None:  # silence stderr; the hub keeps a log
        pass

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self) -> None:
        hub = self.server.hub
        split = urlsplit(self.path)
        authenticated = False
        try:
            body = self._read_body()
            req = Request(
                self.command, split.path, parse_qs(split.query, keep_blank_values=True), self.headers, body
            )
            try:
                authenticated = hub._authenticated(req)
                response = hub.handle(req)
            except HubError as err:
                response = err.response()
        except Exception as err:
            # A bug in this server: answer at once with the traceback, never hang. 501 rather than
            # 500 because the clients retry 5xx answers with backoff, which would only slow tests.
            message = f"hub_server bug: {type(err).__name__}: {err}"
            response = Response.json({"error": message, "traceback": traceback.format_exc()}, 501)
        # Log before answering: once the client has the answer, the log already shows the request.
        with hub._lock:
            hub._log.append(
                LoggedRequest(self.command, split.path, split.query, response.status, authenticated)
            )
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD" and response.body:
            self.wfile.write(response.body)
