"""Launcher of the prefill attention (`csrc/cpu_prefill_attention.cpp`) and its reference.

`prefill_attention` attends one sequence's new tokens (a prompt, or a chunk of one on a cached prefix) causally
over its whole context, reading keys and values from the paged cache, where the new tokens' are already written.
It takes queries and caches of one dtype with head sizes 32, 64 or 128: bf16 on CPUs with AVX512-BF16, fp32 on
CPUs with AVX-512F or, without AVX-512, AVX2 and FMA (`csrc/cpu_prefill_attention_avx2.cpp`; `available(dtype)`);
elsewhere the attention backend keeps torch's SDPA.
`prefill_attention_reference` is the same attention in float32 torch: in bf16 the kernel rounds each softmax
weight to bf16 before the value product (as flash kernels do), so the two agree to bf16's rounding; in fp32 to
fp32's, up to summation order and the kernels' exp (~2e-7 relative).
"""

from __future__ import annotations

import functools

import torch
from structgen.kernels import cpu_build
from structgen.kernels._launch import check_dtype, check_shape
from structgen.kernels.cpu_ops import _check_cpu, _kernel_message

HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel runs here for `dtype`: the native library loaded and the CPU has AVX512-BF16 (bf16) or
    AVX-512F or AVX2 with FMA (fp32)."""
    return (
        dtype in DTYPES
        and cpu_build.load()
        and bool(torch.ops.structgen_cpu.prefill_attention_available(dtype == torch.bfloat16))
    )


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether a call with these tensors takes the kernel (dtypes, head size, device, CPU)."""
    return (
        query.dtype == key_cache.dtype
        and query.device.type == "cpu"
        and query.shape[-1] in HEAD_DIMS
        and available(query.dtype)
    )


def prefill_attention(
    query: torch.Tensor,  # [new tokens, num_heads, head_dim] bf16 or fp32, rows contiguous in head_dim
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], the query's dtype
    value_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,  # [max_blocks] int32: the sequence's blocks
    context_len: int,  # tokens of the context, the new ones included (they are its last)
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """New token i (position context_len - len(query) + i) attended over the context up to itself."""
    if query.dtype in DTYPES and not available(query.dtype):
        raise ValueError(
            f"prefill_attention: needs the native CPU kernels and, for {query.dtype}, a CPU with "
            + ("AVX512-BF16" if query.dtype == torch.bfloat16 else "AVX-512F or AVX2 with FMA")
        )
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    try:
        torch.ops.structgen_cpu.prefill_attention(
            query, key_cache, value_cache, block_table, int(context_len), float(scale), out
        )
    except RuntimeError as exc:
        _check(query, key_cache, value_cache, block_table, out)
        raise ValueError(f"prefill_attention: {_kernel_message(exc)}") from None
    return out


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
) -> None:
    name = "prefill_attention"
    _check_cpu(name, query, key_cache, value_cache, block_table, out)
    check_dtype(name, "query", query, DTYPES)
    for what, t in (("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        check_dtype(name, what, t, (query.dtype,))
    check_dtype(name, "block_table", block_table, (torch.int32,))
    check_shape(name, "block_table", block_table, (None,))
    check_shape(name, "query", query, (None, None, key_cache.shape[-1]))
    if query.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{name}: head_dim must be one of {HEAD_DIMS}, got {query.shape[-1]}")


def prefill_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Gather the context's blocks and attend in float32, causally with the new tokens last (GQA by repeating KV
    heads)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    blocks = block_table[: -(-context_len // block_size)].long()

    def context(cache: torch.Tensor) -> torch.Tensor:  # [context_len, num_heads, head_dim] float32
        return cache.index_select(0, blocks).flatten(0, 1)[:context_len].float().repeat_interleave(group, 1)

    k, v = context(key_cache), context(value_cache)
    scores = torch.einsum("qhd,thd->hqt", query.float() * scale, k)
    positions = torch.arange(context_len - query.shape[0], context_len)
    visible = torch.arange(context_len)[None, :] <= positions[:, None]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqt,thd->qhd", weights, v).to(query.dtype)
