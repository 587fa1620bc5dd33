"""A real uvicorn server on a free loopback port, for tests that talk HTTP (the `openai` SDK, the typed client)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(app: Any, *, startup_timeout: float = 20.0) -> Iterator[str]:
    """Run `app` under uvicorn in a daemon thread; yields its base URL (no `/v1`) and stops it on exit."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def wait_idle(engine: Any, timeout: float = 10.0) -> None:
    """Wait until the `AsyncEngine`'s engine holds no request, failing the test if one never leaves."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished():
        assert time.monotonic() < deadline, "a request never left the engine"
        time.sleep(0.01)


def start_structgen_serve(
    args: list[str], *, startup_timeout: float = 120.0
) -> tuple[subprocess.Popen[str], str]:
    """`structgen serve ARGS --port P` as a subprocess (one OpenMP thread), once `/health` answers: (process, base
    URL). The caller stops it."""
    port = free_port()
    command = [sys.executable, "-m", "structgen.cli", "serve", *args, "--port", str(port)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "structgen serve did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
