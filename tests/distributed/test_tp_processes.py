"""Process hygiene of tensor parallelism: `structgen serve --tensor-parallel-size 2` answers and leaves no worker
behind on SIGTERM, and a SIGKILLed engine process takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from live_server import free_port
from tp_helpers import wait_gone

STARTUP_TIMEOUT_S = 120.0  # 3 processes import torch and load tiny on a shared 2-core machine
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

ENGINE_SCRIPT = """
import time
import torch
from structgen.config import CacheConfig, EngineConfig
from structgen.engine.llm_engine import LLMEngine

torch.set_num_threads(1)
engine = LLMEngine(EngineConfig(model="tiny", device="cpu", tensor_parallel_size=2,
                                cache=CacheConfig(kv_cache_tokens=256)))
print(*engine.tp_group.worker_pids, flush=True)
time.sleep(600)
"""


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    command = [sys.executable, "-m", "structgen.cli", "serve", "--model", "tiny", "--device", "cpu"]
    command += ["--tensor-parallel-size", "2", "--kv-cache-tokens", "1024", "--port", str(port)]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def _wait_healthy(process: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else "server exited"
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def test_serve_with_tp2_answers_then_sigterm_leaves_no_worker(
    server: tuple[subprocess.Popen[bytes], str],
) -> None:
    process, url = server
    _wait_healthy(process, url)
    workers = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    assert workers, "no worker process was started"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    process.send_signal(signal.SIGTERM)
    # Drained and shut down: a normal exit, after the engine's own shutdown stopped the workers.
    assert process.wait(30) == 0
    assert wait_gone(workers, timeout=5.0) == []


def test_sigkill_of_the_engine_process_leaves_no_worker() -> None:
    process = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT], env=ENV, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()  # blocks until the engine is up
        workers = [int(pid) for pid in line.split()]
        assert len(workers) == 1, line
        process.kill()
        process.wait(10)
        assert wait_gone(workers, timeout=5.0) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
