"""Tools, environments and reward functions run in a process of their own: a hung one is stopped, and
its prints reach nobody. (Rewards: finetune.generation.rewards.WorkerReward, with grpo.reward_timeout_s;
their values come back as JSON numbers, `plain_values`.) `stop()` (a stop signal) ends a pending call at
once, and later calls answer at once, as timeouts.

Why a process and not a thread: Python cannot stop a thread, so a tool stuck in a loop would hold the
run forever (and a thread shares the run's stdout, where its prints would mix with the progress bar).
The worker is started once (`python -m finetune.generation.tool_worker`, which imports no torch), loads
the tool functions itself (finetune.generation.functions, as rewards are loaded), and answers one call
at a time over a pipe (a JSON line each way). A call that does not answer within the timeout gets the
worker killed and a new one started for the next call (about 0.1 s); a tool that crashes the worker
is an error result the same way. Its stdout and stderr (file descriptors 1 and 2, so C code's output
too) go to /dev/null.

Results cross the pipe as text: the tool's `str(result)`, or `error: <Exception>: <message>` for an
exception or arguments its signature refuses (a TypeError), as the model would see them in deployment.

Environments (multi-turn tasks, finetune.generation.environments) live here too: one object per
episode, made by the factory, `reset(row)` and `step(text)` called on it. When the worker is restarted
(a timeout), the episodes it held are rebuilt on their next call by replaying their reset and steps
(deterministic environments rebuild the same state).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CallResult:
    """What a call gave: its text (the result, or `error: ...`), whether it failed (an exception, bad
    arguments) or timed out, its wall time, and for an environment step the (reward, done) it returned."""

    text: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0
    value: Any = None  # an environment step's (observation, reward, done)


class ToolRunner:
    """The client side: a worker process loading `functions` ((path, base folder) pairs), restarted
    after a timeout. Calls are serialized (a lock): the rollout may run in a background thread."""

    def __init__(self, functions: list[tuple[str, str | None]], *, timeout_s: float):
        self.functions, self.timeout_s = functions, timeout_s
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.generation = 0  # worker starts: an episode made by an earlier worker is replayed
        self.stopping = threading.Event()  # set by `stop()`: no call waits any more
        self._buffer = b""
        self._exited = False

    def _start(self) -> None:
        import finetune

        root = str(Path(finetune.__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "finetune.generation.tool_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        self.generation += 1
        self._buffer = b""
        answer = self._exchange({"op": "load", "functions": self.functions}, timeout=60.0)
        if answer is None or "error" in answer:
            self.close()
            from finetune.errors import FinetuneError

            reason = answer["error"] if answer else "the worker did not start"
            raise FinetuneError(f"tools: cannot load the tool functions in the tool worker: {reason}")

    def _exchange(self, request: dict, *, timeout: float) -> dict | None:
        """Send one request, wait up to `timeout` s for its answer; None: no answer in time (or the
        worker died)."""
        try:
            self.proc.stdin.write((json.dumps(request, default=str) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping.is_set():
                return None
            if not select.select([fd], [], [], min(left, 0.1))[0]:  # a tenth: `stop()` is seen soon
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the worker exited (perhaps not reaped yet: poll() may still say it runs)
                self._exited = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def started(self) -> int:
        """Start the worker if none runs; its number (`generation`: a new one holds no episodes)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self.generation

    def stop(self) -> None:
        """The run is stopping (a stop signal: finetune.engine.loop.StopFlag): a pending call ends now,
        and later ones answer at once, as timeouts. Safe in a signal handler (it only sets an event)."""
        self.stopping.set()

    def request(self, request: dict) -> CallResult:
        """One call (see the module docstring): its result, or an error / timeout result."""
        if self.stopping.is_set():
            return CallResult("error: the run is stopping (a stop signal)", timeout=True)
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            started = time.perf_counter()
            self._exited = False
            answer = self._exchange(request, timeout=self.timeout_s)
            seconds = time.perf_counter() - started
            if answer is None:
                died = self._exited or self.proc.poll() is not None
                self.close()  # killed: the next call starts a fresh worker
                if self.stopping.is_set():
                    return CallResult(
                        "error: the run is stopping (a stop signal)", timeout=True, seconds=seconds
                    )
                if died:
                    return CallResult("error: the tool crashed its process", error=True, seconds=seconds)
                return CallResult(
                    f"error: the tool did not answer within {self.timeout_s:g} s",
                    timeout=True,
                    seconds=seconds,
                )
            return result_of(answer, seconds)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                stream.close()
            self.proc = None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to close with
            self.close()


