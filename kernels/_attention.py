"""Pieces the two paged-attention kernels share: the paged tile load, the online-softmax step (in Triton), and the
float64 attention the pure-torch references are built on."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from structgen.kernels._launch import interpreting


@triton.jit
def load_paged_tile(
    cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    tokens,  # [BLOCK_N] logical positions
    valid,  # [BLOCK_N] which positions to load
    kv_head,
    dims,  # [BLOCK_D]
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """`[BLOCK_N, BLOCK_D]` keys (or values) of one KV head at logical `tokens`, looked up through the block table
    token by token, so a tile may span several (power-of-two sized) cache blocks."""
    block = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + tokens % BLOCK_SIZE
    offsets = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def online_softmax_step(
    q,  # [BLOCK_M, BLOCK_D]
    k,  # [BLOCK_N, BLOCK_D]
    v,  # [BLOCK_N, BLOCK_D]
    visible,  # [BLOCK_M, BLOCK_N]: which scores count
    m_i,  # [BLOCK_M] running max (float32)
    l_i,  # [BLOCK_M] running sum of exponentials
    acc,  # [BLOCK_M, BLOCK_D] running unnormalized output (float32)
    scale,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold one key/value tile into the running softmax. Every row must see at least one key over the whole
    loop, and the first tile a row sees must have one visible key, so the running max is never -inf."""
    if UPCAST:
        q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_paged_range(
    q,  # [BLOCK_M, BLOCK_D], in the cache's dtype
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    start,
    end,
    kv_head,
    m_i,
    l_i,
    acc,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold cached positions `start .. end-1`, visible to every query row, into the running softmax."""
    dims = tl.arange(0, BLOCK_D)
    every_row = tl.arange(0, BLOCK_M)[:, None] >= 0
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        valid = positions < end
        k = load_paged_tile(
            key_cache_ptr,
            block_table_ptr,
            positions,
            valid,
            kv_head,
            dims,
            BLOCK_SIZE,
            NUM_KV_HEADS,
            HEAD_DIM,
        )
        v = load_paged_tile(
            value_cache_ptr,
            block_table_ptr,
            positions,
            valid,
            kv_head,
            dims,
            BLOCK_SIZE,
            NUM_KV_HEADS,
            HEAD_DIM,
        )
        visible = valid[None, :] & every_row
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale, PRECISION, UPCAST)
    return m_i, l_i, acc


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """The `PRECISION` and `UPCAST` constants of `online_softmax_step` for inputs of `dtype`."""
    # float32 inputs get exact float32 products (the engine's CPU dtype and the reference tolerance expect it);
    # half-precision inputs use the tensor cores with float32 accumulation either way. Triton's interpreter
    # multiplies bfloat16 tiles as their raw uint16 storage, so there (only) they are upcast first.
    return {
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST": interpreting() and dtype == torch.bfloat16,
    }


def attend_reference(
    q: torch.Tensor,  # [n, heads, d]: the last n positions of the context
    k: torch.Tensor,  # [context, kv_heads, d]
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention in float64 of the context's last `n` positions; query heads `h*group .. h*group+group-1`
    share KV head `h` (HF's repeat_kv order)."""
    n, heads, _ = q.shape
    context, kv_heads, _ = k.shape
    group = heads // kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    positions = torch.arange(context - n, context, device=q.device)
    hidden = torch.arange(context, device=q.device)[None, :] > positions[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v64)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens `[length, kv_heads, d]` of a sequence, read through its block table."""
    block_size = cache.shape[1]
    positions = torch.arange(length)
    blocks = block_table.long().cpu()[positions // block_size]
    return cache[blocks.to(cache.device), (positions % block_size).to(cache.device)]
