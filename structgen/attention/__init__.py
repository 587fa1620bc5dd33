"""Attention backends over a paged KV cache: a torch reference (CPU) and Triton kernels (GPU)."""

from __future__ import annotations

import os

import torch

from structgen.attention.backend import AttentionBackend, AttentionMetadata, KVCache, allocate_kv_cache
from structgen.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "BACKEND_ENV_VAR",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "TorchAttentionBackend",
    "allocate_kv_cache",
    "get_attention_backend",
]

BACKEND_ENV_VAR = "STRUCTGEN_ATTENTION_BACKEND"
_BACKENDS = ("torch", "triton")


def get_attention_backend(device: torch.device | str, *, name: str | None = None) -> AttentionBackend:
    """The attention backend for a device: Triton kernels on CUDA, the torch path elsewhere.

    `name` ("torch" or "triton"), else the `STRUCTGEN_ATTENTION_BACKEND` environment variable, overrides the
    choice. Triton on the CPU needs its interpreter (`TRITON_INTERPRET=1` before the kernels are imported);
    this is checked before importing them, because a kernel imported without it would stay compiled-only.
    """
    device = torch.device(device)  # validates the spelling so a typo fails here, not in the first forward
    choice = name or os.environ.get(BACKEND_ENV_VAR) or ("triton" if device.type == "cuda" else "torch")
    if choice not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {choice!r} (from {BACKEND_ENV_VAR}?); choose one of {_BACKENDS}"
        )
    if choice == "torch":
        return TorchAttentionBackend()
    if device.type != "cuda":
        from structgen.kernels._launch import interpreting

        if not (device.type == "cpu" and interpreting()):
            raise ValueError(
                f"the triton attention backend needs a CUDA device, got {device} "
                "(on the CPU it runs only under TRITON_INTERPRET=1)"
            )
    from structgen.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
