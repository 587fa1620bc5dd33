"""The VNNI weight-only quantized GEMV against its torch reference and against the exact product: both bit
widths, row counts inside one pass of 4 and across passes, shapes with one and many tiles, the launcher's checks.
The reference runs everywhere; the kernel only where the CPU has AVX512-VNNI (elsewhere the model never calls it:
`attach_int4` gives the layers no GEMV)."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_woq
from woq_helpers import activations, exact_product, packed_weight

needs_vnni = pytest.mark.skipif(not cpu_woq.gemv_available(), reason="the CPU has no AVX512-VNNI")


def test_activation_quantization_keeps_each_block_to_its_own_scale() -> None:
    x = activations(3, 128).float()
    quantized = cpu_woq.quantize_activations(x)
    step = x.reshape(3, 4, 32).abs().amax(dim=-1, keepdim=True) / 32767.0
    assert ((quantized - x).reshape(3, 4, 32).abs() <= step / 2 + 1e-12).all()
    assert (quantized[:, 32:64] == 0).all()


def test_reference_is_the_exact_product_up_to_int16_activations() -> None:
    weight = packed_weight(64, 128, 4)
    x = activations(2, 128)
    reference = cpu_woq.woq_gemv_reference(x, weight).double()
    exact = exact_product(x, weight)
    scale = exact.abs().amax(dim=1, keepdim=True)
    assert ((reference - exact).abs() / scale).max().item() <= 2**-7


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 576), (576, 1536)])
def test_kernel_matches_the_reference(bits: int, rows: int, n: int, k: int) -> None:
    weight = packed_weight(n, k, bits, seed=rows)
    x = activations(rows, k)
    out = cpu_woq.woq_gemv(x, weight)
    expected = cpu_woq.woq_gemv_reference(x, weight)
    # the same int16 codes and fp32 weights, fp32 sums in another order: one bf16 rounding apart at most
    scale = expected.float().abs().amax(dim=1, keepdim=True) + 1e-3
    assert ((out.float() - expected.float()).abs() / scale).max().item() <= 2**-7
    # and the exact product of the packed weights: bf16 rounding of the result plus the int16 steps of x
    exact = exact_product(x, weight)
    assert ((out.double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)).max().item() <= 2**-7


@needs_vnni
def test_kernel_agrees_with_the_amx_path_on_the_same_blocks() -> None:
    """The two kernels differ only in rounding: AMX's weights in bf16, the GEMV's activations in int16."""
    weight = packed_weight(96, 576, 4)
    x = activations(1, 576)
    dense = (x.float() @ cpu_woq.dequantize(weight).float().t()).bfloat16()  # AMX's arithmetic
    gemv = cpu_woq.woq_gemv(x, weight)
    scale = dense.float().abs().amax() + 1e-3
    assert ((gemv.float() - dense.float()).abs() / scale).max().item() < 2**-5


@needs_vnni
def test_kernel_takes_other_shapes_and_dtypes_through_the_launcher() -> None:
    # fp16 rows go through bf16 (fp32 ones to the AVX2 kernel: tests/kernels/test_cpu_woq_gemv_avx2.py)
    weight = packed_weight(64, 64, 4)
    x = torch.randn(2, 1, 64).half()
    out = cpu_woq.WoqGemv(weight)(x)
    assert out.shape == (2, 1, 64) and out.dtype == torch.float16
    expected = cpu_woq.woq_gemv_reference(x.reshape(2, 64).bfloat16(), weight).half().reshape(2, 1, 64)
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-3)
    assert cpu_woq.woq_gemv(torch.empty(0, 64, dtype=torch.bfloat16), weight).shape == (0, 64)


@needs_vnni
def test_kernel_refuses_mismatched_arguments() -> None:
    weight = packed_weight(64, 64, 8)
    with pytest.raises(RuntimeError, match="x has K = 96"):  # the op's own check, below the launcher
        torch.ops.structgen_cpu.woq_gemv(
            torch.zeros(2, 96, dtype=torch.bfloat16),
            weight.qweight,
            weight.scales,
            weight.mins,
            8,
            torch.empty(2, 64, dtype=torch.bfloat16),
        )
    as_uint8 = cpu_woq.WoqWeight(weight.qweight.view(torch.uint8), weight.scales, weight.mins, 8)
    with pytest.raises(ValueError, match="qweight must be"):
        cpu_woq.woq_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), as_uint8)
    with pytest.raises(ValueError, match="out must be"):
        cpu_woq.woq_gemv(torch.zeros(2, 64, dtype=torch.bfloat16), weight, out=torch.empty(3, 64))
    with pytest.raises(ValueError, match="int linear"):  # the launcher's check, before a reshape
        cpu_woq.woq_gemv(torch.zeros(2, 1, 48, dtype=torch.bfloat16), weight)
    with pytest.raises(
        ValueError, match="x has K = 48"
    ):  # fp32 goes to the AVX2 kernel, which checks K itself
        cpu_woq.woq_gemv(torch.zeros(2, 48), weight)
