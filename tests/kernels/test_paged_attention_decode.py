"""paged_attention_decode under the interpreter against the float64 reference: GQA ratios 1/4/8, block sizes,
one-token and block-boundary contexts, split-K partitions with their reduction, half precision."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import TOLERANCE, paged_batch, relative_error
from structgen.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_reference


def _run(
    contexts: list[int], *, split: bool | None, partition_size: int = 64, **shape
) -> tuple[float, float]:
    dtype = shape.get("dtype", torch.float32)
    batch = paged_batch([c - 1 for c in contexts], [1] * len(contexts), store_new=True, **shape)
    out = paged_attention_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        max_context_len=batch.max_context_len,
        scale=batch.scale,
        split=split,
        partition_size=partition_size,
        block_n=16,
    )
    assert out.dtype == dtype and out.shape == batch.query.shape
    ref = paged_attention_decode_reference(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.context_lens,
        scale=batch.scale,
    )
    return relative_error(out, ref), TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(4, 4, 64, 16), (8, 2, 32, 4), (8, 1, 128, 2), (16, 2, 64, 1)],  # GQA 1, 4, 8 (x2 kv heads)
)
def test_matches_reference_without_split(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    # One-token contexts, exact block boundaries (16, 32) and one past them, longer than one 16-token tile.
    contexts = [1, 16, 17, 32, 45]
    err, tol = _run(
        contexts, split=False, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size
    )
    assert err < tol


@pytest.mark.parametrize("contexts", [[1, 64, 65, 200], [130]])
def test_split_partitions_and_reduce(contexts: list[int]) -> None:
    # Partition boundaries at 64: a sequence shorter than one partition, exactly one, one past it, several.
    err, tol = _run(contexts, split=True, heads=8, kv_heads=2, head_dim=64, block_size=16)
    assert err < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    err, tol = _run([3, 90], split=None, heads=8, kv_heads=1, head_dim=64, block_size=8, dtype=dtype)
    assert err < tol


def test_upper_bound_max_context_len_is_harmless() -> None:
    # CUDA-graph capture launches with the largest context; shorter sequences must still be exact.
    batch = paged_batch([4, 9], [1, 1], heads=4, kv_heads=2, head_dim=32, block_size=4, store_new=True)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens)
    ref = paged_attention_decode_reference(*args, scale=batch.scale)
    for split in (False, True):
        out = paged_attention_decode(
            *args, max_context_len=512, scale=batch.scale, split=split, partition_size=64
        )
        assert relative_error(out, ref) < 1e-5


def test_bad_arguments_fail_clearly() -> None:
    batch = paged_batch([3], [1], heads=6, kv_heads=2, head_dim=32, block_size=4, store_new=True)
    good = dict(max_context_len=4, scale=1.0)
    cache = batch.key_cache
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention_decode(
            batch.query[:, :5], cache, cache, batch.block_tables, batch.context_lens, **good
        )
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention_decode(
            batch.query, cache, cache, batch.block_tables.long(), batch.context_lens, **good
        )
    odd_blocks = torch.zeros(4, 3, 2, 32)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        paged_attention_decode(
            batch.query, odd_blocks, odd_blocks, batch.block_tables, batch.context_lens, **good
        )
