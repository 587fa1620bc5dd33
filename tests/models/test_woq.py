"""AMX kernels from a GGUF's blocks: Q8_0 decoding, Q4_1 values in the kernel's form, attaching them to a model's
fused layers, and the per-batch choice between torch's int4, the AMX kernel and bf16."""

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
from structgen.kernels import cpu_woq

from structgen.models.cpu_linear import QuantizedSmallBatches
from structgen.models.gguf import convert_gguf_to_hf
from structgen.models.int4 import Int4Values, load_gguf_int4_weights
from structgen.models.woq import build_woq_kernels, load_gguf_q8_0_weights, q8_0_codes, woq_from_int4

Q = GGMLQuantizationType


def test_q8_0_blocks_decode_to_what_gguf_dequantizes() -> None:
    weight = np.random.default_rng(0).normal(size=(48, 96)).astype(np.float32)
    raw = quantize(weight, Q.Q8_0)
    codes, d = q8_0_codes(raw, (48, 96))
    assert codes.dtype == torch.int8 and d.shape == (48, 3)
    decoded = codes.float() * d.repeat_interleave(32, dim=1)
    np.testing.assert_array_equal(decoded.numpy(), dequantize(raw, Q.Q8_0).reshape(48, 96))
    with pytest.raises(ValueError, match="must be 4896 uint8 bytes"):
        q8_0_codes(raw.reshape(-1)[:100], (48, 96))


def test_int4_values_become_the_same_weights_in_the_kernels_form() -> None:
    gen = torch.Generator().manual_seed(0)
    values = Int4Values(
        torch.randint(0, 16, (64, 64), dtype=torch.uint8, generator=gen),
        (torch.rand(64, 2, generator=gen) * 0.05).half().float(),  # fp16-exact, as a GGUF's d
        torch.randn(64, 2, generator=gen) * 0.1,
        32,
    )
    exact = (values.q.float() - 8) * values.scales.repeat_interleave(32, 1) + values.zeros.repeat_interleave(
        32, 1
    )
    torch.testing.assert_close(
        cpu_woq.dequantize(woq_from_int4(values)).float(), exact, rtol=2**-7, atol=1e-3
    )


def _qtype(hf_name: str, array: np.ndarray) -> Any:
    return Q.Q8_0 if "embed_tokens" in hf_name else Q.Q4_1


def test_gguf_blocks_attach_to_the_fused_layers(tmp_path: Path, vocab: Any) -> None:
    if not cpu_woq.amx_available():
        pytest.skip("the CPU has no AMX bf16 tiles: build_woq_kernels returns {} (checked below)")
    hf_model = random_hf_model("llama", tie_word_embeddings=True)
    gguf_path = write_model_gguf(tmp_path / "llama.gguf", hf_model, vocab, qtype=_qtype)
    model = load_structgen(convert_gguf_to_hf(gguf_path, tmp_path / "hf"))  # gguf's fp32 dequantization
    q8 = load_gguf_q8_0_weights(gguf_path)
    assert set(q8) == {"model.embed_tokens.weight"}
    kernels = build_woq_kernels(model, load_gguf_int4_weights(gguf_path, model.config), q8)
    per_layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    # the tied head's 400 rows are not a multiple of 32: it keeps its other kernels
    assert sorted(kernels) == sorted(f"model.layers.{i}.{name}" for i in range(2) for name in per_layer)
    modules = dict(model.named_modules())
    for name, kernel in kernels.items():
        # read back through one-hot rows: the converter's weights in bf16 (a wrong fusion order or a missed
        # q/k un-permutation would be off by whole weights)
        weight = modules[name].weight.data.float()
        read_back = kernel(torch.eye(weight.shape[1], dtype=torch.bfloat16)).t().float()
        torch.testing.assert_close(
            read_back, weight, rtol=2**-7, atol=2**-7 * weight.abs().max().item(), msg=name
        )


def test_q8_0_lm_head_is_the_embedding_in_bf16() -> None:
    embedding = np.random.default_rng(1).normal(size=(64, 96)).astype(np.float32) * 0.05
    codes, d = q8_0_codes(quantize(embedding, Q.Q8_0), (64, 96))
    kernel = cpu_woq.pack_woq(codes, d, bits=8)
    expected = torch.from_numpy(dequantize(quantize(embedding, Q.Q8_0), Q.Q8_0).reshape(64, 96)).bfloat16()
    torch.testing.assert_close(cpu_woq.dequantize(kernel), expected, rtol=2**-7, atol=1e-6)


class _Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(self.name)
        return x


@pytest.mark.parametrize(
    ("rows", "with_gemv", "with_int4", "with_woq", "expected"),
    [
        (1, True, False, True, "gemv"),
        (4, True, False, True, "gemv"),
        (5, True, False, True, "woq"),
        (32, True, False, True, "woq"),
        (33, True, False, True, "woq"),  # a structured step's decode rows and forced tokens
        (64, True, False, True, "woq"),
        (65, True, False, True, "dense"),
        (1, False, True, True, "int4"),  # no AVX512-VNNI: torch's int4 kernel for single streams
        (3, False, True, True, "int4"),
        (4, False, True, True, "woq"),
        (1, False, False, True, "woq"),
        (3, True, False, False, "gemv"),  # VNNI without AMX (Ice Lake, Zen 4)
        (8, True, False, False, "dense"),
        (0, True, False, True, "woq"),  # an empty batch never reaches the GEMV
    ],
)
def test_each_batch_goes_to_the_kernel_for_its_rows(
    rows: int, with_gemv: bool, with_int4: bool, with_woq: bool, expected: str
) -> None:
    calls: list[str] = []
    dispatch = QuantizedSmallBatches(
        gemv=_Recorder("gemv", calls) if with_gemv else None,
        int4=_Recorder("int4", calls) if with_int4 else None,
        woq=_Recorder("woq", calls) if with_woq else None,
        dense=_Recorder("dense", calls),
        weight=torch.zeros(8, 8),
    )
    dispatch(torch.zeros(rows, 8))
    assert calls == [expected]


