"""The AVX2 weight-only quantized GEMV (`csrc/cpu_woq_gemv_avx2.cpp`) against the torch reference it shares with
the VNNI kernel and against the exact product: fp32 and bf16 x, both bit widths, row counts inside one pass of 3
and across passes, one and many tiles; the launcher's casts and checks (an fp32 model's layers getting it:
tests/models/test_woq.py). Runs wherever the CPU has AVX2 (AVX-512 machines too)."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_woq
from woq_helpers import activations, exact_product, packed_weight

needs_avx2 = pytest.mark.skipif(
    not cpu_woq.avx2_gemv_available(), reason="the CPU has no AVX2 / FMA / F16C (or no native kernels)"
)


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 576), (576, 1536)])
def test_kernel_matches_the_reference(dtype: torch.dtype, bits: int, rows: int, n: int, k: int) -> None:
    weight = packed_weight(n, k, bits, seed=rows)
    x = activations(rows, k, dtype=dtype)
    out = cpu_woq.woq_gemv_avx2(x, weight)
    expected = cpu_woq.woq_gemv_reference(x, weight)
    assert out.dtype == expected.dtype == dtype
    scale = expected.float().abs().amax(dim=1, keepdim=True) + 1e-3
    # the same int16 codes and fp32 weights, fp32 sums in another order: fp32 rounding apart in fp32, one bf16
    # rounding at most in bf16
    bound = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((out.float() - expected.float()).abs() / scale).max().item() <= bound
    # and the exact product of the packed weights: the int16 steps of x (and bf16 rounding of the result)
    exact = exact_product(x, weight)
    assert ((out.double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)).max().item() <= 2**-7


@needs_avx2
def test_fp32_rows_are_computed_in_fp32_not_through_bf16() -> None:
    weight = packed_weight(64, 128, 8)
    x = activations(2, 128, dtype=torch.float32)
    out = cpu_woq.woq_gemv(x, weight)  # fp32 x goes to the AVX2 kernel on any CPU
    exact = exact_product(x, weight)
    error = ((out.double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)).max().item()
    assert out.dtype == torch.float32 and error < 2**-12  # bf16 rounding alone would be ~2^-9


@needs_avx2
def test_launcher_takes_other_shapes_and_dtypes() -> None:
    weight = packed_weight(64, 64, 4)
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(0))  # seeded: fp32 sums agree to ~1e-5
    out = cpu_woq.WoqGemv(weight)(x)
    assert out.shape == (2, 1, 64) and out.dtype == torch.float32
    expected = cpu_woq.woq_gemv_reference(x.reshape(2, 64), weight).reshape(2, 1, 64)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    half = cpu_woq.woq_gemv_avx2(x.reshape(2, 64).half(), weight)  # other dtypes go through bf16
    assert half.dtype == torch.float16
    assert cpu_woq.woq_gemv_avx2(torch.empty(0, 64), weight).shape == (0, 64)


@needs_avx2
def test_kernel_refuses_mismatched_arguments() -> None:
    weight = packed_weight(64, 64, 8)
    with pytest.raises(RuntimeError, match="x has K = 96"):  # the op's own check, below the launcher
        torch.ops.structgen_cpu.woq_gemv_avx2(
            torch.zeros(2, 96), weight.qweight, weight.scales, weight.mins, 8, torch.empty(2, 64)
        )
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.structgen_cpu.woq_gemv_avx2(
            torch.zeros(2, 64), weight.qweight, weight.scales, weight.mins, 8, torch.empty(2, 64).bfloat16()
        )
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16 or fp32"):
        double = torch.zeros(1, 64, dtype=torch.float64)
        torch.ops.structgen_cpu.woq_gemv_avx2(
            double, weight.qweight, weight.scales, weight.mins, 8, torch.empty_like(double)
        )
    with pytest.raises(ValueError, match="x has K = 48"):  # the launcher's message for the op's refusal
        cpu_woq.woq_gemv_avx2(torch.zeros(2, 48), weight)
    with pytest.raises(ValueError, match="int linear"):  # one the launcher reshapes first
        cpu_woq.woq_gemv_avx2(torch.zeros(2, 48, dtype=torch.float64), weight)
