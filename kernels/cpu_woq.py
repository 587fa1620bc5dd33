"""Launcher of the AMX weight-only quantized linear (`csrc/cpu_woq_linear.cpp`), its packing, and its reference.

`pack_woq` turns 4-bit codes with a scale and minimum per 32 weights along K (GGUF Q4_1: w = d q + m) or 8-bit
codes with a scale (Q8_0: w = d q) into the kernel's tile layout, scales in fp16 as the GGUF stores them;
`woq_linear` computes `x @ W^T` in bf16 from it. The kernel expands each weight to bf16 (fp32 `d q + m`, rounded
to nearest even), accumulates the products in fp32 and rounds the result to bf16: `woq_linear_reference` does
the same arithmetic in torch (its fp32 sums run in another order, so results agree to fp32 rounding, then bf16).
It needs AMX (`amx_available()`); elsewhere callers keep their other paths.

`woq_gemv` (`csrc/cpu_woq_gemv.cpp`) computes the same product for a few rows (a single stream's decode) from the
same packed weights with AVX512-VNNI integer dot products: x quantized to int16 per block of 32, the weights
exact (d q + m in fp32, not rounded to bf16), fp32 sums, a bf16 result. `woq_gemv_reference` is that arithmetic
in torch. It needs AVX512-VNNI (`gemv_available()`), not AMX: Ice Lake, Sapphire Rapids and Zen 4 have it.
For fp32 x (the model's dtype on CPUs without native bf16), `woq_gemv` runs the same arithmetic with AVX2's
VPMADDWD (`csrc/cpu_woq_gemv_avx2.cpp`, `avx2_gemv_available()`: Zen 1-3, Intel client cores), returning fp32;
`woq_gemv_avx2` calls that kernel for any dtype. `woq_q8_avx2` (`csrc/cpu_woq_q8_avx2.cpp`, 4-bit weights) quantizes
x to int8 instead, llama.cpp's arithmetic for Q4_1 on CPUs: VPMADDUBSW makes twice VPMADDWD's products an
instruction, at the cost of x's precision (greedy outputs no longer those of the exact product); fp32 models give
it the prompt chunks, where the int16 GEMV is no faster than oneDNN's fp32 product (`woq_q8_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from structgen.kernels import cpu_build
from structgen.kernels.cpu_ops import _kernel_message

GROUP = 32  # weights per block along K: one AMX row of bf16
STRIP = 32  # N must be a multiple of this (the kernel's strips are two 16-column tiles)
BITS = (4, 8)


def amx_available() -> bool:
    """Whether the kernel can run here: the native library loaded and the CPU (and OS) grant AMX bf16 tiles."""
    return cpu_build.load() and bool(torch.ops.structgen_cpu.amx_available())


def gemv_available() -> bool:
    """Whether the VNNI GEMV can run here: the native library loaded and the CPU has AVX512-VNNI."""
    return cpu_build.load() and bool(torch.ops.structgen_cpu.gemv_available())


def avx2_gemv_available() -> bool:
    """Whether the AVX2 GEMV can run here (AVX2, FMA and F16C): `woq_gemv`'s path for fp32 x."""
    return cpu_build.load() and bool(torch.ops.structgen_cpu.gemv_avx2_available())


def q8_avx2_available() -> bool:
    """Whether the int8-x AVX2 kernel can run here (the same CPU features as the AVX2 GEMV)."""
    return cpu_build.load() and bool(torch.ops.structgen_cpu.woq_q8_avx2_available())


@dataclass(slots=True)
class WoqWeight:
    """A packed W [N, K]: calling it computes `x @ W^T` for bf16 x (see the module note)."""

    qweight: torch.Tensor  # 4 bits: uint8 [N/16, K/32, 16, 16]; 8 bits: int8 [N/16, K/32, 16, 32]
    scales: torch.Tensor  # fp16 [N/16, K/32, 16]
    mins: torch.Tensor  # fp16 [N/16, K/32, 16] (4 bits); empty (8 bits)
    bits: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0] * 16

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return woq_linear(x, self)


