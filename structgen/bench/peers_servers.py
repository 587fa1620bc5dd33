"""Starting and stopping the servers `structgen bench peers` compares: `structgen serve` as our own child, the
peers through the scripts in `../shared/peers` (each leaves its server leading its own process group and
prints its pid once GET /health answers 200). Every server started here is stopped here, children included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# <repo>/../shared/peers, like shared_data()'s ../shared/data.
DEFAULT_PEERS_DIR = Path(__file__).resolve().parents[3] / "shared" / "peers"
SCRIPTS = {"vllm": "vllm_serve.sh", "llamacpp": "llamacpp_serve.sh"}


class StartError(RuntimeError):
    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


@dataclass(slots=True, kw_only=True)
class Options:
    model: str = "smollm2-135m"
    peers_dir: Path = DEFAULT_PEERS_DIR
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # server name -> extra CLI arguments
    vllm_model: Path | None = None
    gguf: Path | None = None
    start_timeout_s: float = 600.0
    log_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))


@dataclass(slots=True, kw_only=True)
class Launch:
    name: str
    url: str
    pid: int  # also its process-group id
    log: Path
    model_id: str  # what /v1/models lists: the `model` each request names
    start_s: float
    process: subprocess.Popen[bytes] | None = None  # set when it is our own child (structgen)


def peers_home() -> Path:
    """Where install.sh put the peers: `$PEERS_DIR`, else ~/.cache/structgen-peers (the scripts' default)."""
    return Path(os.environ.get("PEERS_DIR") or Path.home() / ".cache" / "structgen-peers").expanduser()


def _peer_binary(name: str) -> Path:
    # The same overrides the scripts honour, so what is checked here is what they will run.
    if name == "vllm":
        return Path(os.environ.get("PEER_VLLM_VENV") or peers_home() / "vllm-venv") / "bin" / "vllm"
    default = peers_home() / "llamacpp" / "bin" / "llama-server"
    return Path(os.environ.get("PEER_LLAMACPP_BIN") or default)


def _model_path(name: str, options: Options) -> Path | str:
    """The file or directory the peer serves, or why there is none."""
    from structgen.models.registry import DEFAULT_MODEL, resolve_model, smollm2_gguf_path

    try:
        if name == "vllm":
            # structgen's own conversion (made by its run, first): vLLM reads the same weights.
            return options.vllm_model or resolve_model(options.model)
        if options.gguf:
            return options.gguf
        if options.model == DEFAULT_MODEL:
            return smollm2_gguf_path()
        if options.model.lower().endswith(".gguf") and Path(options.model).is_file():
            return Path(options.model)
        return f"no GGUF for model {options.model!r} (pass --gguf FILE)"
    except Exception as error:  # a model that does not resolve: the peer is skipped, the others run
        return f"no model for {name}: {error}"


def unavailable(name: str, options: Options) -> str | None:
    """Why `name` cannot run here (not installed, no model file), or None."""
    if name == "structgen":
        return None
    script = options.peers_dir / SCRIPTS[name]
    if not script.is_file():
        return f"not installed: no {script}"
    binary = _peer_binary(name)
    if not os.access(binary, os.X_OK):
        return f"not installed: no {binary} (run {options.peers_dir / 'install.sh'} {name})"
    model = _model_path(name, options)
    return model if isinstance(model, str) else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def start(name: str, options: Options) -> Launch:
    """Start `name` on a free loopback port and wait until it answers; StartError (with the log tail) when it
    does not within `options.start_timeout_s`. Nothing started is left running when this raises."""
    return _start_structgen(options) if name == "structgen" else _start_peer(name, options)


def _start_structgen(options: Options) -> Launch:
    port = free_port()
    log = options.log_dir / f"structgen_bench_peers_{port}.log"
    command = [sys.executable, "-m", "structgen.cli", "serve", "--model", options.model, "--port", str(port)]
    command += options.extra_args.get("structgen", [])
    began = time.perf_counter()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    launch = Launch(
        name="structgen", url=url, pid=process.pid, log=log, model_id="", start_s=0.0, process=process
    )
    try:
        deadline = time.monotonic() + options.start_timeout_s
        while not _healthy(launch.url):
            if process.poll() is not None:
                raise StartError(f"structgen serve exited with status {process.returncode}", log_tail(log))
            if time.monotonic() > deadline:
                raise StartError(
                    f"no answer on {launch.url}/health within {options.start_timeout_s:.0f}s", log_tail(log)
                )
            time.sleep(0.5)
        launch.start_s = time.perf_counter() - began
        launch.model_id = _model_id(launch)
    except BaseException:
        stop(launch)
        raise
    return launch


def _start_peer(name: str, options: Options) -> Launch:
    model = _model_path(name, options)
    if isinstance(model, str):
        raise StartError(model)
    port = free_port()
    log = options.log_dir / f"peer_{name}_{port}.log"
    prefix = {"vllm": "PEER_VLLM", "llamacpp": "PEER_LLAMACPP"}[name]
    env = os.environ | {"PEERS_DIR": str(peers_home()), f"{prefix}_LOG": str(log)}
    env.setdefault(f"{prefix}_WAIT", str(int(options.start_timeout_s)))
    script = options.peers_dir / SCRIPTS[name]
    command = ["bash", str(script), str(model), str(port), *options.extra_args.get(name, [])]
    began = time.perf_counter()
    # Its own session: a Ctrl-C here must not kill the script halfway and orphan the server it started.
    script_run = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = script_run.communicate(timeout=float(env[f"{prefix}_WAIT"]) + 60)
    except BaseException as error:
        _kill_script(script_run)
        if isinstance(error, subprocess.TimeoutExpired):
            raise StartError(f"{script.name} did not return in time", log_tail(log)) from None
        raise
    if script_run.returncode != 0:
        raise StartError(f"{script.name} exited with status {script_run.returncode}", stderr.strip()[-4000:])
    try:
        pid = int(stdout.split()[-1])  # the script's last line: the server's pid
    except (IndexError, ValueError):
        raise StartError(f"{script.name} printed no pid: {stdout[-200:]!r}", stderr.strip()[-4000:]) from None
    url = f"http://127.0.0.1:{port}"
    launch = Launch(name=name, url=url, pid=pid, log=log, model_id="", start_s=time.perf_counter() - began)
    try:
        launch.model_id = _model_id(launch)
    except BaseException:
        stop(launch)
        raise
    return launch


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _model_id(launch: Launch) -> str:
    # Each names it differently (structgen: the --model name; vLLM: the directory path; llama.cpp: the alias).
    try:
        return str(httpx.get(f"{launch.url}/v1/models", timeout=30).json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise StartError(f"GET /v1/models failed: {error!r}", log_tail(launch.log)) from None


def stop(launch: Launch, *, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's process group (its children too: vLLM's EngineCore, tensor-parallel workers),
    SIGKILL to whatever is left after `grace_s`; returns once none of it runs."""
    _signal_group(launch.pid, signal.SIGTERM)
    if launch.process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            launch.process.wait(grace_s)
    _wait_group_gone(launch.pid, grace_s)
    if _group_alive(launch.pid):
        _signal_group(launch.pid, signal.SIGKILL)
        _wait_group_gone(launch.pid, 10)
    if launch.process is not None and launch.process.poll() is None:
        launch.process.wait(10)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


def _proc_stats() -> list[tuple[int, str, int, int]] | None:
    """(pid, state, ppid, pgid) of every process, from /proc; None where there is no /proc."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    stats = []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # the command name may hold spaces
        except OSError:  # exited meanwhile
            continue
        stats.append((int(entry), fields[0], int(fields[1]), int(fields[2])))
    return stats


def _group_alive(pgid: int) -> bool:
    # A peer's server is not our child: once it exits it is reaped by init, or lingers as a zombie where
    # nothing reaps; either way it no longer runs, so zombies do not count.
    stats = _proc_stats()
    if stats is None:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return any(group == pgid and state != "Z" for _, state, _, group in stats)


def _kill_script(script_run: subprocess.Popen[str]) -> None:
    """Stop a start script that did not finish, and the server it may already have started: that server leads
    its own process group (setsid) and is the script's child until the script exits."""
    groups = {pid for pid, _, ppid, _ in _proc_stats() or [] if ppid == script_run.pid}
    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)
    _signal_group(script_run.pid, signal.SIGKILL)  # the script, its curl and sleep
    script_run.wait(10)
    for pgid in groups:
        _wait_group_gone(pgid, 30)
        _signal_group(pgid, signal.SIGKILL)
