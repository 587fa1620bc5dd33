"""Process-group setup and the sharding rules a model must satisfy for a tensor-parallel size."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from structgen.errors import ModelLoadError

if TYPE_CHECKING:
    from structgen.models.config import ModelConfig

# Workers sit in a broadcast between steps, however long the server stays idle; a collective that times out
# leaves the group unusable, so the timeout only has to exceed any idle period. A dead peer is noticed
# separately (gloo: the connection closes; both backends: the group watches the worker processes).
_IDLE_FOREVER = timedelta(days=365)


class TensorParallelError(ModelLoadError):
    """The model cannot be sharded over the requested number of ranks, or a worker failed to start."""


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise `TensorParallelError` naming the numbers when `config` cannot be split over `tp_size` ranks.

    Query heads are split evenly; KV heads are split evenly too, or, when there are fewer KV heads than ranks,
    each is replicated on `tp_size // num_kv_heads` ranks (so tp_size must be a multiple of them). The MLP's
    intermediate size is split evenly. The vocabulary may be uneven (the last rank's slice is padded).
    """
    if tp_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    rule = (
        "attention heads must be divisible by tensor_parallel_size, and KV heads divisible by it "
        "(or it divisible by the KV heads, which are then replicated)"
    )
    if heads % tp_size:
        raise TensorParallelError(
            f"tensor_parallel_size {tp_size} does not divide the model's {heads} attention heads "
            f"({kv_heads} KV heads): {rule}"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size {tp_size} and the model's {kv_heads} KV heads ({heads} attention heads) "
            f"do not divide one another: {rule}"
        )
    if config.intermediate_size % tp_size:
        raise TensorParallelError(
            f"tensor_parallel_size {tp_size} does not divide the model's intermediate_size "
            f"{config.intermediate_size}"
        )


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (the rendezvous of one group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(*, rank: int, world_size: int, port: int, device: torch.device) -> None:
    """Join the group of `world_size` ranks rendezvousing on `127.0.0.1:port` (rank 0 hosts the store)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(
        backend=backend_for(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_IDLE_FOREVER,
    )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank (`cuda:rank`, offset by the engine's own index); on CPU every rank shares the host."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)
