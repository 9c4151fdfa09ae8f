"""The tool worker's requests answered in this process, for the fast tier (tests/tiers.py: no process).

`InProcessRunner` has ToolRunner's interface (`request`, `close`, `generation`) and answers each request
with the worker's own code (finetune.generation.tool_worker.handle: the same loading, calls, episodes
and error answers); what it does not have is the process: no timeout, and the tool's prints reach this
process. The `tools_in_process` fixture (tests/conftest.py) puts it in place of ToolRunner for every
test outside the slow tier; the worker itself (timeouts, prints, crashes, restarts) is tested in the
slow tier, where tests start processes.
"""

from __future__ import annotations

import threading
import time

from finetune.generation.tool_worker import CallResult, handle, result_of


class InProcessRunner:
    def __init__(self, functions: list[tuple[str, str | None]], *, timeout_s: float):
        self.functions, self.timeout_s = functions, timeout_s
        self.lock = threading.Lock()
        self.generation = 0
        self.state: dict | None = None
        self.stopping = threading.Event()

    def stop(self) -> None:
        self.stopping.set()

    def _start(self) -> None:
        self.state, self.generation = {}, self.generation + 1
        loaded = handle({"op": "load", "functions": self.functions}, self.state)
        if "error" in loaded:
            from finetune.errors import FinetuneError

            raise FinetuneError(f"tools: cannot load the tool functions: {loaded['error']}")

    def started(self) -> int:
        with self.lock:
            if self.state is None:
                self._start()
            return self.generation

    def request(self, request: dict) -> CallResult:
        if self.stopping.is_set():
            return CallResult("error: the run is stopping (a stop signal)", timeout=True)
        with self.lock:
            if self.state is None:
                self._start()
            started = time.perf_counter()
            answer = handle(request, self.state)
            return result_of(answer, time.perf_counter() - started)

    def close(self) -> None:
        self.state = None
