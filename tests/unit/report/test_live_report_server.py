"""`finetune report --serve` in this process: the server on port 0 in a thread, fetched with http.client.
The page is the static report's body (finetune.report.page) plus the live script; a line appended to
progress.jsonl arrives as a server-sent event holding the new point; a damaged line and a run folder
that disappears are shown, not fatal; nothing outside the run folders is served; it binds 127.0.0.1
unless told otherwise, then with a warning; CLI flags that would do nothing are errors."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import threading
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.errors import FinetuneError
from finetune.report.page import body_html
from finetune.report.runs import load_run
from finetune.report.serve import being_written, make_server, serve_report, sse_event


def write_run(folder: Path, steps: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "recipe.resolved.yaml").write_text("model:\n  model_path: null\ntrain:\n  objective: sft\n")
    append(folder, *({"step": s, "loss": 4.0 / s, "lr": 1e-3} for s in range(1, steps + 1)))
    return folder


def append(folder: Path, *records: dict | str) -> None:
    with open(folder / "progress.jsonl", "a") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def loss_steps(html: str) -> dict[str, list[int]]:
    """run -> the steps of the loss chart's points, as drawn."""
    chart = re.search(r'<figure class="chart" data-key="loss".*?</figure>', html, re.S)
    assert chart, "no loss chart"
    groups = re.findall(r'<g class="series" data-run="([^"]*)"(.*?)</g>', chart.group(0), re.S)
    return {run: [int(s) for s in re.findall(r'data-step="(\d+)"', body)] for run, body in groups}


@pytest.fixture
def serving(tmp_path):
    """Two runs served on a free port; yields (server, {label: folder})."""
    runs = {"sft": write_run(tmp_path / "sft", 3), "dpo": write_run(tmp_path / "dpo", 2)}
    server = make_server([str(p) for p in runs.values()], port=0, poll_s=0.02)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, runs
    server.shutdown()
    server.close()
    thread.join(timeout=5)