@dataclass(slots=True, frozen=True)
class WoqGemv:
    """A packed weight as a layer kernel through the VNNI GEMV (`woq_gemv`), the fast one for a few rows."""

    weight: WoqWeight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return woq_gemv(x, self.weight)


@dataclass(slots=True, frozen=True)
class WoqQ8:
    """A packed 4-bit weight as a layer kernel through the int8-x AVX2 kernel (`woq_q8_avx2`): prompt chunks."""

    weight: WoqWeight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return woq_q8_avx2(x, self.weight)


def check_shape(n: int, k: int) -> str | None:
    """Why a [N, K] weight cannot be packed, or None."""
    if n % STRIP or k % GROUP:
        return f"the AMX int linear needs N % {STRIP} == 0 and K % {GROUP} == 0, got [{n}, {k}]"
    return None


def pack_woq(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None, *, bits: int
) -> WoqWeight:
    """Codes q [N, K] (4 bits: uint8 0..15, w = d q + m; 8 bits: int8, w = d q) with d and m [N, K / 32]."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if q.dim() != 2:
        raise ValueError(f"codes must be 2-D [N, K], got {list(q.shape)}")
    n, k = q.shape
    if (reason := check_shape(n, k)) is not None:
        raise ValueError(reason)
    want = torch.uint8 if bits == 4 else torch.int8
    if q.dtype != want:
        raise ValueError(f"{bits}-bit codes must be {want}, got {q.dtype}")
    if bits == 4 and (mins is None or int(q.max()) > 15):
        raise ValueError("4-bit codes need values 0..15 and a minimum per block")
    nb, kb = n // 16, k // GROUP
    # lane l of tile row r is W[16 nb + l // 2][32 kb + 2 r + l % 2]
    lanes = q.reshape(nb, 16, kb, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, kb, 16, 32)
    # 4 bits: byte b of a row is lane b (low nibble) and lane b + 16 (high)
    packed = (lanes[..., :16] | (lanes[..., 16:] << 4)) if bits == 4 else lanes
    packed = packed.contiguous()

    def per_tile(t: torch.Tensor, name: str) -> torch.Tensor:
        if tuple(t.shape) != (n, kb):
            raise ValueError(f"{name} must be [{n}, {kb}], got {list(t.shape)}")
        return t.reshape(nb, 16, kb).permute(0, 2, 1).to(torch.float16).contiguous()

    d = per_tile(scales, "scales")
    m = per_tile(mins, "mins") if bits == 4 else torch.empty(0, dtype=torch.float16)  # type: ignore[arg-type]
    return WoqWeight(packed, d, m, bits)


def woq_linear(x: torch.Tensor, weight: WoqWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T` for a contiguous bf16 x [M, K] through the AMX kernel (other shapes and dtypes are reshaped
    and cast)."""
    return _launch("woq_linear", x, weight, out)


