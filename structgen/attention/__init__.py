"""Attention backends over a paged KV cache: a torch reference (CPU) and Triton kernels (GPU)."""

from __future__ import annotations

import torch

from structgen.attention.backend import AttentionBackend, AttentionMetadata, KVCache, allocate_kv_cache
from structgen.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "TorchAttentionBackend",
    "allocate_kv_cache",
    "get_attention_backend",
]


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    """The attention backend for a device.

    Every device gets the torch backend for now; the seam for the Triton kernels is here: once
    `structgen.attention.triton_backend` exists, CUDA devices get it and everything else keeps the torch one.
    """
    torch.device(device)  # validates the spelling so a typo fails here, not in the first forward
    return TorchAttentionBackend()
