"""`finetune report OUTPUT_DIR [...] --serve`: the report page served on this machine, kept current while
training appends to progress.jsonl.

The server is the standard library's ThreadingHTTPServer (no dependency). Three routes:

- `/`: the same page as the static report (finetune.report.page), plus a status line and a short
  inline script;
- `/events`: server-sent events. Each connection looks at the runs' files every `POLL_S` seconds
  (size and modification time: the standard library has no portable file-change notification, and
  a stat per file per quarter second costs nothing) and, when one changed, sends the whole page body
  again as an `update` event, which the script puts in place. A line still being written (no
  newline yet, modified this second) waits for the next look;
- `/files/<run number>/<path>`: a file inside a run folder (progress.jsonl, eval.json, the resolved
  recipe, samples), linked from the page. A path that leaves the folder (`..`, an absolute path,
  a symlink out, the same encoded) is refused (403), anything else unknown is 404.

A run folder that disappears, or a damaged line, is shown on the page as the static report shows a
problem; the server keeps serving. It binds 127.0.0.1 unless `--host` says otherwise (then with a
warning), answers only requests addressed to that host (a DNS-rebinding page cannot read it), holds
nothing secret, and sends a Content-Security-Policy that lets the page load nothing from elsewhere.
"""

from __future__ import annotations

import errno
import ipaddress
import secrets
import shutil
import signal
import socket
import threading
import time
from html import escape
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from finetune.errors import FinetuneError
from finetune.notices import warn
from finetune.report.page import body_html, render
from finetune.report.runs import EVAL_JSON, PROGRESS, RECIPE, RunData, load_run, run_labels

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
POLL_S = 0.25
KEEPALIVE_S = 15.0
WRITING_S = 1.0  # a last line without its newline, younger than this, is being written: wait for it
WATCHED = (PROGRESS, RECIPE, EVAL_JSON)
TEXT_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".txt", ".md", ".log", ".csv")
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}

SCRIPT = """(() => {
  const status = document.getElementById('live-status');
  const source = new EventSource('/events');
  let updates = 0;
  source.addEventListener('update', (event) => {
    document.getElementById('live-body').innerHTML = event.data;
    updates += 1;
    status.dataset.state = 'live';
    status.dataset.updates = String(updates);
    status.textContent = 'live: updated ' + new Date().toLocaleTimeString() + '; the page follows the runs as they log';
  });
  source.onerror = () => {
    status.dataset.state = 'lost';
    status.textContent = 'connection to finetune report --serve lost: retrying (is it still running?)';
  };
})();"""


# ------------------------------------------------------------------------------------- the runs


def read_runs(paths: list[Path], labels: list[str]) -> list[RunData]:
    """The runs as the page shows them now; a folder that is gone or cannot be read becomes a run
    with that problem on the page instead of an error (it may come back: a resumed run, a copy)."""
    runs = []
    for path, label in zip(paths, labels, strict=True):
        try:
            runs.append(load_run(path, label))
        except (FinetuneError, OSError) as exc:  # OSError: removed between the check and the read
            problem = f"cannot be read now: {exc}. The page follows it again once the folder holds a run"
            runs.append(RunData(label=label, path=path, recipe={}, problems=[problem]))
    return runs


def files_state(paths: list[Path]) -> tuple:
    """What changes when a run logs: each watched file's size and modification time (None if absent)."""
    state = []
    for path in paths:
        for name in WATCHED:
            try:
                stat = (path / name).stat()
                state.append((stat.st_size, stat.st_mtime_ns))
            except OSError:
                state.append(None)
    return tuple(state)


def being_written(paths: list[Path], now: float | None = None) -> bool:
    """Whether a progress.jsonl ends in a line without its newline that was written this second
    (the writer is mid-line: wait rather than show it as damaged)."""
    now = time.time() if now is None else now
    for path in paths:
        try:
            with open(path / PROGRESS, "rb") as f:
                f.seek(0, 2)
                if f.tell() == 0:
                    continue
                f.seek(-1, 2)
                unterminated = f.read(1) != b"\n"
            if unterminated and now - (path / PROGRESS).stat().st_mtime < WRITING_S:
                return True
        except OSError:
            continue
    return False


def live_body(runs: list[RunData]) -> str:
    """The page body the events carry: the report's sections and the links to each run's files."""
    links = []
    for number, run in enumerate(runs):
        found = [name for name in WATCHED if (run.path / name).is_file()]
        items = " ".join(f'<a href="/files/{number}/{name}">{name}</a>' for name in found) or "none yet"
        links.append(f"<li>{escape(run.label)}: {items}</li>")
    files = f'<section id="files"><h2>Files</h2><ul>{"".join(links)}</ul></section>'
    return body_html(runs) + files