def woq_gemv(x: torch.Tensor, weight: WoqWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T` for a few rows of a contiguous x [M, K]: fp32 x through the AVX2 kernel, other dtypes as bf16
    through the VNNI one (shapes reshaped, dtypes cast). Any M works; the kernels are the fast ones for decode
    batches. The choice is by dtype alone (no availability check a call: this is every layer's hot path), as
    `attach_int4` gives the GEMV to fp32 layers only with AVX2 and to bf16 ones only with VNNI."""
    if x.dtype == torch.float32:
        return woq_gemv_avx2(x, weight, out=out)
    return _launch("woq_gemv", x, weight, out)


def woq_q8_avx2(x: torch.Tensor, weight: WoqWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T` for 4-bit weights through the int8-x AVX2 kernel, any number of rows: fp32 x in fp32, other
    dtypes as bf16."""
    if weight.bits != 4:
        raise ValueError(f"the int8-x AVX2 kernel takes 4-bit weights only, got {weight.bits} bits")
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    return _launch("woq_q8_avx2", x, weight, out, dtype=dtype)


def woq_gemv_avx2(x: torch.Tensor, weight: WoqWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`woq_gemv` through the AVX2 kernel whatever the CPU's other kernels: fp32 x in fp32, other dtypes as
    bf16."""
    dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    return _launch("woq_gemv_avx2", x, weight, out, dtype=dtype)


def _launch(
    name: str,
    x: torch.Tensor,
    weight: WoqWeight,
    out: torch.Tensor | None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Calls the op on x as `dtype` (default bf16), out of the same dtype."""
    dtype = dtype or torch.bfloat16
    if x.dtype != dtype or x.dim() != 2 or not x.is_contiguous():
        if x.shape[-1:] != (weight.in_features,):
            raise ValueError(f"int linear [{weight.out_features}, {weight.in_features}] got {list(x.shape)}")
        y = _launch(name, x.reshape(-1, weight.in_features).to(dtype).contiguous(), weight, None, dtype=dtype)
        return y.view(*x.shape[:-1], weight.out_features).to(x.dtype)
    if out is None:
        out = torch.empty((x.shape[0], weight.out_features), dtype=dtype)
    try:
        getattr(torch.ops.structgen_cpu, name)(
            x, weight.qweight, weight.scales, weight.mins, weight.bits, out
        )
    except RuntimeError as exc:
        raise ValueError(_kernel_message(exc)) from None
    return out


def dequantize(weight: WoqWeight, *, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K], each weight as the AMX kernel expands it (bf16), or in fp32 as the GEMV uses it."""
    nb, kb = weight.qweight.shape[:2]
    if weight.bits == 4:
        codes = torch.cat([weight.qweight & 0x0F, weight.qweight >> 4], dim=-1).float()
    else:
        codes = weight.qweight.float()
    # [nb, kb, r, lane]: lane // 2 is the column within the tile
    d = weight.scales.float().repeat_interleave(2, dim=-1)[:, :, None, :]
    w = codes * d
    if weight.bits == 4:
        w = w + weight.mins.float().repeat_interleave(2, dim=-1)[:, :, None, :]
    w = w.to(dtype).reshape(nb, kb, 16, 16, 2).permute(0, 3, 1, 2, 4)
    return w.reshape(nb * 16, kb * GROUP)


def woq_linear_reference(x: torch.Tensor, weight: WoqWeight) -> torch.Tensor:
    """What the kernel computes: bf16 weights, fp32 sums, bf16 result."""
    return (x.float() @ dequantize(weight).float().t()).to(torch.bfloat16)


def quantize_activations(x: torch.Tensor, *, levels: int = 32767) -> torch.Tensor:
    """x [M, K] as the GEMVs see it: per block of 32, integer codes of scale max|x| / `levels` (int16's 32767 for
    the VNNI and AVX2 GEMVs, int8's 127 for the int8-x kernel), back in fp32."""
    blocks = x.float().reshape(x.shape[0], -1, GROUP)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # a true division, as the kernels' scalar one: `levels / amax` is torch's reciprocal-then-multiply, which can
    # move a product that should land just below a half step (63.499996) onto it (63.5), then round it away
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / levels)).reshape(x.shape)


def woq_gemv_reference(x: torch.Tensor, weight: WoqWeight, *, levels: int = 32767) -> torch.Tensor:
    """What the GEMVs compute: int16-quantized x (the Q4_1 minimum times the exact sum of x), fp32 weights and
    sums, the result in x's dtype for fp32 x, else bf16. `levels=127`: the int8-x kernel's x."""
    result = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
    w = dequantize(weight, dtype=torch.float32)
    codes_part = w
    if weight.bits == 4:  # d q times the quantized x; m times the exact x
        nb, kb = weight.qweight.shape[:2]
        mins = weight.mins.float().permute(0, 2, 1).reshape(nb * 16, kb).repeat_interleave(GROUP, dim=1)
        codes_part = w - mins
        quantized = quantize_activations(x, levels=levels)
        return (quantized @ codes_part.t() + x.float() @ mins.t()).to(result)
    return (quantize_activations(x, levels=levels) @ codes_part.t()).to(result)


def woq_q8_reference(x: torch.Tensor, weight: WoqWeight) -> torch.Tensor:
    """What the int8-x kernel (`woq_q8_avx2`) computes: the GEMVs' arithmetic with x in int8 steps."""
    return woq_gemv_reference(x, weight, levels=127)
