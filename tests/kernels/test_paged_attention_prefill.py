"""paged_attention_prefill under the interpreter against the float64 reference: fresh prompts, prompts on a cached
prefix (prefix-cache hits, later chunks of a chunked prefill), one-token rows, GQA, half precision."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import TOLERANCE, paged_batch, relative_error
from structgen.kernels.paged_attention_prefill import (
    paged_attention_prefill,
    paged_attention_prefill_reference,
)


def _check(cached: list[int], new: list[int], **shape) -> None:
    batch = paged_batch(cached, new, **shape)
    args = (
        batch.query,
        batch.key,
        batch.value,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
    )
    out = paged_attention_prefill(*args, max_query_len=batch.max_query_len, scale=batch.scale, block_n=16)
    ref = paged_attention_prefill_reference(*args, scale=batch.scale)
    assert relative_error(out, ref) < TOLERANCE[shape.get("dtype", torch.float32)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(4, 4, 32, 4), (8, 2, 64, 16), (8, 1, 128, 8)],  # GQA 1, 4, 8
)
def test_fresh_and_prefix_cached_sequences(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    # No prefix, a prefix ending on a block boundary (16), one off it (17), a decode row inside the step (1 new),
    # and a chunk longer than one 16-row query block (20).
    _check(
        [0, 16, 5, 17],
        [7, 1, 20, 3],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    _check([0, 20], [17, 2], heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=dtype)


def test_rows_past_the_last_sequence_are_left_alone() -> None:
    batch = paged_batch([2], [3], heads=4, kv_heads=2, head_dim=32, block_size=4)
    padded = torch.cat([batch.query, torch.ones(2, 4, 32)])
    key = torch.cat([batch.key, torch.ones(2, 2, 32)])
    out = paged_attention_prefill(
        padded,
        key,
        key,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        max_query_len=3,
        scale=batch.scale,
    )
    assert torch.equal(out[3:], torch.zeros(2, 4, 32))
    assert bool(out[:3].abs().sum() > 0)


def test_uncached_prompt_never_reads_the_block_table() -> None:
    # The profiling forward passes a table of -1 and no cached prefix; nothing may be read through it.
    batch = paged_batch([0], [9], heads=4, kv_heads=2, head_dim=32, block_size=4)
    table = torch.full_like(batch.block_tables, -1)
    args = (batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache)
    out = paged_attention_prefill(
        *args, table, batch.context_lens, batch.query_start_loc, max_query_len=9, scale=batch.scale
    )
    ref = paged_attention_prefill_reference(
        *args, batch.block_tables, batch.context_lens, batch.query_start_loc, scale=batch.scale
    )
    assert relative_error(out, ref) < 1e-5


def test_bad_arguments_fail_clearly() -> None:
    batch = paged_batch([0], [4], heads=4, kv_heads=2, head_dim=32, block_size=4)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        paged_attention_prefill(
            batch.query,
            batch.key,
            batch.value,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.context_lens,
            batch.query_start_loc[:1],
            max_query_len=4,
            scale=1.0,
        )