def test_quantizing_an_hf_checkpoint_gives_every_kernel_the_same_weights() -> None:
    from paged_harness import random_structgen_model

    from structgen.models import int4
    from structgen.models.cpu_linear import attach_int4, prepare_cpu_linears

    model = random_structgen_model(dtype=torch.bfloat16)
    prepare_cpu_linears(model)
    attached = attach_int4(model, quantization="int4", gguf_path=None)
    layers = [m for m in model.modules() if isinstance(getattr(m, "kernel", None), QuantizedSmallBatches)]
    assert attached == len(layers) > 0
    gemv, amx = cpu_woq.gemv_available(), cpu_woq.amx_available()
    for layer in layers:
        kernel = layer.kernel
        assert (kernel.gemv is not None) == gemv and (kernel.woq is not None) == amx
        # one 4-bit copy: torch's int4 kernel only where the GEMV does not take the single streams
        assert (kernel.int4 is not None) == (not gemv)
    x = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    for layer in layers:
        if layer.weight.shape[1] != x.shape[1]:
            continue
        # the same 4-bit values, quantized once: torch's kernel reads bf16 scale and zero, the others fp16 d, m
        values = int4.quantize_int4(layer.weight.float())
        exact = x.float() @ values.dequantize().float().t()
        scale = exact.abs().amax() + 1e-3
        for kernel in (layer.kernel.gemv, layer.kernel.int4, layer.kernel.woq):
            if kernel is not None:
                assert ((kernel(x[:4]).float() - exact[:4]).abs() / scale).max().item() < 2**-5


@pytest.mark.skipif(not cpu_woq.avx2_gemv_available(), reason="the CPU has no AVX2 / FMA / F16C")
@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
def test_an_fp32_model_gets_the_gemv_for_decode_and_with_w4a8_int8_x_for_prompt_chunks(
    quantization: str,
) -> None:
    from paged_harness import random_structgen_model

    from structgen.models.cpu_linear import (
        GEMV_MAX_ROWS_FP32,
        Q8_MAX_ROWS_FP32,
        attach_int4,
        prepare_cpu_linears,
    )

    model = random_structgen_model(dtype=torch.float32)
    prepare_cpu_linears(model)
    attached = attach_int4(model, quantization=quantization, gguf_path=None)
    layers = [m for m in model.modules() if isinstance(getattr(m, "kernel", None), QuantizedSmallBatches)]
    assert attached == len(layers) > 0
    w4a8 = quantization == "w4a8"
    assert all(
        isinstance(m.kernel.gemv, cpu_woq.WoqGemv)
        and isinstance(m.kernel.woq, cpu_woq.WoqQ8) == w4a8
        and (m.kernel.woq is None) != w4a8
        and m.kernel.int4 is None
        and (m.kernel.gemv_rows, m.kernel.woq_rows) == (GEMV_MAX_ROWS_FP32, Q8_MAX_ROWS_FP32)
        for m in layers
    )
    gen = torch.Generator().manual_seed(0)
    layer = next(m for m in layers if m.weight.shape[1] == model.config.hidden_size)
    packed = layer.kernel.gemv.weight
    x = torch.randn(Q8_MAX_ROWS_FP32 + 1, model.config.hidden_size, generator=gen)
    dense = x @ layer.weight.t()
    scale = dense.abs().amax() + 1e-3
    decode, chunk, long = (
        layer.kernel(x[:GEMV_MAX_ROWS_FP32]),
        layer.kernel(x[: GEMV_MAX_ROWS_FP32 + 1]),
        layer.kernel(x),
    )
    assert decode.dtype == chunk.dtype == long.dtype == torch.float32
    # decode batches: the 4-bit weights with x in int16 steps; prompt chunks: with w4a8 in int8 steps, else the
    # layer's own fp32 weights, as longer ones
    int16_x = cpu_woq.woq_gemv_reference(x[:GEMV_MAX_ROWS_FP32], packed)
    assert ((decode - int16_x).abs() / scale).max().item() < 2**-12
    if w4a8:
        int8_x = cpu_woq.woq_q8_reference(x[: GEMV_MAX_ROWS_FP32 + 1], packed)
        assert ((chunk - int8_x).abs() / scale).max().item() < 2**-12
    else:
        torch.testing.assert_close(chunk, dense[: GEMV_MAX_ROWS_FP32 + 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(long, dense, rtol=1e-4, atol=1e-4)
    assert ((decode - dense[:GEMV_MAX_ROWS_FP32]).abs() / scale).max().item() > 2**-12  # it did use 4 bits
