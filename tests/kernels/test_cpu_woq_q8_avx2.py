"""The int8-x AVX2 kernel (`csrc/cpu_woq_q8_avx2.cpp`) against its torch reference and the exact product: fp32 and
bf16 x, row counts inside one pass of 4, across passes and across the L1 chunks of rows, one and many tiles,
blocks of very different ranges and an all-zero one; the layer kernel that calls it; the launcher's casts and
checks.
Runs wherever the CPU has AVX2 (AVX-512 machines too)."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_woq
from woq_helpers import activations, exact_product, packed_weight

needs_avx2 = pytest.mark.skipif(
    not cpu_woq.q8_avx2_available(), reason="the CPU has no AVX2 / FMA / F16C (or no native kernels)"
)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 30])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 576), (576, 1536)])
def test_kernel_matches_the_reference(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    weight = packed_weight(n, k, 4, seed=rows)
    x = activations(rows, k, dtype=dtype)
    out = cpu_woq.woq_q8_avx2(x, weight)
    expected = cpu_woq.woq_q8_reference(x, weight)
    assert out.dtype == expected.dtype == dtype
    scale = expected.float().abs().amax(dim=1, keepdim=True) + 1e-3
    # the same int8 codes and fp32 weights, fp32 sums in another order: fp32 rounding apart in fp32, one bf16
    # rounding at most in bf16
    bound = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((out.float() - expected.float()).abs() / scale).max().item() <= bound
    # and the exact product of the packed weights: x's int8 steps (1/254 of a block's largest |x|)
    exact = exact_product(x, weight)
    assert ((out.double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)).max().item() <= 2**-5


@needs_avx2
def test_many_rows_cross_the_chunks_of_rows_and_the_threads() -> None:
    """1,002 rows of K = 1536: chunks of 4 rows (16 KB of x a chunk) and a last one of 2; 90 tiles over the
    threads. Every row must equal the same row computed alone (the arithmetic is per row)."""
    weight = packed_weight(1440, 1536, 4, seed=3)
    x = activations(1002, 1536, dtype=torch.float32, seed=4)
    out = cpu_woq.woq_q8_avx2(x, weight)
    torch.testing.assert_close(out, cpu_woq.woq_q8_reference(x, weight), rtol=1e-4, atol=1e-4)
    for row in (0, 3, 4, 511, 1001):
        assert torch.equal(out[row : row + 1], cpu_woq.woq_q8_avx2(x[row : row + 1], weight))


@needs_avx2
def test_the_layer_kernel_calls_it_and_woq_gemv_does_not() -> None:
    """`WoqQ8` (an fp32 model's prompt chunks) runs this kernel; `woq_gemv` (decode) keeps x in int16 steps."""
    x = activations(3, 128, dtype=torch.float32)
    four = packed_weight(64, 128, 4)
    assert torch.equal(cpu_woq.WoqQ8(four)(x), cpu_woq.woq_q8_avx2(x, four))
    assert torch.equal(cpu_woq.woq_gemv(x, four), cpu_woq.woq_gemv_avx2(x, four))
    # int8 steps of x are coarser than the int16 GEMV's: within 2^-5 of the exact product, not 2^-12
    exact = exact_product(x, four)
    error = (
        (cpu_woq.woq_q8_avx2(x, four).double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)
    ).max()
    assert 2**-16 < error.item() < 2**-5


@needs_avx2
def test_launcher_takes_other_shapes_and_dtypes() -> None:
    weight = packed_weight(64, 64, 4)
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(0))
    out = cpu_woq.woq_q8_avx2(x, weight)
    assert out.shape == (2, 1, 64) and out.dtype == torch.float32
    expected = cpu_woq.woq_q8_reference(x.reshape(2, 64), weight).reshape(2, 1, 64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    half = cpu_woq.woq_q8_avx2(x.reshape(2, 64).half(), weight)  # other dtypes go through bf16
    assert half.dtype == torch.float16
    assert cpu_woq.woq_q8_avx2(torch.empty(0, 64), weight).shape == (0, 64)


@needs_avx2
def test_bad_arguments_are_refused() -> None:
    four, eight = packed_weight(64, 64, 4), packed_weight(64, 64, 8)
    with pytest.raises(ValueError, match="4-bit weights only"):
        cpu_woq.woq_q8_avx2(torch.zeros(2, 64), eight)
    with pytest.raises(RuntimeError, match="only 4-bit"):  # the op itself, called around the launcher
        torch.ops.structgen_cpu.woq_q8_avx2(
            torch.zeros(2, 64), eight.qweight, eight.scales, four.mins, 8, torch.empty(2, 64)
        )
    with pytest.raises(ValueError, match="x has K = 48"):
        cpu_woq.woq_q8_avx2(torch.zeros(2, 48), four)
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16 or fp32"):
        torch.ops.structgen_cpu.woq_q8_avx2(
            torch.zeros(2, 64, dtype=torch.float64),
            four.qweight,
            four.scales,
            four.mins,
            4,
            torch.empty(2, 64),
        )
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.structgen_cpu.woq_q8_avx2(
            torch.zeros(2, 64), four.qweight, four.scales, four.mins, 4, torch.empty(3, 64)
        )
