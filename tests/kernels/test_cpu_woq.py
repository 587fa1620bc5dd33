"""The AMX weight-only quantized linear against its torch reference: packing, both bit widths, the fused (<= 32
rows) and buffered (> 32 rows) paths, and the launcher's checks. Packing and its reference run everywhere; the
kernel runs only where the CPU grants AMX (elsewhere the model never calls it: `build_woq_kernels` returns {})."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_woq

needs_amx = pytest.mark.skipif(not cpu_woq.amx_available(), reason="the CPU has no AMX bf16 tiles")


def _codes(
    n: int, k: int, bits: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    if bits == 4:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        return q, d, -torch.rand(n, k // 32, generator=gen) * 0.1
    return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen), d, None


def _plain_weight(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """d q + m per block of 32, d and m rounded to fp16 as the packing stores them, the weight to bf16."""
    w = q.float() * d.half().float().repeat_interleave(32, dim=1)
    if m is not None:
        w = w + m.half().float().repeat_interleave(32, dim=1)
    return w.bfloat16()


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_round_trips_to_the_plain_weight(bits: int) -> None:
    q, d, m = _codes(64, 96, bits)
    weight = cpu_woq.pack_woq(q, d, m, bits=bits)
    assert (weight.out_features, weight.in_features) == (64, 96)
    # fp32 d q + m rounds once in the kernel (an FMA) and twice here: the bf16 weights may differ by one ulp
    torch.testing.assert_close(cpu_woq.dequantize(weight), _plain_weight(q, d, m), rtol=2**-7, atol=1e-6)


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 48, 49, 64, 65, 77])
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 576), (576, 1536)])
def test_kernel_matches_the_reference(bits: int, rows: int, n: int, k: int) -> None:
    q, d, m = _codes(n, k, bits, seed=rows)
    weight = cpu_woq.pack_woq(q, d, m, bits=bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = cpu_woq.woq_linear(x, weight)
    expected = cpu_woq.woq_linear_reference(x, weight)
    # same bf16 weights and fp32 sums in another order: one bf16 rounding of the result apart at most
    scale = expected.float().abs().amax(dim=1, keepdim=True) + 1e-3
    assert ((out.float() - expected.float()).abs() / scale).max().item() <= 2**-7
    # and against the plain formula, independent of the packing
    plain = (x.float() @ _plain_weight(q, d, m).float().t()).bfloat16()
    assert ((out.float() - plain.float()).abs() / scale).max().item() <= 2**-6


@needs_amx
def test_kernel_takes_other_shapes_and_dtypes_through_the_launcher() -> None:
    q, d, m = _codes(64, 64, 4)
    weight = cpu_woq.pack_woq(q, d, m, bits=4)
    x = torch.randn(2, 3, 64)
    out = weight(x)
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    expected = cpu_woq.woq_linear_reference(x.reshape(6, 64).bfloat16(), weight).float().reshape(2, 3, 64)
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-3)
    assert cpu_woq.woq_linear(torch.empty(0, 64, dtype=torch.bfloat16), weight).shape == (0, 64)


@needs_amx
def test_kernel_refuses_mismatched_arguments() -> None:
    q, d, m = _codes(64, 64, 4)
    weight = cpu_woq.pack_woq(q, d, m, bits=4)
    with pytest.raises(RuntimeError, match="x has K = 96"):  # the op's own check, below the launcher
        torch.ops.structgen_cpu.woq_linear(
            torch.zeros(2, 96, dtype=torch.bfloat16),
            weight.qweight,
            weight.scales,
            weight.mins,
            4,
            torch.empty(2, 64, dtype=torch.bfloat16),
        )
    with pytest.raises(ValueError, match="out must be"):
        cpu_woq.woq_linear(torch.zeros(2, 64, dtype=torch.bfloat16), weight, out=torch.empty(3, 64))
    with pytest.raises(ValueError, match="int linear"):
        cpu_woq.woq_linear(torch.zeros(2, 48), weight)


def test_packing_refuses_what_the_kernel_cannot_take() -> None:
    q, d, m = _codes(64, 64, 4)
    with pytest.raises(ValueError, match="N % 32"):
        cpu_woq.pack_woq(q[:48], d[:48], m[:48], bits=4)  # type: ignore[index]
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        cpu_woq.pack_woq(q, d, m, bits=2)
    with pytest.raises(ValueError, match=r"values 0\.\.15"):
        cpu_woq.pack_woq(q * 2, d, m, bits=4)
    with pytest.raises(ValueError, match=r"must be torch\.int8"):
        cpu_woq.pack_woq(q, d, bits=8)
    with pytest.raises(ValueError, match="scales must be"):
        cpu_woq.pack_woq(q, d[:, :1], m, bits=4)