def live_page(runs: list[RunData], nonce: str) -> str:
    status = (
        '<p id="live-status" class="muted" data-state="connecting" data-updates="0">live: connecting to '
        "finetune report --serve</p>"
    )
    return render(runs, live=status + f'<script nonce="{nonce}">{SCRIPT}</script>', body=live_body(runs))


def sse_event(name: str, data: str) -> bytes:
    """One server-sent event; `data` may hold newlines (one `data:` line each, as the format wants;
    a carriage return would also end a line, so it is written as its HTML character reference).

    >>> sse_event("update", "a\\nb")
    b'event: update\\ndata: a\\ndata: b\\n\\n'
    """
    lines = data.replace("\r", "&#13;").split("\n")
    return (f"event: {name}\n" + "".join(f"data: {line}\n" for line in lines) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------- files


def resolve_file(roots: list[Path], url_path: str) -> tuple[HTTPStatus, Path | None]:
    """The file that `/files/<run number>/<path>` names, or why not: 403 for a path that would leave
    the run folder (`..`, `.`, an absolute or empty segment, a backslash, a symlink out, encoded or
    not), 404 for one that names nothing."""
    parts = unquote(url_path).split("/")  # ['', 'files', number, segment, ...]; %2f is a separator too
    if len(parts) < 4 or parts[:2] != ["", "files"] or not parts[2].isdigit() or int(parts[2]) >= len(roots):
        return HTTPStatus.NOT_FOUND, None
    segments = parts[3:]
    if any(s in ("", ".", "..") or "\\" in s or "\x00" in s for s in segments):
        return HTTPStatus.FORBIDDEN, None
    root = roots[int(parts[2])].resolve()
    target = root.joinpath(*segments).resolve()  # follows symlinks: one that points out is caught here
    if not target.is_relative_to(root):
        return HTTPStatus.FORBIDDEN, None
    if not target.is_file():
        return HTTPStatus.NOT_FOUND, None
    return HTTPStatus.OK, target


def _content_type(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text/plain; charset=utf-8"  # never text/html: a run's file runs no script on this origin
    return IMAGE_TYPES.get(suffix, "application/octet-stream")


# --------------------------------------------------------------------------------------- server


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine.

    >>> [is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "192.168.1.5")]
    [True, True, True, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LiveServer(ThreadingHTTPServer):
    """The HTTP server with the runs it serves and the event that stops its event streams."""

    daemon_threads = True  # an open event stream does not keep the process alive after Ctrl-C

    def __init__(self, address, paths: list[Path], labels: list[str], poll_s: float):
        self.paths, self.labels, self.poll_s = paths, labels, poll_s
        self.stopping = threading.Event()
        super().__init__(address, LiveHandler)

    def close(self) -> None:
        """Stop the event streams and the listening socket (after serve_forever returned)."""
        self.stopping.set()
        self.server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class LiveServer6(LiveServer):
    address_family = socket.AF_INET6


def make_server(output_dirs: list[str], host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
                poll_s: float = POLL_S) -> LiveServer:  # fmt: skip
    """Bind host:port (0: any free port) for the runs in `output_dirs`; errors name the flag to change.
    A folder need not be a run yet (`--serve` may start before training does): see not_runs_yet."""
    if not 0 <= port <= 65535:
        raise FinetuneError(f"--port {port} is not a port: give 1-65535, or 0 for any free one")
    paths = [Path(p) for p in output_dirs]
    labels = run_labels(paths)
    cls = LiveServer6 if ":" in host else LiveServer
    try:
        return cls((host, port), paths, labels, poll_s)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise FinetuneError(
                f"port {port} on {host} is in use: pass another --port, or --port 0 for any free one"
            ) from None
        raise FinetuneError(
            f"cannot serve on {host}:{port}: {exc.strerror or exc}; the default --host {DEFAULT_HOST} "
            "serves this machine only"
        ) from None


def not_runs_yet(paths: list[Path], labels: list[str]) -> list[str]:
    """One line per folder that is not a training output_dir now (a warning, not the static report's
    error: the page waits for it, as for a run that is about to start or is being copied)."""
    lines = []
    for path, label in zip(paths, labels, strict=True):
        try:
            load_run(path, label)
        except (FinetuneError, OSError) as exc:
            lines.append(
                f"{exc}. The page shows it once training writes there; if no run is coming, check the path"
            )
    return lines


def serve_report(output_dirs: list[str], host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> int:
    """Serve until Ctrl-C (which stops it cleanly: exit code 0)."""
    server = make_server(output_dirs, host, port)
    for line in not_runs_yet(server.paths, server.labels):
        warn(line)
    if not is_loopback(host):
        warn(
            f"--host {host}: the report and the files of its run folders are served to anyone who can "
            f"reach this machine on port {server.server_address[1]}, with no password; leave --host out "
            f"(127.0.0.1) and reach it through an SSH tunnel (ssh -L PORT:127.0.0.1:PORT) instead"
        )
    print(f"serving the report of {len(server.paths)} run(s) at {server.url} (updates as they log; "
          "Ctrl-C stops)", flush=True)  # fmt: skip
    # Python leaves SIGINT ignored when the process started with it ignored (a background job of a
    # non-interactive shell, nohup): Ctrl-C / kill -INT would then never stop the server. Say it
    # explicitly, as the training loop does (engine.loop.StopFlag); SIGTERM stops it the same way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print("stopped serving the report", flush=True)
    return 0


class LiveHandler(BaseHTTPRequestHandler):
    """GET /, /events and /files/...; everything else 404 (or 501 for another method)."""

    server: LiveServer
    server_version = "finetune-report"
    sys_version = ""

    def log_message(self, format, *args) -> None:
        pass  # one line per request would bury the command's own output

    def do_GET(self) -> None:
        if not self._host_allowed():
            return self._fail(
                HTTPStatus.FORBIDDEN, "this server answers requests to 127.0.0.1 or localhost only"
            )
        path = urlsplit(self.path).path
        if path == "/":
            nonce = secrets.token_urlsafe(16)
            page = live_page(read_runs(self.server.paths, self.server.labels), nonce)
            return self._send(HTTPStatus.OK, "text/html; charset=utf-8", page.encode("utf-8"), nonce)
        if path == "/events":
            return self._events()
        if path == "/favicon.ico":
            return self._send(HTTPStatus.NO_CONTENT, "image/x-icon", b"")
        if path.startswith("/files/"):
            return self._file(path)
        return self._fail(HTTPStatus.NOT_FOUND, "not found: the page is at /")

    def _host_allowed(self) -> bool:
        """A loopback server answers only Host: 127.0.0.1 / localhost / [::1] (a page from another
        site whose name resolves to 127.0.0.1, DNS rebinding, sends its own name)."""
        bound = self.server.server_address[0]
        if not is_loopback(bound):
            return True  # the user chose to serve beyond this machine (--host), and was warned
        header = self.headers.get("Host")
        if header is None:
            return True
        name = header if header.endswith("]") else header.rsplit(":", 1)[0]  # [::1] or name:port
        return is_loopback(name.strip("[]"))

    def _security_headers(self, nonce: str | None = None) -> None:
        script = f"'nonce-{nonce}'" if nonce else "'none'"
        self.send_header(
            "Content-Security-Policy",
            f"default-src 'none'; script-src {script}; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        )
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")

    def _send(self, status: HTTPStatus, content_type: str, body: bytes, nonce: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self._security_headers(nonce)
        self.end_headers()
        self.wfile.write(body)

    def _fail(self, status: HTTPStatus, message: str) -> None:
        self._send(
            status, "text/plain; charset=utf-8", f"{status.value} {status.phrase}: {message}\n".encode()
        )

    def _file(self, path: str) -> None:
        status, target = resolve_file(self.server.paths, path)
        if target is None:
            what = "outside the run folders" if status == HTTPStatus.FORBIDDEN else "no such file in the run"
            return self._fail(status, what)
        try:
            with open(target, "rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", _content_type(target))
                self.send_header("Content-Length", str(size))
                self._security_headers()
                self.end_headers()
                shutil.copyfileobj(f, self.wfile)
        except OSError:  # removed meanwhile, or the client left
            return

    def _events(self) -> None:
        """The event stream: the page body now, then again whenever a run's files change."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self._security_headers()
        self.end_headers()
        server, seen, last_sent = self.server, None, time.monotonic()
        try:
            self.wfile.write(b"retry: 1000\n\n")
            while not server.stopping.is_set():
                state = files_state(
                    server.paths
                )  # taken before reading: a change meanwhile is seen next time
                if state != seen and not being_written(server.paths):
                    body = live_body(read_runs(server.paths, server.labels))
                    self.wfile.write(sse_event("update", body))
                    self.wfile.flush()
                    seen, last_sent = state, time.monotonic()
                elif time.monotonic() - last_sent > KEEPALIVE_S:  # a dead client shows up as a write error
                    self.wfile.write(b": keepalive\n\n")
                    self.wfile.flush()
                    last_sent = time.monotonic()
                server.stopping.wait(server.poll_s)
        except OSError:  # the browser closed the page (BrokenPipeError, ConnectionResetError)
            return
