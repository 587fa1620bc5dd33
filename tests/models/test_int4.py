"""Weight-only int4 linear: torch's kernel format, GGUF Q4_1/Q4_0 mapping, quantization, fusion, attaching.

Tolerances: bf16 keeps 8 significant bits (7 stored), so one rounding to nearest is within 2^-8 relative.
Mapping Q4_1 (w = d q + m) onto the kernel's (q - 8) * scale + zero rounds scale = d and zero = m + 8 d to bf16
once each, so a weight moves by at most 2^-8 (8 |d| + |m + 8 d|); the kernel's bf16 output adds 2^-8 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_fixtures import random_hf_model, write_model_gguf
from paged_harness import load_structgen

from structgen.errors import ModelLoadError
from structgen.models.gguf import convert_gguf_to_hf, read_gguf, unpermute_rows
from structgen.models.int4 import (
    Int4Values,
    Int4Weight,
    attach_int4_kernels,
    concat_int4,
    int4_from_q4_0,
    int4_from_q4_1,
    load_gguf_int4_weights,
    quantize_int4,
)
from structgen.models.linear import RowParallelLinear
from structgen.models.registry import smollm2_gguf_path

Q = GGMLQuantizationType
BF16_UNIT = 2.0**-8  # unit roundoff of bf16 (relative error of one rounding to nearest)


def _random_values(n: int, k: int, *, group_size: int = 32, seed: int = 0) -> Int4Values:
    generator = torch.Generator().manual_seed(seed)
    groups = k // group_size
    return Int4Values(
        torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator),
        torch.rand(n, groups, generator=generator) * 0.1 + 0.01,
        torch.randn(n, groups, generator=generator) * 0.2,
        group_size,
    )


def _q4_raw(weight: np.ndarray, qtype: Any) -> np.ndarray:
    return quantize(weight.astype(np.float32), qtype)


def _q4_1_bound(values: Int4Values) -> torch.Tensor:
    d, zero = (t.abs().repeat_interleave(values.group_size, dim=1) for t in (values.scales, values.zeros))
    return BF16_UNIT * (8 * d + zero) + 1e-7


# --- the kernel's format ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_kernel_dequantizes_as_q_minus_8_times_scale_plus_zero(group_size: int) -> None:
    values = _random_values(48, 256, group_size=group_size)
    weight = values.pack()
    expected = values.dequantize()  # (q - 8) * bf16(scale) + bf16(zero), in fp32
    # One-hot rows read the weight back column by column, rounded once to the bf16 output.
    read_back = weight(torch.eye(256, dtype=torch.bfloat16)).t().float()
    torch.testing.assert_close(read_back, expected.bfloat16().float(), rtol=2 * BF16_UNIT, atol=1e-6)
    naive = (values.q.float() * values.scales.repeat_interleave(group_size, 1)).bfloat16().float()
    assert (read_back - naive).abs().max() > 0.1  # not q * scale + zero: the -8 offset is real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmul_matches_x_times_dequantized_weight(dtype: torch.dtype) -> None:
    values = _random_values(96, 192, seed=1)
    weight = values.pack()
    x = torch.randn(2, 3, 192).to(dtype)
    y = weight(x)
    assert y.dtype == dtype and y.shape == (2, 3, 96)
    expected = x.bfloat16().float() @ values.dequantize().t()  # activations go through bf16
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=4 * BF16_UNIT * expected.abs().max().item())


# --- GGUF Q4_1 / Q4_0 -----------------------------------------------------------------------------------------


def test_q4_1_nibble_order_and_block_layout() -> None:
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.array([2.0], dtype=np.float16).view(np.uint8)  # d
    block[2:4] = np.array([-1.0], dtype=np.float16).view(np.uint8)  # m
    block[4:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    values = int4_from_q4_1(np.tile(block, 16), (16, 32))
    assert values.q[0].tolist() == list(range(16)) + list(range(15, -1, -1))
    assert values.scales[0, 0] == 2.0 and values.zeros[0, 0] == -1.0 + 16.0
    expected = dequantize(np.tile(block, 16), Q.Q4_1).reshape(16, 32)
    assert torch.equal(values.dequantize(), torch.from_numpy(expected))  # these d, m are exact in bf16


def test_q4_1_matches_gguf_dequantize_up_to_bf16_scales() -> None:
    rng = np.random.default_rng(0)
    raw = _q4_raw(rng.normal(0.3, 1.0, (64, 256)), Q.Q4_1)
    reference = torch.from_numpy(dequantize(raw, Q.Q4_1).reshape(64, 256))
    values = int4_from_q4_1(raw, (64, 256))
    # In fp32 the mapping is exact (up to fp32 rounding of m + 8 d).
    fp32 = (values.q.float() - 8) * values.scales.repeat_interleave(32, 1) + values.zeros.repeat_interleave(
        32, 1
    )
    torch.testing.assert_close(fp32, reference, rtol=0, atol=1e-6)
    assert ((values.dequantize() - reference).abs() <= _q4_1_bound(values)).all()


def test_q4_0_maps_with_zero_offset() -> None:
    rng = np.random.default_rng(1)
    raw = _q4_raw(rng.normal(0, 1.0, (32, 128)), Q.Q4_0)
    reference = torch.from_numpy(dequantize(raw, Q.Q4_0).reshape(32, 128))
    values = int4_from_q4_0(raw, (32, 128))
    assert not values.zeros.any()
    d = values.scales.abs().repeat_interleave(32, 1)
    assert ((values.dequantize() - reference).abs() <= 8 * BF16_UNIT * d + 1e-7).all()


def test_unpermuted_q4_1_equals_dequantize_then_unpermute() -> None:
    rng = np.random.default_rng(2)
    raw = _q4_raw(rng.normal(0, 1.0, (96, 64)), Q.Q4_1)
    reference = unpermute_rows(torch.from_numpy(dequantize(raw, Q.Q4_1).reshape(96, 64)), 3)
    values = int4_from_q4_1(raw, (96, 64), unpermute_heads=3)
    assert ((values.dequantize() - reference).abs() <= _q4_1_bound(values)).all()
    plain = int4_from_q4_1(raw, (96, 64))
    assert torch.equal(values.q, unpermute_rows(plain.q, 3))


def test_smollm2_first_layer() -> None:
    reader = read_gguf(smollm2_gguf_path())
    heads = {"blk.0.attn_q.weight": 9, "blk.0.attn_k.weight": 3}
    tensors = [t for t in reader.tensors if t.name.startswith("blk.0.") and t.tensor_type == Q.Q4_1]
    assert len(tensors) == 7
    for tensor in tensors:
        k, n = (int(dim) for dim in tensor.shape.tolist())
        reference = torch.from_numpy(dequantize(tensor.data, Q.Q4_1).reshape(n, k))
        if tensor.name in heads:
            reference = unpermute_rows(reference, heads[tensor.name])
        values = int4_from_q4_1(np.asarray(tensor.data), (n, k), unpermute_heads=heads.get(tensor.name))
        assert ((values.dequantize() - reference).abs() <= _q4_1_bound(values)).all(), tensor.name
        x = torch.randn(1, k).bfloat16()
        expected = x.float() @ reference.t()
        got = values.pack()(x).float()
        assert (got - expected).abs().max() <= 0.01 * expected.abs().max(), tensor.name


# --- quantize_int4 / concat -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "group_size"), [(torch.float32, 32), (torch.bfloat16, 64)])
def test_quantize_int4_round_trip_is_within_half_a_step(dtype: torch.dtype, group_size: int) -> None:
    weight = (torch.randn(32, 256) * 0.05 + 0.02).to(dtype)
    weight[3, :group_size] = 0.25  # a constant group: scale 0
    values = quantize_int4(weight, group_size=group_size)
    scales, zeros = (t.repeat_interleave(group_size, 1) for t in (values.scales, values.zeros))
    bound = 0.5 * scales.bfloat16().float() + BF16_UNIT * (zeros.abs() + 8 * scales) + 1e-7
    assert ((values.dequantize() - weight.float()).abs() <= bound).all()
    assert torch.equal(values.dequantize()[3, :group_size], torch.full((group_size,), 0.25))


def test_concat_stacks_rows() -> None:
    parts = [_random_values(n, 64, seed=n) for n in (64, 32, 16)]
    fused = concat_int4(parts)
    assert fused.shape == (112, 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(fused.pack()(x), torch.cat([p.pack()(x) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="cannot fuse"):
        concat_int4([parts[0], _random_values(16, 128)])


# --- errors ---------------------------------------------------------------------------------------------------


def test_clear_errors_for_bad_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_int4(torch.randn(16, 48))
    with pytest.raises(ValueError, match="one of"):
        quantize_int4(torch.randn(16, 64), group_size=16)
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int4(torch.ones(16, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of group_size"):
        _random_values(16, 48, group_size=32)  # scales for 1 group; K 48 is not whole groups
    with pytest.raises(ValueError, match="multiple of 16"):
        _random_values(24, 64).pack()
    values = _random_values(16, 64)
    with pytest.raises(ValueError, match="scales must be float32"):
        Int4Values(values.q, values.scales.double(), values.zeros, 32)
    weight = values.pack()
    with pytest.raises(ValueError, match="got input of shape"):
        weight(torch.randn(2, 32))
    with pytest.raises(ValueError, match="floating-point"):
        weight(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="scales_and_zeros must be bfloat16"):
        Int4Weight(weight.packed, weight.scales_and_zeros.float(), 32)
    with pytest.raises(ValueError, match="scales_and_zeros must be bfloat16"):
        Int4Weight(weight.packed, weight.scales_and_zeros[:1], 32)
    with pytest.raises(ValueError, match="must be 640 uint8 bytes"):
        int4_from_q4_1(np.zeros(700, dtype=np.uint8), (16, 64))
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 1"):
        attach_int4_kernels(torch.nn.Sequential(RowParallelLinear(64, 32, tp_size=2)), {})


# --- GGUF file -> kernels on a model --------------------------------------------------------------------------


def _q4_qtype(embedding: Any) -> Any:
    def qtype(hf_name: str, array: np.ndarray) -> Any:
        if "embed_tokens" in hf_name:
            return embedding
        return Q.Q4_0 if "down_proj" in hf_name else Q.Q4_1

    return qtype


@pytest.mark.parametrize(
    ("tie", "embedding", "head"),
    [
        (False, Q.Q8_0, True),  # lm_head.weight is its own Q4_1 tensor
        (True, Q.Q8_0, False),  # SmolLM2's case: the tied head is Q8_0, so it keeps F.linear
        (True, Q.Q4_1, True),  # the tied head multiplies by the int4 embedding
    ],
)
def test_gguf_weights_attach_to_the_fused_layers(
    tmp_path: Path, vocab: Any, tie: bool, embedding: Any, head: bool
) -> None:
    hf_model = random_hf_model("llama", tie_word_embeddings=tie)
    gguf_path = write_model_gguf(tmp_path / "llama.gguf", hf_model, vocab, qtype=_q4_qtype(embedding))
    model = load_structgen(convert_gguf_to_hf(gguf_path, tmp_path / "hf"))  # gguf's fp32 dequantization
    weights = load_gguf_int4_weights(gguf_path, model.config)
    attached = attach_int4_kernels(model, weights)

    per_layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    expected = [f"model.layers.{i}.{name}" for i in range(2) for name in per_layer]
    assert attached == [*expected, *(["lm_head"] if head else [])]
    modules = dict(model.named_modules())
    for name in attached:
        layer = modules[name]
        # The kernel's weight, read back through one-hot rows, is the converter's within the bf16 bound; a
        # wrong fusion order or a missed un-permutation would be off by whole weights.
        read_back = layer.kernel(torch.eye(layer.weight.shape[1])).t()
        bound = 2 * BF16_UNIT * layer.weight.abs().max().item()
        torch.testing.assert_close(read_back, layer.weight.data, rtol=2 * BF16_UNIT, atol=bound, msg=name)
