"""`paged_attention_prefill`: causal attention for the new tokens of many sequences (varlen), where the earlier
tokens of each sequence are already in the paged cache (prefix-cache hits, earlier chunks of a chunked prefill).

Grid: (sequence, query head, block of `BLOCK_M` new tokens). A program first folds in the cached prefix (positions
`0 .. context_len - query_len - 1`, all visible to every new token) read through the block table, then the new
tokens themselves straight from this step's key/value tensors with the causal mask. Reading the new keys from
the inputs rather than the cache keeps the kernel independent of `store_kv` (and of padding slots, which are
never stored). A sequence with one new token (a decode inside a mixed step) is simply a block of one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from structgen.kernels._attention import (
    attend_paged_range,
    attend_reference,
    dot_options,
    gather_context,
    online_softmax_step,
)
from structgen.kernels._launch import (
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_dtype,
    check_index_tensors,
    check_paged_attention,
    check_power_of_two,
    check_shape,
    next_power_of_two,
)

DEFAULT_BLOCK_M = 16
DEFAULT_BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    v_token_stride,
    block_table_stride,
    scale,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first_row >= query_len:
        return
    prefix_len = tl.load(context_lens_ptr + seq) - query_len
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q_offsets = tokens[:, None] * q_token_stride + head * q_head_stride + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 1. The cached prefix: every new token sees all of it.
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    m_i, l_i, acc = attend_paged_range(
        q.to(key_cache_ptr.dtype.element_ty),
        key_cache_ptr,
        value_cache_ptr,
        table,
        0,
        prefix_len,
        kv_head,
        m_i,
        l_i,
        acc,
        scale,
        BLOCK_M,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        HEAD_DIM,
        PRECISION,
        UPCAST,
    )

    # 2. This step's tokens, causally: new token j is visible to new token i when j <= i. Column 0 is visible to
    # every row, so the first tile always gives each row a finite max.
    last = tl.minimum(first_row + BLOCK_M, query_len)
    for tile in range(0, last, BLOCK_N):
        cols = tile + tl.arange(0, BLOCK_N)
        valid = cols < query_len
        kv_tokens = (q_start + cols).to(tl.int64)
        kv_mask = valid[:, None] & dim_ok[None, :]
        kv_cols = kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + kv_tokens[:, None] * k_token_stride + kv_cols, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_tokens[:, None] * v_token_stride + kv_cols, mask=kv_mask, other=0.0)
        visible = valid[None, :] & (cols[None, :] <= rows[:, None])
        m_i, l_i, acc = online_softmax_step(
            q.to(k.dtype), k, v, visible, m_i, l_i, acc, scale, PRECISION, UPCAST
        )

    out = acc / l_i[:, None]
    out_offsets = (tokens[:, None] * (NUM_KV_HEADS * GROUP) + head) * HEAD_DIM + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32: cached + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    *,
    max_query_len: int,
    scale: float,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]` (query dtype). Rows of no sequence (past
    `query_start_loc[-1]`) are left as they are in `out` (zeros when it is allocated here)."""
    name = "paged_attention_prefill"
    check_device(name, query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc)
    block_size, num_kv_heads, head_dim, num_heads = check_paged_attention(name, query, key_cache, value_cache)
    num_tokens = query.shape[0]
    check_shape(name, "key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape(name, "value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape(name, "block_tables", block_tables, (None, None))
    num_seqs = block_tables.shape[0]
    check_shape(name, "context_lens", context_lens, (num_seqs,))
    check_shape(name, "query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype(name, "key", key, FLOAT_DTYPES)
    check_dtype(name, "value", value, FLOAT_DTYPES)
    check_contiguous(name, "key", key, inner_dims=1)
    check_contiguous(name, "value", value, inner_dims=1)
    check_index_tensors(
        name, block_tables=block_tables, context_lens=context_lens, query_start_loc=query_start_loc
    )
    check_power_of_two(name, "block_m", block_m)
    check_power_of_two(name, "block_n", block_n)
    if block_m < 16 or block_n < 16:
        raise ValueError(f"{name}: block_m ({block_m}) and block_n ({block_n}) must be >= 16 (tl.dot tiles)")
    if key.stride(1) != head_dim or value.stride(1) != head_dim or query.stride(1) < head_dim:
        raise ValueError(f"{name}: the heads of query/key/value must be packed rows of head_dim elements")
    if out is None:
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    check_shape(name, "out", out, tuple(query.shape))
    check_contiguous(name, "out", out)
    if num_seqs == 0 or num_tokens == 0 or max_query_len < 1:
        return out
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, block_m))](
        query,
        key,
        value,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        value.stride(0),
        block_tables.stride(0),
        scale,
        GROUP=num_heads // num_kv_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_two(head_dim)),  # tl.dot needs K >= 16
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **dot_options(query.dtype),
    )
    return out


def paged_attention_prefill_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Pure torch in float64, one sequence at a time: the cached prefix from the cache, then the new keys.
    Returns `[num_tokens, num_heads, head_dim]` float64 (zeros on rows of no sequence)."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    starts = query_start_loc.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        prefix_len = context_len - (starts[i + 1] - starts[i])
        k = torch.cat([gather_context(key_cache, block_tables[i], prefix_len).to(key.dtype), key[rows]])
        v = torch.cat([gather_context(value_cache, block_tables[i], prefix_len).to(value.dtype), value[rows]])
        out[rows] = attend_reference(query[rows], k, v, scale)
    return out
