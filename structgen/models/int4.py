"""Weight-only int4 linear layers on CPU, through torch's `_weight_int4pack_mm_for_cpu`.

Single-stream decode is bound by reading the weights, and this kernel reads 4-bit weights (plus one bf16 scale
and zero per group of K) where bf16 `F.linear` reads 16 bits: on one AVX-512 thread, SmolLM2's projections run
about 2x faster at batch 1, and only 1.0-1.3x at batch 4, where the weight reads are shared by more rows.

The kernel's format, read from torch's CPU kernel (aten/src/ATen/native/cpu/int4mm_kernel.cpp) and checked by
tests/models/test_int4.py: for a weight W [N, K], values q[n, k] in 0..15 and, per group of `group_size`
consecutive k, a bf16 pair `scales_and_zeros[k // group_size, n] = (scale, zero)`, the kernel uses

    W[n, k] = (q[n, k] - 8) * scale + zero        (scale and zero widened to fp32; one fp32 FMA on AVX-512)

and accumulates `x @ W^T` in fp32, rounding the result to the activation dtype. `scales_and_zeros` must have
the activations' dtype; bf16 is the only fast one (fp32 falls back to a scalar loop, ~16x slower), so
activations are cast to bf16 and the result back. Alignment the op requires: N % 16 == 0 (its row blocks are
16..64 wide), K % group_size == 0, group_size in {32, 64, 128, 256}; `inner_k_tiles` is ignored on CPU.

GGUF's Q4_1 (w = d * q + m per block of 32) maps onto it exactly as scale = d, zero = m + 8 d, group 32; only
rounding d and m + 8 d to bf16 (8 significant bits, so within 2^-8 relative) changes the weights, by at most
2^-8 (8 |d| + |m + 8 d|) each.

Weights go through `Int4Values` (unpacked q, fp32 scales and zeros) before packing: torch's packed layout
depends on the CPU's vector width, so rows are permuted (llama q/k) and fused (qkv, gate_up) while unpacked,
then packed once.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from structgen.errors import ModelLoadError
from structgen.models.gguf import (
    _PERMUTED_ARCHITECTURES,
    _SKIPPED_TENSORS,
    gguf_metadata,
    hf_tensor_name,
    read_gguf,
    unpermute_rows,
)
from structgen.models.linear import ParallelLMHead, kernel_layers
from structgen.models.llama import _STACKED_PARAMS  # listed in each fused layer's row order

GROUP_SIZES = (32, 64, 128, 256)  # the group sizes the CPU kernel is compiled for
ROW_ALIGNMENT = 16  # N must be a multiple of this (the kernel's narrowest row block)
_Q4_BLOCK = 32  # weights per GGUF Q4_0 / Q4_1 block
_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q4_0_BLOCK_BYTES = 18  # fp16 d, 16 bytes of nibbles
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


@dataclass(slots=True)
class Int4Weight:
    """A packed int4 weight W [N, K]: calling it computes `x @ W^T` (no bias) in x's dtype."""

    packed: torch.Tensor  # uint8 [N, K / 2] in torch's CPU layout (`_convert_weight_to_int4pack_for_cpu`)
    scales_and_zeros: torch.Tensor  # bf16 [K / group_size, N, 2]
    group_size: int
    out_features: int = field(init=False)  # N
    in_features: int = field(init=False)  # K

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(
                f"packed int4 weight must be 2-D uint8, got {self.packed.dtype} {list(self.packed.shape)}"
            )
        self.out_features, self.in_features = self.packed.shape[0], self.packed.shape[1] * 2
        _check_alignment(self.out_features, self.in_features, self.group_size)
        expected = (self.in_features // self.group_size, self.out_features, 2)
        # The op checks only dims 1 and 2; a short dim 0 would make it read past the tensor.
        if self.scales_and_zeros.dtype != torch.bfloat16 or tuple(self.scales_and_zeros.shape) != expected:
            raise ValueError(
                f"scales_and_zeros must be bfloat16 {list(expected)}, got "
                f"{self.scales_and_zeros.dtype} {list(self.scales_and_zeros.shape)}"
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.shape[1] == self.in_features
            and x.is_contiguous()
        ):
            # Decode's case, straight to the op: at batch 1 the reshapes and casts below cost ~half the matmul.
            return _INT4_MM(x, self.packed, self.group_size, self.scales_and_zeros)
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(
                f"int4 linear [{self.out_features}, {self.in_features}] got input of shape {list(x.shape)}"
            )
        if not x.is_floating_point() or x.device.type != "cpu":
            raise ValueError(f"int4 linear needs floating-point CPU input, got {x.dtype} on {x.device}")
        x2d = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # the op wants 2-D contiguous
        y = _INT4_MM(x2d, self.packed, self.group_size, self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


@dataclass(slots=True)
class Int4Values:
    """An unpacked int4 weight: W[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g], g = k // group_size.

    Scales and zeros stay fp32 here; `pack` rounds them to bf16, which is what the kernel reads.
    """

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scales: torch.Tensor  # fp32 [N, K / group_size]
    zeros: torch.Tensor  # fp32 [N, K / group_size]
    group_size: int

    def __post_init__(self) -> None:
        if self.q.dtype != torch.uint8 or self.q.dim() != 2:
            raise ValueError(
                f"int4 values must be a 2-D uint8 tensor, got {self.q.dtype} {list(self.q.shape)}"
            )
        n, k = self.q.shape
        if self.group_size not in GROUP_SIZES or k % self.group_size:
            raise ValueError(
                f"K ({k}) must be a multiple of group_size ({self.group_size}), one of {GROUP_SIZES}"
            )
        expected = (n, k // self.group_size)
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t.dtype != torch.float32 or tuple(t.shape) != expected:
                raise ValueError(f"{name} must be float32 {list(expected)}, got {t.dtype} {list(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: the weight as the kernel sees it (bf16 scales and zeros; its FMA may differ in the
        last fp32 bit)."""
        scales = self.scales.bfloat16().float().repeat_interleave(self.group_size, dim=1)
        zeros = self.zeros.bfloat16().float().repeat_interleave(self.group_size, dim=1)
        return (self.q.float() - 8) * scales + zeros

    def unpermute_rows(self, num_heads: int) -> Int4Values:
        """Undo llama.cpp's q/k row permutation, as `structgen.models.gguf.unpermute_rows` does for floats."""
        return Int4Values(
            unpermute_rows(self.q, num_heads),
            unpermute_rows(self.scales, num_heads),
            unpermute_rows(self.zeros, num_heads),
            self.group_size,
        )

    def pack(self) -> Int4Weight:
        n, k = self.shape
        _check_alignment(n, k, self.group_size)
        # `inner_k_tiles` only matters for the CUDA layout; the CPU op ignores it.
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32), 1)
        scales_and_zeros = torch.stack([self.scales.t(), self.zeros.t()], dim=-1).to(torch.bfloat16)
        return Int4Weight(packed, scales_and_zeros.contiguous(), self.group_size)


def _check_alignment(n: int, k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"int4 weight's K ({k}) is not a multiple of its group_size ({group_size})")
    if n % ROW_ALIGNMENT:
        raise ValueError(
            f"int4 weight's N ({n}) is not a multiple of {ROW_ALIGNMENT}, as torch's CPU op needs"
        )


def concat_int4(parts: Sequence[Int4Values]) -> Int4Values:
    """Stack weights along N (fused q/k/v, gate/up): same K and group size required."""
    if not parts:
        raise ValueError("concat_int4 needs at least one weight")
    first = parts[0]
    for part in parts[1:]:
        if part.shape[1] != first.shape[1] or part.group_size != first.group_size:
            raise ValueError(
                f"cannot fuse int4 weights of K/group {first.shape[1]}/{first.group_size} and "
                f"{part.shape[1]}/{part.group_size}"
            )
    return Int4Values(
        torch.cat([p.q for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.group_size,
    )


def quantize_int4(weight: torch.Tensor, *, group_size: int = 32) -> Int4Values:
    """Asymmetric min/max int4 per group of K (like Q4_1), for float checkpoints.

    q is chosen against the bf16-rounded scale and zero the kernel will read, so the round trip error is at
    most half a step plus the bf16 rounding of the group's range ends.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int4 needs a 2-D float weight, got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"K ({k}) must be a multiple of group_size ({group_size}), one of {GROUP_SIZES}")
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / 15
    zeros = low + 8 * scales
    scale_bf, zero_bf = scales.bfloat16().float(), zeros.bfloat16().float()
    inverse = torch.where(scale_bf > 0, 1 / scale_bf, torch.zeros_like(scale_bf))  # constant groups: q = 8
    q = torch.round((groups - zero_bf[..., None]) * inverse[..., None]) + 8
    return Int4Values(q.clamp_(0, 15).to(torch.uint8).reshape(n, k), scales, zeros, group_size)


def gguf_blocks(raw: np.ndarray, shape: tuple[int, int], block_bytes: int, *, kind: str) -> torch.Tensor:
    """A GGUF tensor's data of 32-weight blocks (`kind` names the format in errors) as uint8
    [N, K / 32, block_bytes]."""
    n, k = shape
    if k % _Q4_BLOCK:
        raise ValueError(f"a GGUF {kind} tensor's row length must be a multiple of {_Q4_BLOCK}, got {k}")
    expected = n * (k // _Q4_BLOCK) * block_bytes
    if raw.dtype != np.uint8 or raw.size != expected:
        raise ValueError(
            f"GGUF {kind} data for [{n}, {k}] must be {expected} uint8 bytes, got {raw.size} {raw.dtype}"
        )
    # A copy: GGUF data is a read-only memory map, which torch will not wrap.
    return torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, k // _Q4_BLOCK, block_bytes))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # A block's byte j holds element j in its low nibble and element j + 16 in its high one.
    n, blocks, _ = qs.shape
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, blocks * _Q4_BLOCK)


def fp16_field(block_bytes: torch.Tensor) -> torch.Tensor:
    return block_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def int4_from_q4_1(
    raw: np.ndarray, shape: tuple[int, int], *, unpermute_heads: int | None = None
) -> Int4Values:
    """GGUF Q4_1 block data of a [N, K] weight (N rows of K / 32 blocks) as int4 values, rows un-permuted
    over `unpermute_heads` heads when given (llama q/k). Exact up to the bf16 rounding done by `pack`."""
    blocks = gguf_blocks(raw, shape, _Q4_1_BLOCK_BYTES, kind="Q4")
    d, m = fp16_field(blocks[..., 0:2]), fp16_field(blocks[..., 2:4])
    # d * q + m == (q - 8) * d + (m + 8 d)
    values = Int4Values(_nibbles(blocks[..., 4:]), d, m + 8 * d, _Q4_BLOCK)
    return values if unpermute_heads is None else values.unpermute_rows(unpermute_heads)


def int4_from_q4_0(
    raw: np.ndarray, shape: tuple[int, int], *, unpermute_heads: int | None = None
) -> Int4Values:
    """GGUF Q4_0 (w = d * (q - 8)) as int4 values: scale d, zero 0."""
    blocks = gguf_blocks(raw, shape, _Q4_0_BLOCK_BYTES, kind="Q4")
    d = fp16_field(blocks[..., 0:2])
    values = Int4Values(_nibbles(blocks[..., 2:]), d, torch.zeros_like(d), _Q4_BLOCK)
    return values if unpermute_heads is None else values.unpermute_rows(unpermute_heads)


def load_gguf_int4_weights(gguf_path: str | Path, config: Mapping[str, Any] | Any) -> dict[str, Int4Values]:
    """Every 2-D Q4_1 / Q4_0 tensor of a GGUF as int4 values under its HF parameter name, llama q/k rows
    un-permuted as the converter does. `config` is the HF config dict or a `ModelConfig` (for the head
    counts). Other tensor types are skipped. The values are unpacked (1 byte per weight plus fp32 scales):
    drop them once `attach_int4_kernels` has packed what it uses."""
    from gguf import GGMLQuantizationType

    decoders = {GGMLQuantizationType.Q4_1: int4_from_q4_1, GGMLQuantizationType.Q4_0: int4_from_q4_0}
    reader = read_gguf(gguf_path)
    permute = gguf_metadata(reader).get("general.architecture") in _PERMUTED_ARCHITECTURES
    heads = {".q_proj.": _config_value(config, "num_attention_heads")}
    heads[".k_proj."] = _config_value(config, "num_key_value_heads")
    weights: dict[str, Int4Values] = {}
    for tensor, name, shape in gguf_block_tensors(reader, decoders):
        part = next((p for p in heads if p in name), None) if permute else None
        try:
            weights[name] = decoders[tensor.tensor_type](
                np.asarray(tensor.data), shape, unpermute_heads=heads[part] if part else None
            )
        except ValueError as exc:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    return weights


def gguf_block_tensors(reader: Any, types: Container[Any]) -> Iterator[tuple[Any, str, tuple[int, int]]]:
    """(tensor, HF name, [N, K]) of each 2-D tensor of one of `types` (GGML quantization types) in a GGUF
    reader, less those the converter skips."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in types or len(tensor.shape) != 2 or _SKIPPED_TENSORS.match(tensor.name):
            continue
        k, n = (int(dim) for dim in tensor.shape.tolist())  # GGUF lists dims innermost first
        yield tensor, hf_tensor_name(tensor.name), (n, k)


def _config_value(config: Mapping[str, Any] | Any, key: str) -> int:
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    if value is None:
        raise ModelLoadError(f"config lacks {key!r}, needed to un-permute llama q/k rows")
    return int(value)


def layer_sources(
    model: nn.Module, module_name: str, module: nn.Module, available: Container[str]
) -> list[str]:
    """HF weight names that make up a layer's weight, in the fused layer's row order; for a tied lm_head whose
    own weight `available` lacks, the embedding (a tied head multiplies by the embedding matrix)."""
    param = f"{module_name}.weight"
    parts = [param.replace(fused, hf) for fused, hf, _ in _STACKED_PARAMS if fused in param] or [param]
    tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if isinstance(module, ParallelLMHead) and tie and parts[0] not in available:
        return ["model.embed_tokens.weight"]
    return parts


def attach_int4_kernels(
    model: nn.Module, weights: Mapping[str, Int4Values], *, skip: Container[str] = ()
) -> list[str]:
    """Set `kernel` to a packed `Int4Weight` on every linear layer (and the lm_head) whose weight `weights`
    covers entirely, except the layers named in `skip`; returns the names of those layers. Layers whose (fused) N is not a multiple of 16, which
    the kernel cannot take (odd vocab sizes), keep `F.linear`. The float weights are left in place."""
    attached: list[str] = []
    for module_name, module in kernel_layers(model):
        if module.tp_size != 1:
            raise ModelLoadError(
                f"int4 kernels support tensor_parallel_size 1 only; {module_name} is split "
                f"{module.tp_size} ways"
            )
        names = layer_sources(model, module_name, module, weights)
        if module_name in skip or not all(name in weights for name in names):
            continue
        values = concat_int4([weights[name] for name in names])
        if values.shape[0] % ROW_ALIGNMENT:
            continue
        if values.shape != tuple(module.weight.shape):
            raise ModelLoadError(
                f"int4 weight for {module_name} has shape {list(values.shape)}, the layer "
                f"{list(module.weight.shape)}"
            )
        module.kernel = values.pack()
        attached.append(module_name)
    return attached
