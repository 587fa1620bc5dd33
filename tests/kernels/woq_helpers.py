"""Packed weights and activations shared by the GEMV tests (VNNI and AVX2)."""

from __future__ import annotations

import torch
from structgen.kernels import cpu_woq


def packed_weight(n: int, k: int, bits: int, *, seed: int = 0) -> cpu_woq.WoqWeight:
    """A random [n, k] weight packed for the kernels: Q4_1 codes 0..15 with a scale and a negative minimum per
    block, or Q8_0 codes with a scale."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
    if bits == 4:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        return cpu_woq.pack_woq(q, d, -torch.rand(n, k // 32, generator=gen) * 0.1, bits=4)
    return cpu_woq.pack_woq(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen), d, bits=8)


def activations(rows: int, k: int, *, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, :32] *= 50.0  # blocks of very different ranges: each gets its own scale
    if k > 64:
        x[:, 32:64] = 0.0  # an all-zero block (scale 0)
    return x.to(dtype)


def exact_product(x: torch.Tensor, weight: cpu_woq.WoqWeight) -> torch.Tensor:
    """x @ W^T in float64 on the packed weights' exact values."""
    return x.double() @ cpu_woq.dequantize(weight, dtype=torch.float32).double().t()
