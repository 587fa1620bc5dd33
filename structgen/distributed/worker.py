"""A tensor-parallel worker (ranks 1..N-1): load this rank's shard, then run every step rank 0 broadcasts.

The worker never schedules or samples: it mirrors rank 0's forward on its shard (its own KV cache for its KV
heads) so the all-reduces and the logits gather inside the model meet their peers. It exits on EXIT, and on its
own when the engine's process dies (a watcher thread sees the parent pid change), so no worker outlives it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from structgen.config import CacheConfig, SchedulerConfig
from structgen.distributed.parallel_state import init_process_group, rank_device
from structgen.distributed.step_io import Command, receive_header, receive_step

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.2


@dataclass(slots=True, kw_only=True)
class WorkerSpec:
    """Everything a worker needs, sent once at spawn (plain values: it crosses a pickle)."""

    model_dir: str
    dtype: str
    device: str  # rank 0's device; a CUDA worker takes the GPU `rank` places after it
    tp_size: int
    port: int
    parent_pid: int
    num_threads: int
    block_size: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    pack_cpu_weights_at_start: bool = True


def run_worker(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawned): join the group, load the shard, report "ready" (or the error)."""
    _watch_parent(spec.parent_pid)
    torch.set_num_threads(spec.num_threads)
    device = rank_device(torch.device(spec.device), rank)
    try:
        init_process_group(rank=rank, world_size=spec.tp_size, port=spec.port, device=device)
        from structgen.engine.model_runner import ModelRunner
        from structgen.models.loader import load_model

        model = load_model(
            spec.model_dir,
            dtype=spec.dtype,
            device=device,
            tp_rank=rank,
            tp_size=spec.tp_size,
            pack_cpu_weights_at_start=spec.pack_cpu_weights_at_start,
        )
        runner = ModelRunner(
            model,
            device=device,
            dtype=next(model.parameters()).dtype,
            block_size=spec.block_size,
            eos_token_ids=frozenset(),
            enforce_eager=True,  # steps run below, eagerly, mirroring rank 0's (graphs are off under TP)
        )
    except Exception as error:  # the engine raises it at start, naming the rank
        conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        conn.close()
        os._exit(1)  # no collective will ever match ours: skip the group's teardown
    conn.send(("ready", None))
    conn.close()
    _serve(runner, spec, device)
    torch.distributed.destroy_process_group()
    # Nothing is left to flush; the interpreter's own teardown (torch, multiprocessing) takes seconds.
    os._exit(0)


@torch.inference_mode()
def _serve(runner: object, spec: WorkerSpec, device: torch.device) -> None:
    from structgen.engine.model_runner import ModelRunner
    from structgen.engine.prompt_logprobs import prompt_logit_chunks

    assert isinstance(runner, ModelRunner)
    model = runner.model
    while True:
        header = receive_header(device)
        command = Command(header[0])
        if command is Command.EXIT:
            return
        if command is Command.INIT_CACHE:
            num_blocks = runner.num_blocks_for(spec.cache, spec.scheduler, max_model_len=header[1])
            agreed = torch.tensor([num_blocks], dtype=torch.long, device=device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            runner.allocate_kv_cache(int(agreed.item()), commit=spec.cache.commit_cpu_kv_at_start)
            continue
        step = receive_step(header, device=device, block_size=runner.block_size)
        if step.blocks_to_copy:
            runner._copy_blocks(step.blocks_to_copy)
        hidden = model(step.input_ids, step.positions, runner.kv_caches, step.metadata)
        for chunk in prompt_logit_chunks(step.prompt_rows):  # the products rank 0 scores the prompts with
            model.compute_logits(hidden.index_select(0, chunk))  # type: ignore[operator]
        if step.logit_rows.numel():
            model.compute_logits(hidden.index_select(0, step.logit_rows))  # type: ignore[operator]


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the engine's process is gone: a worker may be blocked in a collective forever."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="structgen-tp-parent-watch", daemon=True).start()
