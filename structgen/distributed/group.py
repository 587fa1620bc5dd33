"""`TensorParallelGroup`: rank 0's handle on the workers — spawn, join the group, broadcast steps, shut down.

Start-up runs in two halves so the workers load their shards while rank 0 loads its own: `start` spawns the
workers and joins the process group, `wait_ready` collects their load results (an error names the rank).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from structgen.distributed.parallel_state import (
    TensorParallelError,
    check_tensor_parallel,
    free_port,
    init_process_group,
)
from structgen.distributed.step_io import Command, StepInput, send_command, send_step
from structgen.distributed.worker import WorkerSpec, run_worker

if TYPE_CHECKING:
    from structgen.config import EngineConfig
    from structgen.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # importing torch and loading a shard; a worker that is silently gone fails sooner
_EXIT_TIMEOUT_S = 5.0
# The exit code of a spawned process that was asked to start workers while it was still importing its parent's
# main module: the parent then names the missing `if __name__ == "__main__":` guard (without it the worker's
# death reads as a bare EOFError on its pipe).
UNGUARDED_MAIN_EXIT_CODE = 86
UNGUARDED_MAIN_MESSAGE = (
    'the script creates the engine as soon as it is imported: it has no `if __name__ == "__main__":` guard. '
    "Tensor-parallel workers are spawned processes that import the main module again, so put the code that "
    "creates the LLM (or engine) under `if __name__ == \"__main__\":` (see 'Safe importing of main module' in "
    "Python's multiprocessing documentation)"
)


@dataclass(slots=True)
class _Worker:
    rank: int
    process: Any  # multiprocessing.context.SpawnProcess
    conn: Connection


class TensorParallelGroup:
    def __init__(self, *, tp_size: int, device: torch.device, workers: list[_Worker]) -> None:
        self.tp_size = tp_size
        self.device = device
        self.workers = workers
        self._lock = threading.Lock()  # one broadcast sequence at a time: steps vs shutdown
        self._closed = False
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, model_dir: str | Path, config: EngineConfig, device: torch.device) -> TensorParallelGroup:
        """Check the model splits over `config.tensor_parallel_size` ranks, spawn the workers, join the group
        as rank 0. Raises `TensorParallelError` naming the problem."""
        import torch.multiprocessing as mp

        from structgen.models.config import ModelConfig

        _exit_if_importing_main()
        tp_size = config.tensor_parallel_size
        check_tensor_parallel(ModelConfig.from_dir(model_dir), tp_size)
        if torch.distributed.is_initialized():
            raise TensorParallelError(
                "a torch.distributed process group already exists in this process: one tensor-parallel "
                "engine per process at a time (shut the other one down first)"
            )
        if device.type == "cuda":
            needed = (device.index or 0) + tp_size
            if torch.cuda.device_count() < needed:
                raise TensorParallelError(
                    f"tensor_parallel_size {tp_size} from {device} needs {needed} GPUs, "
                    f"found {torch.cuda.device_count()}"
                )
        port = free_port()
        spec = WorkerSpec(
            model_dir=str(model_dir),
            dtype=config.dtype,
            device=str(device),
            tp_size=tp_size,
            port=port,
            parent_pid=os.getpid(),
            num_threads=torch.get_num_threads(),
            block_size=config.cache.block_size,
            cache=config.cache,
            scheduler=config.scheduler,
            pack_cpu_weights_at_start=config.pack_cpu_weights_at_start,
        )
        ctx = mp.get_context("spawn")
        workers: list[_Worker] = []
        for rank in range(1, tp_size):
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(
                target=run_worker, args=(rank, spec, child_conn), name=f"structgen-tp{rank}", daemon=True
            )
            process.start()
            child_conn.close()  # ours closes so a dead worker reads as EOF
            workers.append(_Worker(rank, process, parent_conn))
        group = cls(tp_size=tp_size, device=device, workers=workers)
        try:
            group._join(port)
        except BaseException:
            group.shutdown()
            raise
        return group

    def _join(self, port: int) -> None:
        """Join as rank 0. The rendezvous waits as long as the group's (idle-proof) timeout, so it runs in a
        thread while this one watches the workers: one that dies before joining fails the start at once."""
        failure: list[BaseException] = []

        def join() -> None:
            try:
                init_process_group(rank=0, world_size=self.tp_size, port=port, device=self.device)
            except BaseException as error:
                failure.append(error)

        thread = threading.Thread(target=join, name="structgen-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while thread.is_alive():
            thread.join(0.1)
            for worker in self.workers:
                if not worker.process.is_alive():
                    if worker.process.exitcode == UNGUARDED_MAIN_EXIT_CODE:
                        raise TensorParallelError(
                            f"tensor-parallel worker rank {worker.rank} could not start: {UNGUARDED_MAIN_MESSAGE}"
                        )
                    detail = _last_word(worker.conn)
                    raise TensorParallelError(
                        f"tensor-parallel worker rank {worker.rank} exited (code {worker.process.exitcode}) "
                        f"before joining the group" + (f": {detail}" if detail else "")
                    )
            if time.monotonic() > deadline:
                raise TensorParallelError("tensor-parallel workers did not join the group in time")
        if failure:
            raise TensorParallelError(f"joining the tensor-parallel group failed: {failure[0]}") from failure[
                0
            ]

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard; raise (after shutting down) if one failed."""
        try:
            self._expect("ready")
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        for worker in self.workers:
            while not worker.conn.poll(0.1):
                if not worker.process.is_alive():
                    raise TensorParallelError(
                        f"tensor-parallel worker rank {worker.rank} exited (code {worker.process.exitcode}) "
                        f"before it was {what}"
                    )
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel worker rank {worker.rank} was not {what} in time"
                    )
            try:
                kind, detail = worker.conn.recv()
            except EOFError:
                raise TensorParallelError(f"tensor-parallel worker rank {worker.rank} exited") from None
            if kind == "error":
                raise TensorParallelError(f"tensor-parallel worker rank {worker.rank} failed: {detail}")
            if kind != what:
                raise TensorParallelError(f"worker rank {worker.rank} said {kind!r}, expected {what!r}")

    # -- per engine --------------------------------------------------------------------------------------------

    def agree_num_blocks(self, runner: ModelRunner, config: EngineConfig, *, max_model_len: int) -> int:
        """Every rank sizes its own KV cache (on CUDA, each profiles a forward together); all keep the minimum,
        so a block id means the same slots everywhere."""
        with self._lock:
            send_command(Command.INIT_CACHE, max_model_len, device=self.device)
            num_blocks = runner.num_blocks_for(config.cache, config.scheduler, max_model_len=max_model_len)
            agreed = torch.tensor([num_blocks], dtype=torch.long, device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        return int(agreed.item())

    def send_step(self, step: StepInput) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel group was shut down")
        self._check_workers()
        with self._lock:
            send_step(step, device=self.device)

    def _check_workers(self) -> None:
        # NCCL would wait forever on a dead peer; failing the step names it instead.
        for worker in self.workers:
            if not worker.process.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel worker rank {worker.rank} died (exit code {worker.process.exitcode})"
                )

    def shutdown(self) -> None:
        """Tell the workers to exit, wait a little, then terminate what is left (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        initialized = torch.distributed.is_initialized()
        alive = all(w.process.is_alive() for w in self.workers)
        # A step stuck in a collective holds the lock: then the workers are terminated instead of told.
        if initialized and alive and self._lock.acquire(timeout=_EXIT_TIMEOUT_S):
            try:
                send_command(Command.EXIT, device=self.device)
            except Exception:  # a peer already gone: terminating below covers it
                logger.warning("tensor-parallel EXIT broadcast failed", exc_info=True)
            finally:
                self._lock.release()
        if initialized:  # before joining: the workers' teardown waits for ours
            torch.distributed.destroy_process_group()
        deadline = time.monotonic() + _EXIT_TIMEOUT_S
        for worker in self.workers:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(_EXIT_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]


def _exit_if_importing_main() -> None:
    """In a spawned process still importing its parent's main module (multiprocessing's bootstrapping phase),
    exit with `UNGUARDED_MAIN_EXIT_CODE`: the module creates an engine at import time, and going on would load
    a model and spawn workers of its own in every worker. The parent turns the code into the message."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(
            "structgen: a tensor-parallel worker stopped: the main module creates an engine when imported "
            '(no `if __name__ == "__main__":` guard)',
            file=sys.stderr,
        )
        raise SystemExit(UNGUARDED_MAIN_EXIT_CODE)


def _last_word(conn: Connection) -> str | None:
    """What a worker that died sent last (its error), or None: a dead worker's pipe polls as readable at EOF."""
    try:
        return conn.recv()[1] if conn.poll() else None
    except (EOFError, OSError):
        return None