def get(server, path: str, host: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.putrequest("GET", path, skip_host=host is not None)  # the path is sent as it is, not normalised
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


class Events:
    """An open /events stream, read one event at a time."""

    def __init__(self, server):
        self.conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        self.conn.request("GET", "/events")
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        assert self.response.getheader("Content-Type").startswith("text/event-stream")

    def next(self) -> tuple[str, str]:
        """(event name, data) of the next event (comments and retry lines skipped)."""
        name, data = None, []
        while True:
            line = self.response.fp.readline().decode("utf-8")
            assert line, "the stream ended"
            line = line.rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
            elif line == "" and name is not None:
                return name, "\n".join(data)

    def until(self, wanted: str, limit: int = 50) -> str:
        """The data of the first update event holding `wanted` (a folder removed file by file, or a file
        written in two steps, may show an intermediate state first)."""
        for _ in range(limit):
            name, data = self.next()
            if name == "update" and wanted in data:
                return data
        raise AssertionError(f"no event holding {wanted!r} in {limit} events; the last: {data[:2000]}")

    def close(self) -> None:
        self.conn.close()


def test_the_page_is_the_static_report_with_the_live_script(serving):
    server, runs = serving
    status, headers, body = get(server, "/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    static = body_html([load_run(path, label) for label, path in runs.items()])  # the static report's
    assert loss_steps(page) == loss_steps(static) == {"sft": [1, 2, 3], "dpo": [1, 2]}
    (nonce,) = re.findall(r'<script nonce="([^"]+)">', page)
    csp = headers["Content-Security-Policy"]
    assert (
        f"script-src 'nonce-{nonce}'" in csp and "default-src 'none'" in csp and "connect-src 'self'" in csp
    )
    assert 'id="live-status"' in page and 'id="live-body"' in page
    assert '<a href="/files/0/progress.jsonl">' in page and '<a href="/files/1/recipe.resolved.yaml">' in page


def test_a_line_appended_to_progress_jsonl_arrives_as_an_event(serving):
    server, runs = serving
    events = Events(server)
    try:
        name, first = events.next()  # the page as it is, on connecting
        assert name == "update" and loss_steps(first) == {"sft": [1, 2, 3], "dpo": [1, 2]}
        append(runs["sft"], {"step": 4, "loss": 0.5, "lr": 1e-3})
        name, second = events.next()
        assert name == "update" and loss_steps(second) == {"sft": [1, 2, 3, 4], "dpo": [1, 2]}
        assert 'data-step="4" data-value="0.5"' in second
        reference = body_html([load_run(path, label) for label, path in runs.items()])
        assert loss_steps(second) == loss_steps(reference)
    finally:
        events.close()


def test_a_damaged_line_and_a_vanished_run_folder_are_shown_not_fatal(serving):
    server, runs = serving
    events = Events(server)
    try:
        events.next()
        append(runs["dpo"], '{"step": 3, "loss": 0.6')  # as a crash mid-write leaves it
        _, data = events.next()
        assert 'class="missing damaged" data-run="dpo" data-count="1"' in data
        assert loss_steps(data) == {"sft": [1, 2, 3], "dpo": [1, 2]}
        shutil.rmtree(runs["dpo"])
        data = events.until(
            f"dpo: cannot be read now: {runs['dpo']} is not a training output_dir: it does not exist"
        )
        assert "The page follows it again once the folder holds a run" in data
        assert loss_steps(data) == {"sft": [1, 2, 3]}
        write_run(runs["dpo"], 1)
        data = events.until('data-run="dpo" data-logged="1"')
        assert loss_steps(data) == {"sft": [1, 2, 3], "dpo": [1]}
    finally:
        events.close()
    shutil.rmtree(runs["dpo"])  # the page itself, with the folder gone again
    status, _, body = get(server, "/")
    assert status == 200 and b"it does not exist" in body


def test_a_line_being_written_waits_for_its_newline(tmp_path):
    run = write_run(tmp_path / "run", 1)
    assert not being_written([run])
    with open(run / "progress.jsonl", "a") as f:
        f.write('{"step": 2, "lo')
    mtime = (run / "progress.jsonl").stat().st_mtime
    assert being_written([run], now=mtime + 0.1)
    assert not being_written([run], now=mtime + 5)  # still cut short long after: damaged, shown as such


def test_sse_event_keeps_every_line_of_the_data():
    assert sse_event("update", "<pre>a\r\nb</pre>") == b"event: update\ndata: <pre>a&#13;\ndata: b</pre>\n\n"


@pytest.mark.parametrize(
    "path",
    [
        "/files/0/../dpo/progress.jsonl",
        "/files/0/../../outside/secret.txt",
        "/files/0/%2e%2e/%2e%2e/outside/secret.txt",
        "/files/0/%2E%2E%2F%2E%2E%2Foutside%2Fsecret.txt",
        "/files/0/..%5c..%5coutside%5csecret.txt",
        "/files/0//{outside}/secret.txt",
        "/files/0/{outside}/secret.txt",
        "/{outside}/secret.txt",
        "/files/0/link-out.txt",
        "/files/0/dir-out/secret.txt",
        "/files/9/progress.jsonl",
        "/files/-1/progress.jsonl",
        "/files/0/",
        "/files/0/./progress.jsonl",
        "/files/0/recipe.resolved.yaml%00.png",
        "/progress.jsonl",
    ],
)
def test_nothing_outside_the_run_folders_is_served(serving, tmp_path, path):
    server, runs = serving
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET")
    (runs["sft"] / "link-out.txt").symlink_to(outside / "secret.txt")
    (runs["sft"] / "dir-out").symlink_to(outside, target_is_directory=True)
    path = path.replace("{outside}", str(outside).lstrip("/")).replace("/outside/", f"/{outside.name}/")
    path = path.replace("outside%2F", f"{outside.name}%2F").replace("outside%5c", f"{outside.name}%5c")
    status, _, body = get(server, path)
    assert status in (403, 404), (path, status)
    assert b"SECRET" not in body and b'"step"' not in body


def test_files_inside_a_run_folder_are_served_as_plain_text(serving):
    server, runs = serving
    (runs["sft"] / "samples").mkdir()
    (runs["sft"] / "samples" / "page.html").write_text("<script>alert(1)</script>")
    (runs["sft"] / "inside.txt").symlink_to(runs["sft"] / "progress.jsonl")  # a link inside is fine
    for path, file in (("progress.jsonl", "progress.jsonl"), ("inside.txt", "progress.jsonl")):
        status, headers, body = get(server, f"/files/0/{path}")
        assert status == 200 and body == (runs["sft"] / file).read_bytes()
    status, headers, body = get(server, "/files/0/samples/page.html")
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"  # never run as a page
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_another_host_name_is_refused(serving):
    server, _ = serving
    port = server.server_address[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert get(server, "/files/0/progress.jsonl", host=host)[0] == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}", "[evil]"):
        status, _, body = get(server, "/", host=host)  # a DNS-rebinding page sends its own name
        assert status == 403 and b"finetune report" not in body, host


def test_it_binds_loopback_unless_told_and_warns_then(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", 1)
    server = make_server([str(run)], port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.close()
    from finetune.report import serve

    monkeypatch.setattr(serve.LiveServer, "serve_forever", lambda self: None)  # return at once
    assert serve_report([str(run)], host="0.0.0.0", port=0) == 0
    out, err = capsys.readouterr()
    assert "warning: --host 0.0.0.0: the report and the files of its run folders are served to anyone" in err
    assert "serving the report of 1 run(s) at http://0.0.0.0:" in out and "stopped serving" in out
    assert serve_report([str(run)], port=0) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "at http://127.0.0.1:" in out


def test_a_folder_that_is_not_a_run_yet_is_a_warning_and_waited_for(tmp_path, capsys, monkeypatch):
    from finetune.report import serve

    monkeypatch.setattr(serve.LiveServer, "serve_forever", lambda self: None)
    assert main(["report", str(tmp_path / "soon"), "--serve", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'soon'} is not a training output_dir: it does not exist" in err
    assert "The page shows it once training writes there" in err


def test_ctrl_c_stops_it_cleanly(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", 1)
    from finetune.report import serve

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.LiveServer, "serve_forever", interrupted)
    assert main(["report", str(run), "--serve", "--port", "0"]) == 0
    out, err = capsys.readouterr()
    assert "stopped serving the report" in out and "Traceback" not in err


def test_flags_that_would_do_nothing_and_a_busy_port_are_errors(tmp_path, capsys):
    run = write_run(tmp_path / "run", 1)
    assert main(["report", str(run), "--port", "0", "--output", str(tmp_path / "r.html")]) == 2
    assert "--port and --host are for --serve" in capsys.readouterr().err
    assert main(["report", str(run), "--serve", "--output", str(tmp_path / "r.html")]) == 2
    assert "--output writes a file, --serve serves the page instead" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FinetuneError, match=f"port {port} on 127.0.0.1 is in use: pass another --port"):
            make_server([str(run)], port=port)
    with pytest.raises(FinetuneError, match="--port 70000 is not a port"):
        make_server([str(run)], port=70000)
    with pytest.raises(
        FinetuneError, match=r"cannot serve on 192\.0\.2\.1:0: .*the default --host 127\.0\.0\.1"
    ):
        make_server([str(run)], host="192.0.2.1", port=0)  # TEST-NET: an address of no interface here
