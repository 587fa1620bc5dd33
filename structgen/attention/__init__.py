"""Attention backends over a paged KV cache: native kernels (CPU), Triton kernels (GPU), and the torch reference."""

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
_BACKENDS = ("torch", "cpu", "triton")


def get_attention_backend(device: torch.device | str, *, name: str | None = None) -> AttentionBackend:
    """The attention backend for a device: Triton kernels on CUDA, native kernels on the CPU (the torch path where
    they cannot be built, e.g. without a C++ compiler), the torch path elsewhere.

    `name` ("torch", "cpu" or "triton"), else the `STRUCTGEN_ATTENTION_BACKEND` environment variable, overrides the
    choice. Triton on the CPU needs its interpreter (`TRITON_INTERPRET=1` before the kernels are imported);
    this is checked before importing them, because a kernel imported without it would stay compiled-only.
    """
    device = torch.device(device)  # validates the spelling so a typo fails here, not in the first forward
    choice = name or os.environ.get(BACKEND_ENV_VAR) or _default_backend(device)
    if choice not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {choice!r} (from {BACKEND_ENV_VAR}?); choose one of {_BACKENDS}"
        )
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "cpu":
        from structgen.kernels import cpu_build

        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU, got {device}")
        if not cpu_build.load():
            raise ValueError(f"the cpu attention backend is unavailable: {cpu_build.unavailable_reason()}")
        from structgen.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if device.type != "cuda":
        from structgen.kernels._launch import interpreting

        if not (device.type == "cpu" and interpreting()):
            raise ValueError(
                f"the triton attention backend needs a CUDA device, got {device} "
                "(on the CPU it runs only under TRITON_INTERPRET=1)"
            )
    from structgen.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _default_backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        from structgen.kernels import cpu_build

        return "cpu" if cpu_build.load() else "torch"  # load() logs why once when it cannot
    return "torch"
