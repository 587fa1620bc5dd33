"""The prefill attention (bf16 on AVX512-BF16; fp32 on AVX-512F, or AVX2 + FMA without AVX-512) against its
float32 reference: prompts and chunks on cached prefixes, over scattered cache blocks, every head size and
grouping it takes, rows past the tiles' and blocks' edges, and the launcher's refusals."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_prefill_attention as prefill

needs_bf16 = pytest.mark.skipif(
    not prefill.available(torch.bfloat16), reason="needs the native CPU kernels and a CPU with AVX512-BF16"
)
needs_fp32 = pytest.mark.skipif(
    not prefill.available(torch.float32),
    reason="needs the native CPU kernels and a CPU with AVX-512F or AVX2 + FMA",
)
pytestmark = pytest.mark.skipif(
    not prefill.available(torch.float32),
    reason="needs the native CPU kernels and a CPU with AVX-512F or AVX2 + FMA",
)
DTYPES = [pytest.param(torch.bfloat16, marks=needs_bf16), pytest.param(torch.float32, marks=needs_fp32)]

# bf16: the kernel rounds each softmax weight to bf16 before the value product and its output to bf16, a few
# bf16 ulps of outputs of size ~1; fp32: fp32 rounding in another summation order (and a ~2e-7 exp).
TOLERANCES = {torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _context(
    context_len: int,
    *,
    kv_heads: int,
    dim: int,
    block_size: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches holding one context in scattered blocks (as after frees and preemptions), and its table, with
    unused entries past the context and spare blocks of other data."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context_len // block_size)
    total = blocks + 4
    key_cache = torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype)
    value_cache = torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype)
    table = torch.full((blocks + 2,), -1, dtype=torch.int32)
    table[:blocks] = torch.randperm(total, generator=gen)[:blocks].int()
    return key_cache, value_cache, table


# Tiles: AVX-512 takes 32 query rows x 64 keys; AVX2 24 rows (passes of 6) x 64 keys (groups of 16); blocks are
# 16 tokens.
@pytest.mark.parametrize(
    ("new", "context_len"),
    [
        (1, 1),  # a one-token prompt
        (2, 2),  # two rows: a partial row pass, a query tile of 2
        (2, 50),  # two new tokens on a cached prefix
        (7, 7),  # a full row pass and one row
        (24, 24),  # exactly one AVX2 query tile
        (25, 25),  # and one row more
        (64, 64),  # exactly one key tile
        (65, 65),
        (100, 100),  # several query and key tiles, a partial last one
        (33, 130),  # a chunk on a cached prefix that ends mid-block and mid-tile
        (31, 97),  # a chunk ending one past a block, mid key group
        (200, 202),  # a prompt whose first tokens the prefix cache held
        (5, 300),
        (300, 300),  # query tiles that see several whole key tiles before their diagonal one
    ],
)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_reference(
    new: int, context_len: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    key_cache, value_cache, table = _context(
        context_len, kv_heads=kv_heads, dim=dim, seed=new + context_len, dtype=dtype
    )
    query = torch.randn(new, heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = dict(block_table=table, context_len=context_len, scale=dim**-0.5)
    out = prefill.prefill_attention(query, key_cache, value_cache, **args)
    expected = prefill.prefill_attention_reference(query, key_cache, value_cache, **args)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sharp_scores_keep_the_softmax_exact(dtype: torch.dtype) -> None:
    """Large scores (a peaked softmax, where a running max that lagged would overflow) and a later tile that
    raises the max: the result still matches."""
    key_cache, value_cache, table = _context(150, kv_heads=2, dim=64, seed=3, dtype=dtype)
    key_cache[table[8].item()] *= 30  # keys 128..143 score far above the rest
    query = (torch.randn(150, 4, 64, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    args = dict(block_table=table, context_len=150, scale=0.125)
    out = prefill.prefill_attention(query, key_cache, value_cache, **args)
    expected = prefill.prefill_attention_reference(query, key_cache, value_cache, **args)
    assert torch.isfinite(out.float()).all()
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_and_writes_strided_rows_only(dtype: torch.dtype) -> None:
    """q as a view of a fused qkv projection (rows wider than the heads), the output into rows of a larger
    tensor: only those rows change."""
    key_cache, value_cache, table = _context(70, kv_heads=3, dim=64, seed=5, dtype=dtype)
    qkv = torch.randn(70, (9 + 2 * 3) * 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    query = qkv[:, : 9 * 64].view(70, 9, 64)
    out = torch.full((80, 9, 64), 7.0, dtype=dtype)
    args = dict(block_table=table, context_len=70, scale=0.125)
    prefill.prefill_attention(query, key_cache, value_cache, out=out[5:75], **args)
    expected = prefill.prefill_attention_reference(query.contiguous(), key_cache, value_cache, **args)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out[5:75].float(), expected.float(), atol=tol, rtol=tol)
    assert (out[:5] == 7).all() and (out[75:] == 7).all()


@needs_fp32
def test_two_threads_split_the_work_to_the_same_result() -> None:
    """The suite runs one torch thread; the kernel splits heads x query tiles between threads by cost: with two,
    every row is still written once and right (compared bit for bit with one thread's result)."""
    key_cache, value_cache, table = _context(500, kv_heads=3, dim=64, seed=6, dtype=torch.float32)
    query = torch.randn(480, 9, 64, generator=torch.Generator().manual_seed(7))
    args = dict(block_table=table, context_len=500, scale=0.125)
    one = prefill.prefill_attention(query, key_cache, value_cache, **args)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = prefill.prefill_attention(query, key_cache, value_cache, **args)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)
    expected = prefill.prefill_attention_reference(query, key_cache, value_cache, **args)
    torch.testing.assert_close(two, expected, atol=2e-5, rtol=2e-5)


