"""Argument checks shared by the kernel launchers: a bad call fails with a readable message in Python instead of
an illegal memory access (or silently wrong numbers) inside a kernel."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (must be set before the kernel modules are imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device is CUDA, unless the interpreter runs them on the CPU."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors are on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not (interpreting() and device.type == "cpu"):
        raise ValueError(
            f"{name}: Triton kernels need CUDA tensors, got {device} "
            "(set TRITON_INTERPRET=1 before importing structgen.kernels to run them on the CPU)"
        )


def check_dtype(name: str, what: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        shown = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name}: {what} must be {shown}, got {str(tensor.dtype).removeprefix('torch.')}")


def check_shape(name: str, what: str, tensor: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`shape` entries of None match any size."""
    ok = tensor.dim() == len(shape) and all(
        s is None or s == n for s, n in zip(shape, tensor.shape, strict=True)
    )
    if not ok:
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: {what} must have shape {wanted}, got {list(tensor.shape)}")


def check_contiguous(name: str, what: str, tensor: torch.Tensor, *, inner_dims: int | None = None) -> None:
    """Fully contiguous, or (with `inner_dims`) contiguous in its last `inner_dims` dimensions so the kernel can
    step over rows with one stride (q/k/v are strided views of the fused qkv projection)."""
    if inner_dims is None:
        ok = tensor.is_contiguous()
    else:
        expected = 1
        ok = True
        for dim in range(tensor.dim() - 1, tensor.dim() - 1 - inner_dims, -1):
            if tensor.shape[dim] != 1 and tensor.stride(dim) != expected:
                ok = False
            expected *= tensor.shape[dim]
    if not ok:
        kind = "contiguous" if inner_dims is None else f"contiguous in its last {inner_dims} dims"
        raise ValueError(f"{name}: {what} must be {kind}, got strides {tensor.stride()}")


def check_power_of_two(name: str, what: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name}: {what} must be a power of two, got {value}")


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_paged_attention(
    name: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int, int, int]:
    """The checks both attention launchers share; returns (block_size, num_kv_heads, head_dim, num_heads)."""
    check_shape(name, "key_cache", key_cache, (None, None, None, None))
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    check_shape(name, "value_cache", value_cache, tuple(key_cache.shape))
    check_shape(name, "query", query, (None, None, head_dim))
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for what, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_dtype(name, what, t, FLOAT_DTYPES)
    check_contiguous(name, "query", query, inner_dims=1)
    check_contiguous(name, "key_cache", key_cache)
    check_contiguous(name, "value_cache", value_cache)
    check_power_of_two(name, "block_size", block_size)
    return block_size, num_kv_heads, head_dim, num_heads


def check_index_tensors(name: str, **tensors: torch.Tensor) -> None:
    """int32 index tensors (block tables, lengths, offsets) with unit stride in their last dimension."""
    for what, t in tensors.items():
        check_dtype(name, what, t, (torch.int32,))
        check_contiguous(name, what, t, inner_dims=1)
