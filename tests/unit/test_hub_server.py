"""Raw-protocol checks of the test Hub (tests/hub_server.py), with plain http.client requests."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import RevisionNotFoundError

from tests.hub_server import HubServer, git_blob_oid


def _call(
    server: HubServer,
    method: str,
    url: str,
    body: bytes | dict | None = None,
    token: str | None = "",
    **headers,
):
    """One request, no redirect following. token="" means the server's token, None means none."""
    parts = urlsplit(url if "://" in url else server.endpoint + url)
    if isinstance(body, dict):
        body, headers = json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    if token is not None:
        headers["Authorization"] = f"Bearer {token or server.token}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(
            method, parts.path + (f"?{parts.query}" if parts.query else ""), body=body, headers=headers
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _commit(server: HubServer, repo_id: str, *operations: dict, parent: str | None = None, revision="main"):
    header = {"summary": "test commit", "description": ""}
    if parent:
        header["parentCommit"] = parent
    lines = [{"key": "header", "value": header}, *operations]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return _call(
        server,
        "POST",
        f"/api/models/{repo_id}/commit/{revision}",
        body,
        **{"Content-Type": "application/x-ndjson"},
    )


@pytest.fixture
def hub():
    with HubServer(tree_page_size=2) as server:
        yield server


@pytest.fixture
def repo(hub):
    status, _, _ = _call(hub, "POST", "/api/repos/create", {"name": "r", "type": "model"})
    assert status == 200
    return f"{hub.user}/r"


def test_auth_and_repo_creation(hub, repo):
    assert _call(hub, "GET", "/api/whoami-v2", token=None)[0] == 401
    assert _call(hub, "GET", "/api/whoami-v2", token="hf_wrong")[0] == 401
    status, _, body = _call(hub, "GET", "/api/whoami-v2")
    assert status == 200 and json.loads(body)["name"] == hub.user

    status, _, body = _call(hub, "POST", "/api/repos/create", {"name": "r", "type": "model"})
    assert status == 409 and json.loads(body)["url"] == f"{hub.endpoint}/{repo}"
    assert _call(hub, "POST", "/api/repos/create", {"name": "other"}, token=None)[0] == 401


def test_regular_file_commit_and_resolve_with_range(hub, repo):
    content = b"hello hub\n"
    file_op = {
        "key": "file",
        "value": {"path": "a/b.txt", "content": base64.b64encode(content).decode(), "encoding": "base64"},
    }
    status, _, body = _commit(hub, repo, file_op)
    assert status == 200
    oid = json.loads(body)["commitOid"]

    status, headers, _ = _call(hub, "HEAD", f"/{repo}/resolve/main/a/b.txt", token=None)
    assert status == 200
    assert headers["ETag"] == f'"{git_blob_oid(content)}"' and headers["X-Repo-Commit"] == oid
    assert headers["Content-Length"] == str(len(content))
    status, headers, body = _call(
        hub, "GET", f"/{repo}/resolve/{oid[:10]}/a/b.txt", token=None, Range="bytes=6-"
    )
    assert (status, body, headers["Content-Range"]) == (206, b"hub\n", "bytes 6-9/10")
    status, headers, _ = _call(hub, "HEAD", f"/{repo}/resolve/main/missing.txt")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (404, "EntryNotFound", oid)


def test_lfs_batch_upload_verify_commit_and_cdn_redirect(hub, repo):
    content = bytes(range(256)) * 8
    sha256 = hashlib.sha256(content).hexdigest()
    batch_url = f"/{repo}.git/info/lfs/objects/batch"
    batch = {
        "operation": "upload",
        "transfers": ["basic"],
        "objects": [{"oid": sha256, "size": len(content)}],
    }

    lfs_op = {
        "key": "lfsFile",
        "value": {"path": "w.bin", "algo": "sha256", "oid": sha256, "size": len(content)},
    }
    assert _commit(hub, repo, lfs_op)[0] == 422  # not uploaded yet
    status, _, body = _call(hub, "POST", batch_url, batch)
    actions = json.loads(body)["objects"][0]["actions"]
    assert status == 200 and actions["upload"]["href"].startswith(hub.endpoint)
    assert _call(hub, "PUT", actions["upload"]["href"], content[:-1], token=None)[0] == 400  # size checked
    assert _call(hub, "PUT", actions["upload"]["href"], content, token=None)[0] == 200
    verify = {"oid": sha256, "size": len(content)}
    assert _call(hub, "POST", actions["verify"]["href"], verify)[0] == 200
    assert "actions" not in json.loads(_call(hub, "POST", batch_url, batch)[2])["objects"][0]  # already there
    assert _commit(hub, repo, lfs_op)[0] == 200

    status, headers, _ = _call(hub, "HEAD", f"/{repo}/resolve/main/w.bin")
    assert headers["X-Linked-Etag"] == f'"{sha256}"' and headers["X-Linked-Size"] == str(len(content))
    if hub.cdn_endpoint is not None:
        assert status == 302 and headers["Location"].startswith(hub.cdn_endpoint)
        status, _, body = _call(hub, "GET", headers["Location"], token=None)
    else:
        status, _, body = _call(hub, "GET", f"/{repo}/resolve/main/w.bin")
    assert status == 200 and body == content
    assert hub.file_entry(repo, "w.bin").lfs


def test_parent_commit_and_revisions(hub, repo):
    head = hub.head_sha(repo)
    op = {"key": "file", "value": {"path": "x", "content": "eA==", "encoding": "base64"}}
    assert _commit(hub, repo, op, parent="0" * 40)[0] == 412
    assert _commit(hub, repo, op, parent=head)[0] == 200
    assert _commit(hub, repo, op, revision=head)[0] == 400  # commits go to branches only
    assert _commit(hub, repo, {"key": "deletedFile", "value": {"path": "nope"}})[0] == 404
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.endpoint).model_info(repo, revision="no-such-branch")


def test_tree_is_paginated_through_link_headers(hub, repo):
    ops = [
        {"key": "file", "value": {"path": f"d/f{i}.txt", "content": "eA==", "encoding": "base64"}}
        for i in range(5)
    ]
    assert _commit(hub, repo, *ops)[0] == 200
    hub.clear_requests()

    paths = [entry.path for entry in HfApi(endpoint=hub.endpoint).list_repo_tree(repo, recursive=True)]

    assert sorted(paths) == [".gitattributes", "d", *[f"d/f{i}.txt" for i in range(5)]]
    assert len(hub.find_requests("GET", r"/tree/main$")) == 4  # 7 entries, 2 per page


def test_concurrent_commits_all_land(hub, repo):
    api = HfApi(endpoint=hub.endpoint)

    def upload(i: int) -> str:
        data = bytes([i]) * (20_000 + i)  # above the LFS threshold: batch + PUT per file
        return api.upload_file(path_or_fileobj=data, path_in_repo=f"shard-{i}.bin", repo_id=repo).oid

    with ThreadPoolExecutor(max_workers=8) as pool:
        oids = list(pool.map(upload, range(8)))

    assert len(set(oids)) == 8
    assert hub.list_files(repo) == [".gitattributes", *[f"shard-{i}.bin" for i in range(8)]]
    assert all(hub.read_file(repo, f"shard-{i}.bin") == bytes([i]) * (20_000 + i) for i in range(8))


@pytest.mark.slow  # a subprocess (its environment is the subject)
def test_subprocesses_use_the_session_hub(hub_server):
    code = "from huggingface_hub import HfApi; print(HfApi().whoami()['name'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hub_server.user
    assert hub_server.find_requests("GET", "^/api/whoami-v2$")[-1].status == 200