def test_supports_only_what_the_kernel_takes() -> None:
    key_cache = torch.zeros(2, 16, 1, 64)
    assert prefill.supports(torch.zeros(3, 2, 64), key_cache)
    assert prefill.supports(torch.zeros(3, 2, 64, dtype=torch.bfloat16), key_cache.bfloat16()) == (
        prefill.available(torch.bfloat16)
    )
    assert not prefill.supports(torch.zeros(3, 2, 64), key_cache.bfloat16())  # mixed dtypes
    assert not prefill.supports(torch.zeros(3, 2, 64, dtype=torch.float16), key_cache.half())
    assert not prefill.supports(torch.zeros(3, 2, 48), key_cache[..., :48])


# Each change is made for the dtype under test: `other` is the other kernel dtype.
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda dtype, other: {"key_cache": torch.zeros(3, 16, 1, 64, dtype=other)},
            "key_cache must be",
        ),
        (
            lambda dtype, other: {"query": torch.zeros(4, 2, 64, dtype=torch.float16)},
            "query must be bfloat16, float32",
        ),
        (lambda dtype, other: {"query": torch.zeros(4, 2, 48, dtype=dtype)}, "query must have shape"),
        (lambda dtype, other: {"context_len": 3}, "context_len"),
        (lambda dtype, other: {"context_len": 100}, "context_len"),
        (lambda dtype, other: {"block_table": torch.tensor([0, 9], dtype=torch.int32)}, "out of range"),
        (lambda dtype, other: {"block_table": torch.tensor([0, 1])}, "block_table must be int32"),
    ],
    ids=["mixed-dtypes", "fp16", "head-dim", "short-context", "long-context", "bad-block", "int64-table"],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_calls_raise_a_clear_error(change, message: str, dtype: torch.dtype) -> None:
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    args = {
        "query": torch.zeros(4, 2, 64, dtype=dtype),
        "key_cache": torch.zeros(3, 16, 1, 64, dtype=dtype),
        "value_cache": torch.zeros(3, 16, 1, 64, dtype=dtype),
        "block_table": torch.tensor([0, 1], dtype=torch.int32),
        "context_len": 20,
        "scale": 0.125,
    } | change(dtype, other)
    query, key_cache, value_cache = args.pop("query"), args.pop("key_cache"), args.pop("value_cache")
    with pytest.raises(ValueError, match=message):
        prefill.prefill_attention(query, key_cache, value_cache, **args)
