"""The one thread an offline `LLM` builds its engine on and runs every step on, whichever thread calls it.

On the CPU, torch's OpenMP runtime (libgomp) keeps a team of worker threads for each thread that has run a
parallel op. Once the process holds more of them than it has cores, every worker sleeps between ops instead of
spinning (libgomp's throttled wait), and each op then waits for its workers to wake. A model loaded on the main
thread and run from another (a web framework's worker thread, a `ThreadPoolExecutor`) holds two teams: SmolLM2's
single-stream decode measured 32-71 tokens/s that way against 84-108 on one thread (2-core Zen 3, BENCHMARKS.md
"LLM from another thread"). Building and stepping on one thread of its own keeps one team whatever thread calls,
and calls from several threads take turns instead of stepping one engine at once (it is not thread-safe).
`AsyncEngine.from_config` does the same for the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")


class StepThread:
    """Runs callables one at a time on a thread of its own; `call` waits for the result."""

    def __init__(self, name: str = "structgen-llm") -> None:
        # The thread's id, recorded by the thread itself. A list it appends to, not a method of this object: a
        # thread holding this object would keep it (and so the thread) alive after its LLM is gone.
        self._ident: list[int] = []
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix=name, initializer=_record_ident, initargs=(self._ident,)
        )
        # Set while a caller interrupted (Ctrl-C) waits for its call to stop: long calls check it between steps.
        self.cancelled = threading.Event()

    def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the thread (directly when already on it), returning or raising what it does.
        An exception in the waiting thread (KeyboardInterrupt) sets `cancelled` until the call has stopped, then
        propagates: the engine is never left mid-step by a caller that went away."""
        if self._ident and threading.get_ident() == self._ident[0]:
            return fn(*args, **kwargs)
        future = self._executor.submit(fn, *args, **kwargs)
        try:
            # Waits of a quarter second: a signal that lands just before a wait blocks would otherwise be seen
            # only when the call ends (Ctrl-C ignored for a whole generation).
            while not wait([future], timeout=0.25).done:
                pass
            return future.result()
        except BaseException:
            if not future.done():  # the wait was interrupted, not the call
                self.cancelled.set()
                try:
                    future.exception()  # wait for it to stop at its next check
                finally:
                    self.cancelled.clear()
            raise

    def shutdown(self) -> None:
        """Let the thread end once its queued calls have run (idempotent)."""
        self._executor.shutdown(wait=False)


def _record_ident(ident: list[int]) -> None:
    ident.append(threading.get_ident())
