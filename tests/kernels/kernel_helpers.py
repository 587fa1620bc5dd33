"""Random paged-KV batches for the attention kernel tests: sequences with `cached` tokens already in a shuffled
block pool and `new` tokens arriving in this step, with q/k/v as strided views of one fused projection (as the
model produces them)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
from structgen.kernels.store_kv import store_kv_reference

# Relative error ‖out − ref‖ / ‖ref‖ each dtype must reach against the float64 references.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set for the block, and put back after it (the kernels split work by it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [tokens, heads, d]
    key: torch.Tensor  # [tokens, kv_heads, d]
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor  # int64, the new tokens' slots
    block_tables: torch.Tensor  # int32, -1 past each sequence's blocks
    context_lens: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32
    max_query_len: int
    max_context_len: int
    scale: float


def paged_batch(
    cached: list[int],
    new: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    store_new: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """`store_new` also writes the new tokens into the cache (what a decode step reads)."""
    gen = torch.Generator().manual_seed(seed)
    contexts = [c + n for c, n in zip(cached, new, strict=True)]
    needed = [-(-c // block_size) for c in contexts]
    num_blocks = sum(needed) + 2
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    width = max(needed) + 1  # a trailing -1 column, as the engine pads tables
    block_tables = torch.full((len(cached), width), -1, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Garbage (not zeros) where nothing is stored, so reading a wrong slot shows.
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)

    def slots(i: int, start: int, end: int) -> torch.Tensor:
        return torch.tensor(
            [tables[i][p // block_size] * block_size + p % block_size for p in range(start, end)],
            dtype=torch.int64,
        )

    for i, c in enumerate(cached):
        prefix_k = torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype)
        prefix_v = torch.randn(c, kv_heads, head_dim, generator=gen).to(dtype)
        store_kv_reference(prefix_k, prefix_v, key_cache, value_cache, slots(i, 0, c))

    num_tokens = sum(new)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    slot_mapping = torch.cat([slots(i, c, c + n) for i, (c, n) in enumerate(zip(cached, new, strict=True))])
    key = k.view(num_tokens, kv_heads, head_dim)
    value = v.view(num_tokens, kv_heads, head_dim)
    if store_new:
        store_kv_reference(key, value, key_cache, value_cache, slot_mapping)
    return PagedBatch(
        query=q.view(num_tokens, heads, head_dim),
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        query_start_loc=torch.tensor(list(accumulate(new, initial=0)), dtype=torch.int32),
        max_query_len=max(new),
        max_context_len=max(contexts),
        scale=head_dim**-0.5,
    )