def result_of(answer: dict, seconds: float) -> CallResult:
    """The CallResult of a worker's answer (`handle`'s)."""
    if "error" in answer:
        return CallResult(f"error: {answer['error']}", error=True, seconds=seconds)
    return CallResult(str(answer.get("text", "")), seconds=seconds, value=answer.get("value"))


# ------------------------------------------------------------------------------------ the worker


def handle(request: dict, state: dict) -> dict:
    """The answer to one request, as the worker sends it back: `load` fills `state` (the functions, the
    episodes), the other operations run on it; an exception is an `error` answer."""
    from finetune.generation.functions import load_function

    try:
        if request["op"] == "load":
            state["functions"] = [
                load_function(p, base=Path(b) if b else None, what="tools", noun="tool")
                for p, b in request["functions"]
            ]
            state["episodes"] = {}
            return {"text": "loaded"}
        return _answer(request, state["functions"], state["episodes"])
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _answer(request: dict, functions: list, episodes: dict) -> dict:
    op = request["op"]
    if op == "call":
        result = functions[request["fn"]](*request.get("args", []), **request.get("kwargs", {}))
        return {"text": str(result)}
    if op == "env_reset":
        env = functions[request["fn"]]()
        episodes[request["episode"]] = env
        first = env.reset(request["row"])
        return {"text": "" if first is None else str(first)}
    if op == "env_step":
        observation, reward, done = episodes[request["episode"]].step(request["text"])
        reward = float(reward)
        return {"text": "" if observation is None else str(observation), "value": [reward, bool(done)]}
    if op == "reward":  # a reward function on a step's completions (finetune.generation.rewards)
        try:
            values = functions[request["fn"]](request["completions"], request["rows"])
        except (SystemExit, KeyboardInterrupt) as exc:  # would end the worker without a word
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"text": "", "value": plain_values(values)}
    if op == "env_close":
        episodes.pop(request["episode"], None)
        return {"text": ""}
    raise ValueError(f"unknown request {op!r}")


def plain_values(values: Any) -> dict:
    """What a reward function returned, as JSON for the pipe: {"values": [...]} with each value a float
    when it is a real number (Python, numpy or a one-element torch tensor; not a bool), else {"shown":
    its repr}; {"not_list": type name} for a value that is no list. The training process checks them
    (finetune.generation.rewards.score_rewards), as it checks a reward run in its own process.

    >>> plain_values([1, 0.5, True, "x"]), plain_values({"a": 1})
    ({'values': [1.0, 0.5, {'shown': 'True'}, {'shown': "'x'"}]}, {'not_list': 'dict'})
    """
    import numbers

    if isinstance(values, (dict, str, bytes)) or not hasattr(values, "__iter__"):
        return {"not_list": type(values).__name__}
    out = []
    for value in values:
        if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
            value = value.item()  # a torch scalar (the worker imports no torch itself)
        is_bool = isinstance(value, bool) or type(value).__name__ == "bool_"
        out.append(
            float(value) if isinstance(value, numbers.Real) and not is_bool else {"shown": repr(value)[:200]}
        )
    return {"values": out}


def main() -> None:
    """Serve requests from stdin until it closes; answers go to the original stdout, everything the
    tools print to /dev/null."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (kept open for the process)
    state: dict = {}
    for line in sys.stdin:
        channel.write(json.dumps(handle(json.loads(line), state), default=str) + "\n")


if __name__ == "__main__":
    main()
