"""Closed-loop HTTP clients in a child process, for benchmarks that measure a server running in this one.

`ClientProcess` starts one child (spawned: no torch, no engine state) that, when told to run, keeps
`concurrency` non-streamed chat completions in flight against the server, each worker sending the next
request (a new prompt and seed) as soon as its last one returns, until told to stop; then it cancels them
(their connections close, so the server aborts what they had in flight) and hands back every response that
finished, stamped with `time.monotonic()` (one clock for all processes on Linux), so the caller can keep the
ones inside its measured window.

Why a child and not tasks in the server's process: a benchmark that runs its clients beside the server pays
their Python work (building requests, parsing responses, checking outputs) on the server's GIL, and more of
it on the side whose requests finish sooner; a user's client runs in another process, usually on another
machine. The child still shares the machine's cores: its work is counted, just not under the server's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any

_JOIN_S = 10.0


@dataclass(slots=True, frozen=True)
class Finished:
    """One response that came back: when, its first choice's text and finish reason."""

    at: float  # time.monotonic() when the response was read
    text: str
    finish_reason: str | None


@dataclass(slots=True, frozen=True)
class Workload:
    """What the workers send: `template` (a chat completion body without messages and seed) and a prompt
    `prompt_format` with an `{index}` field; request i gets index `first_index + i` and seed `seed_base + index`.
    `stagger`: the first that many requests ask for `max_tokens * (i + 1) / stagger` tokens (rounded up) instead
    of the template's (`staggered_max_tokens`)."""

    template: dict[str, Any]
    prompt_format: str
    first_index: int
    seed_base: int
    stagger: int = 0

    def body(self, index: int) -> dict[str, Any]:
        content = self.prompt_format.format(index=index)
        body = {
            **self.template,
            "messages": [{"role": "user", "content": content}],
            "seed": self.seed_base + index,
        }
        if "max_tokens" in body:
            body["max_tokens"] = staggered_max_tokens(
                body["max_tokens"], index - self.first_index, self.stagger
            )
        return body


def staggered_max_tokens(max_tokens: int, i: int, stagger: int) -> int:
    """The token budget of request `i` (from 0) of a closed loop whose first `stagger` requests are staggered:
    `max_tokens * (i + 1) / stagger`, rounded up, for those; `max_tokens` after. Requests that all run to their
    budget and start together stay in step (every one ends at the same step, and so do their replacements),
    so a window shorter than the budget sees none of them end; staggered, one ends (and its replacement's
    prompt is prefilled) every `max_tokens / stagger` steps from the start, as in a server's steady state."""
    if 0 <= i < stagger:
        return -(-max_tokens * (i + 1) // stagger)
    return max_tokens


class ClientError(RuntimeError):
    """A client request failed (an HTTP error or a broken connection): the benchmark stops."""


class ClientProcess:
    """The child process and the pipe to it (use as a context manager)."""

    def __init__(self, url: str, *, concurrency: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child, url, concurrency), daemon=True)
        self._process.start()
        child.close()
        self._expect("ready")

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def once(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its response (warm-up)."""
        self._conn.send(("once", body))
        return self._expect("once")

    def run(self, workload: Workload) -> None:
        """Start the closed loop; returns at once."""
        self._conn.send(("run", workload))

    def raise_if_failed(self) -> None:
        """While running the child only ever reports a failure."""
        if self._conn.poll():
            self._expect("never")  # raises the child's error

    def stop(self) -> tuple[list[Finished], int]:
        """Cancel the workers; every response that finished since `run`, and the next unused index."""
        self._conn.send(("stop",))
        finished, next_index = self._expect("stopped")
        return finished, next_index

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("exit",))
            self._process.join(_JOIN_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(_JOIN_S)
        self._conn.close()

    def _expect(self, kind: str) -> Any:
        try:
            got, payload = self._conn.recv()
        except EOFError as exc:
            raise ClientError(f"the client process exited (code {self._process.exitcode})") from exc
        if got == "error":
            raise ClientError(payload)
        if got != kind:
            raise ClientError(f"the client process answered {got!r}, expected {kind!r}")
        return payload


def _child_main(conn: Any, url: str, concurrency: int) -> None:
    asyncio.run(_serve(conn, url, concurrency))


async def _serve(conn: Any, url: str, concurrency: int) -> None:
    from structgen.bench.http_wire import JsonConnection

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
    finished: list[Finished] = []
    workers: list[asyncio.Task[None]] = []
    next_index = 0
    # One keep-alive connection per worker (`http_wire`: a quarter of httpx's CPU a request).
    connections = [JsonConnection(url) for _ in range(concurrency)]

    async def post(connection: JsonConnection, body: dict[str, Any]) -> dict[str, Any]:
        status, data = await connection.post("/v1/chat/completions", body)
        if status >= 400:
            raise ClientError(f"HTTP {status}: {data[:500].decode(errors='replace')}")
        return json.loads(data)

    def report(exc: Exception) -> None:  # to the parent, which stops the benchmark
        conn.send(("error", f"{type(exc).__name__}: {exc}"))

    async def worker(workload: Workload, connection: JsonConnection) -> None:
        nonlocal next_index
        try:
            while True:
                index, next_index = next_index, next_index + 1
                choice = (await post(connection, workload.body(index)))["choices"][0]
                text = choice["message"].get("content") or ""
                finished.append(Finished(time.monotonic(), text, choice["finish_reason"]))
        except Exception as exc:  # (cancellation is not an Exception: it ends the worker quietly)
            report(exc)

    conn.send(("ready", None))
    try:
        while True:
            message = await inbox.get()
            kind = message[0]
            if kind == "run":
                workload = message[1]
                next_index = workload.first_index
                workers = [asyncio.ensure_future(worker(workload, c)) for c in connections]
            elif kind == "stop":
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                conn.send(("stopped", (finished, next_index)))
                finished, workers = [], []
            elif kind == "once":
                try:
                    conn.send(("once", await post(connections[0], message[1])))
                except Exception as exc:
                    report(exc)
            else:  # "exit"
                break
    finally:
        for connection in connections:
            connection.close()
    loop.remove_reader(conn.fileno())
