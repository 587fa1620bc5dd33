"""`paged_attention_decode`: one new query token per sequence against its whole paged context.

Grid: (sequence, KV head, partition). One program serves every query head of a GQA group at once (they read the
same keys), padded to 16 rows for `tl.dot`, and walks its part of the context in tiles of `BLOCK_N` tokens with an
online softmax in float32. Long contexts with few sequences are split into partitions of `partition_size` tokens
(flash-decoding): each program then writes its unnormalized partial output with its max and sum, and
`_reduce_kernel` rescales and merges the partitions of each head. Only the grid size depends on host values;
each program reads its sequence's length from `context_lens`, so a launch captured in a CUDA graph with an
upper-bound `max_context_len` stays correct for shorter contexts.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from structgen.kernels._attention import (
    attend_paged_range,
    attend_reference,
    dot_options,
    gather_context,
)
from structgen.kernels._launch import (
    check_contiguous,
    check_device,
    check_index_tensors,
    check_paged_attention,
    check_power_of_two,
    check_shape,
    next_power_of_two,
)

DEFAULT_PARTITION_SIZE = 512
DEFAULT_BLOCK_N = 64
_WHOLE_CONTEXT = 1 << 30  # the partition size of an unsplit launch: a constant, so it compiles once


@triton.jit
def _decode_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,  # [num_seqs, num_heads, num_partitions, HEAD_DIM] float32 (split only)
    part_max_ptr,  # [num_seqs, num_heads, num_partitions] float32 (split only)
    part_sum_ptr,
    q_seq_stride,
    q_head_stride,
    block_table_stride,
    num_partitions,
    scale,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if start >= context_len:  # this partition lies past the sequence's end; the reduction never reads it
        return
    end = tl.minimum(start + PARTITION_SIZE, context_len)

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_offsets = seq.to(tl.int64) * q_seq_stride + heads[:, None] * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    m_i, l_i, acc = attend_paged_range(
        q.to(key_cache_ptr.dtype.element_ty),
        key_cache_ptr,
        value_cache_ptr,
        table,
        start,
        end,
        kv_head,
        m_i,
        l_i,
        acc,
        scale,
        BLOCK_G,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        HEAD_DIM,
        PRECISION,
        UPCAST,
    )

    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        part_rows = (seq.to(tl.int64) * NUM_KV_HEADS * GROUP + heads) * num_partitions + part
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_mask)
        tl.store(part_max_ptr + part_rows, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        out_offsets = (seq.to(tl.int64) * NUM_KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    context_lens_ptr,
    out_ptr,
    num_heads,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    used = tl.cdiv(context_len, PARTITION_SIZE)
    parts = tl.arange(0, BLOCK_P)
    part_ok = parts < used
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    base = (seq.to(tl.int64) * num_heads + head) * num_partitions
    maxes = tl.load(part_max_ptr + base + parts, mask=part_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + parts, mask=part_ok, other=0.0)
    global_max = tl.max(maxes, 0)
    weights = tl.where(part_ok, tl.exp(maxes - global_max), 0.0)
    total = tl.sum(sums * weights, 0)
    partial = tl.load(
        part_out_ptr + (base + parts[:, None]) * HEAD_DIM + dims[None, :],
        mask=part_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], 0) / total
    out_offsets = (seq.to(tl.int64) * num_heads + head) * HEAD_DIM + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _should_split(
    num_seqs: int, num_kv_heads: int, max_context_len: int, partition_size: int, device: torch.device
) -> bool:
    """Split when the context is long and the (sequence, KV head) programs alone would leave SMs idle."""
    if max_context_len <= partition_size:
        return False
    return num_seqs * num_kv_heads < 4 * _num_sms(device)


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    *,
    max_context_len: int,
    scale: float,
    split: bool | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    block_n: int = DEFAULT_BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output `[num_seqs, num_heads, head_dim]` (query dtype) of each sequence's newest token.

    `max_context_len` may be an upper bound (it only sizes the grid). `split` None chooses flash-decoding
    partitions by the heuristic; True/False force it (tests, CUDA-graph capture).
    """
    name = "paged_attention_decode"
    check_device(name, query, key_cache, value_cache, block_tables, context_lens)
    block_size, num_kv_heads, head_dim, num_heads = check_paged_attention(name, query, key_cache, value_cache)
    num_seqs = query.shape[0]
    check_shape(name, "block_tables", block_tables, (num_seqs, None))
    check_shape(name, "context_lens", context_lens, (num_seqs,))
    check_index_tensors(name, block_tables=block_tables, context_lens=context_lens)
    check_power_of_two(name, "block_n", block_n)
    if block_n < 16 or partition_size % block_n:
        raise ValueError(
            f"{name}: block_n ({block_n}) must be >= 16 and divide partition_size ({partition_size})"
        )
    if max_context_len < 1:
        raise ValueError(f"{name}: max_context_len must be >= 1, got {max_context_len}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_shape(name, "out", out, tuple(query.shape))
    check_contiguous(name, "out", out)
    if num_seqs == 0:
        return out

    if split is None:
        split = _should_split(num_seqs, num_kv_heads, max_context_len, partition_size, query.device)
    num_partitions = triton.cdiv(max_context_len, partition_size) if split else 1
    if not split:
        partition_size = _WHOLE_CONTEXT  # one partition covers everything
    group = num_heads // num_kv_heads
    block_d = max(16, next_power_of_two(head_dim))  # tl.dot needs K >= 16
    part_shape = (num_seqs, num_heads, num_partitions)
    if split:
        part_out = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=query.device)
        part_max = torch.empty(part_shape, dtype=torch.float32, device=query.device)
        part_sum = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    else:  # never touched: SPLIT is a compile-time False
        part_out = part_max = part_sum = out
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_max,
        part_sum,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        num_partitions,
        scale,
        GROUP=group,
        BLOCK_G=max(16, next_power_of_two(group)),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        SPLIT=split,
        **dot_options(query.dtype),
    )
    if split:
        _reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_max,
            part_sum,
            context_lens,
            out,
            num_heads,
            num_partitions,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PARTITION_SIZE=partition_size,
            BLOCK_P=next_power_of_two(num_partitions),
        )
    return out


def paged_attention_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Pure torch in float64, one sequence at a time (returned in float64)."""
    outs = []
    for i, length in enumerate(context_lens.tolist()):
        k = gather_context(key_cache, block_tables[i], length)
        v = gather_context(value_cache, block_tables[i], length)
        outs.append(attend_reference(query[i : i + 1], k, v, scale))
    return torch.cat(outs) if outs else query.new_empty(query.shape, dtype=torch.float64)
