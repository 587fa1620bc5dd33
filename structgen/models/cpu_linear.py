"""Faster CPU matmuls for the linear layers, attached after loading (`prepare_cpu_linears`).

On the CPU a bf16 `F.linear` hands oneDNN a plain weight that it reorders into its blocked layout on every call;
at decode batch sizes that reorder costs as much as the product. Here each bf16 or fp32 weight is reordered once,
at load time (`torch.ops.mkldnn._reorder_linear_weight`), and the layer's `kernel` calls oneDNN's linear on the
packed copy: the same products (bit-identical to `F.linear` in the bf16 measurements), about 2x faster for
SmolLM2's shapes at batch 1-32. fp32 went through MKL's sgemm until an AVX2-only AMD EPYC showed it 2-2.5x
slower than oneDNN's packed product at 6-32 rows (the rows of a speculative or batched step) and ~1.5x at
64-512, and no faster at one row (BENCHMARKS.md "Speculative decoding", session 11). Also the place where a
CPU's native bf16 support is detected, which makes bf16 the CPU's `"auto"` dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from structgen.config import QUANTIZATION_CHOICES
from structgen.models.linear import kernel_layers

if TYPE_CHECKING:
    from structgen.kernels.cpu_woq import WoqWeight

logger = logging.getLogger(__name__)

# The batch size oneDNN picks its blocked layout for; measured on SmolLM2's shapes, 32 serves batches 1..100 well.
PACK_BATCH_HINT = 32
PACKED_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16), where bf16 matmuls beat fp32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return bool({"avx512_bf16", "amx_bf16"} & set(flags)) and torch.backends.mkldnn.is_available()


@dataclass(slots=True)
class PackedLinear:
    """`x @ W^T` through oneDNN with W reordered once; takes and returns W's dtype, bf16 or fp32 (other dtypes
    are cast). Built `lazy`, W is reordered at the first call instead: where other kernels take every batch a
    short run makes (the AVX2 GEMV takes up to 256 rows), it never is, and the run neither spends the reorder
    (~0.5 s for SmolLM2 on a 2-core AVX2 host) nor holds the packed copy (as large as the weights)."""

    weight: torch.Tensor
    packed: torch.Tensor | None
    out_features: int

    @classmethod
    def from_weight(cls, weight: torch.Tensor, *, lazy: bool = False) -> PackedLinear:
        if weight.dtype not in PACKED_DTYPES or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"PackedLinear needs a 2-D bf16 or fp32 CPU weight, got {weight.dtype} {list(weight.shape)}"
            )
        weight = weight.detach()
        return cls(weight=weight, packed=None if lazy else _pack(weight), out_features=weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None:  # (two threads racing here both pack; the later copy stays, each call's is valid)
            packed = self.packed = _pack(self.weight)
        if x.dtype == packed.dtype and x.dim() == 2 and x.shape[0] > 0 and x.is_contiguous():
            # Every call from the model: straight to the op (the reshapes and casts below cost ~5 us a call).
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(packed.dtype)
        if x2.shape[0] == 0:
            return x.new_empty((*lead, self.out_features))
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, None, "none", [], "")
        return y.view(*lead, self.out_features).to(x.dtype)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def prepare_cpu_linears(model: nn.Module, *, lazy: bool = False) -> int:
    """Attach `PackedLinear` kernels to every bf16 or fp32 CPU linear layer of `model` that has no kernel yet;
    returns how many. Layers keep their weights (the tied embedding reads the lm_head's). `lazy`: each weight is
    reordered at its first product (`PackedLinear`); a build without oneDNN's linear then fails there, not here."""
    count = 0
    for _, module in kernel_layers(model):
        weight = module.weight
        if module.kernel is not None or weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
            continue
        try:
            module.kernel = PackedLinear.from_weight(weight, lazy=lazy)
        except RuntimeError as exc:  # a torch build without oneDNN's bf16 linear: keep F.linear
            logger.warning("bf16 weight packing unavailable (%s): using F.linear", exc)
            return count
        count += 1
    return count


# Batches up to this many rows go through the VNNI GEMV on the GGUF's blocks where the CPU has AVX512-VNNI: on
# SmolLM2's layers ~0.5x torch's int4 kernel's time at 1 row and ~0.8x AMX's at 4, slower than AMX from 5 rows on
# (its products grow with the rows; AMX's tiles cost the same for 1-32 rows). BENCHMARKS.md, session 6.
GEMV_MAX_ROWS = 4
# Where no AMX kernel takes the larger batches, the GEMV keeps them longer: on a 2-core AMD EPYC (AVX512-VNNI, no
# AMX) SmolLM2's 121 products took (ms, GEMV / bf16) 4.1 / 10.2 at 5 rows, 6.1 / 10.0 at 8, 10.0 / 11.3 at 12 and
# 12.9 / 12.0 at 16 (2026-12-02, BENCHMARKS.md "Speculative decoding").
GEMV_MAX_ROWS_WITHOUT_AMX = 12
# Without the GEMV, batches up to this many rows go through torch's int4 kernel: on SmolLM2's shapes it is ~2x
# faster than bf16 at 1 row (decode reads the weights once per step, and int4 reads 4x fewer bytes) and even at
# 4 rows, and slower from 8 on, where the bf16 products amortize their reads over more rows.
INT4_MAX_ROWS = 3
# Up to this many rows the AMX kernel (the GGUF's blocks expanded in L1, `structgen.models.woq`) takes the batch
# where it is attached: ~0.5x the bf16 time at 4-32 rows; at 33-64 rows (a structured step's decode rows and
# forced tokens), since its 16-column strips, 0.83-0.91x (SmolLM2's 120 products, 2026-12-05); even with bf16
# above (BENCHMARKS.md).
WOQ_MAX_ROWS = 64

# fp32 models (CPUs without native bf16) on AVX2: the AVX2 GEMV on the GGUF's blocks takes batches up to this
# many rows (decode steps, a structured step's forced tokens, short prompt chunks), the packed fp32 product the
# rest. Its int16 products outrun oneDNN's fp32 ones at every size measured: SmolLM2's 121 products on a 2-core
# Zen 3, ms GEMV / fp32, 8.2 / 32.9 at 1 row, 54.4 / 88.7 at 32, 97.7 / 156.7 at 64, 175 / 246 at 128 and
# 364 / 479 at 256, the gap narrowing (BENCHMARKS.md, "AVX2 hosts"). Its x in int16 steps keeps greedy outputs
# those of the exact product of the 4-bit weights (20 of 20 prompts, 48 tokens each, BENCHMARKS.md "Session 33").
GEMV_MAX_ROWS_FP32 = 256
# With quantization "w4a8", 4-bit layers take the int8-x kernel (`cpu_woq.woq_q8_avx2`, twice VPMADDWD's products
# an instruction) above it, up to this many rows: prompt chunks, 0.66-0.80x oneDNN's fp32 time from 384 to 2,048
# rows where the int16 GEMV is no faster than fp32 (SmolLM2's 120 layer products: BENCHMARKS.md, "Session 33").
# Opt-in, not the default: x in int8 steps changes greedy outputs, a batch's prompts computed that way included
# (16 of those 20 prompts diverged, some at the first token). Up to the default token budget of a forward
# (`max_num_batched_tokens`); larger chunks, unmeasured, stay dense.
Q8_MAX_ROWS_FP32 = 2048


@dataclass(slots=True)
class QuantizedSmallBatches:
    """Each batch to the fastest kernel for its row count: the VNNI GEMV (<= `gemv_rows`), torch's int4
    (<= `int4_rows`), the AMX one (<= `woq_rows`), else the dense (bf16) one. A missing kernel passes its rows
    on to the next. fp32 models on AVX2: the AVX2 GEMV, then the int8-x kernel in the AMX one's place."""

    gemv: Callable[[torch.Tensor], torch.Tensor] | None
    int4: Callable[[torch.Tensor], torch.Tensor] | None
    woq: Callable[[torch.Tensor], torch.Tensor] | None
    dense: Callable[[torch.Tensor], torch.Tensor] | None  # None: F.linear on the layer's own weight
    weight: torch.Tensor
    gemv_rows: int = GEMV_MAX_ROWS
    int4_rows: int = INT4_MAX_ROWS
    woq_rows: int = WOQ_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.gemv is not None and 0 < rows <= self.gemv_rows:
            return self.gemv(x)
        if self.int4 is not None and rows <= self.int4_rows:
            return self.int4(x)
        if self.woq is not None and rows <= self.woq_rows:
            return self.woq(x)
        return self.dense(x) if self.dense is not None else torch.nn.functional.linear(x, self.weight)


def attach_int4(model: nn.Module, *, quantization: str, gguf_path: Path | None) -> int:
    """Weight-only 4-bit kernels for small batches, returning how many layers got one. `quantization`: "none";
    "int4" (the GGUF's own 4-bit blocks when the model came from one, else each weight quantized per group of
    32); "auto" (only a GGUF's own blocks, which loses nothing the file had); "w4a8" (as "int4", and an fp32
    model's prompt chunks through the int8-x kernel, llama.cpp's arithmetic). The kernels read the same blocks
    (and the GGUF's Q8_0 lm_head): the VNNI GEMV for up to `GEMV_MAX_ROWS` rows, AMX's for up to
    `WOQ_MAX_ROWS`; torch's int4 kernel takes single streams on layers (or CPUs) the GEMV does not cover. CPU,
    bf16 (fp32: the AVX2 GEMV alone, `_attach_fp32_gemv`), one rank only."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    from structgen.kernels import cpu_woq

    weight = next(model.parameters())
    tp_size = getattr(model.model.embed_tokens, "tp_size", 1) if hasattr(model, "model") else 1
    fp32 = weight.dtype == torch.float32
    dtype_ok = weight.dtype == torch.bfloat16 or (fp32 and cpu_woq.avx2_gemv_available())
    eligible = weight.device.type == "cpu" and dtype_ok and tp_size == 1
    if quantization in ("int4", "w4a8") and not eligible:
        raise ValueError(
            f"quantization={quantization!r} needs the CPU, dtype bfloat16 (or float32 on a CPU with AVX2) and "
            "tensor_parallel_size 1"
        )
    if quantization == "none" or not eligible:
        return 0
    from structgen.models import int4

    layers = kernel_layers(model)
    found = _four_bit_weights(model, layers, quantization=quantization, gguf_path=gguf_path)
    if found is None:
        return 0
    values, packed_woq = found
    if fp32:
        return _attach_fp32_gemv(layers, packed_woq, int8_prompts=quantization == "w4a8")
    dense = {name: module.kernel for name, module in layers}
    with_gemv = _gemv_layers(packed_woq)
    # torch's int4 copy only where the GEMV does not take the single streams (one 4-bit copy in memory, not two)
    if gguf_path is not None:
        attached = set(int4.attach_int4_kernels(model, values, skip=with_gemv))
        packed = {name: module.kernel for name, module in layers if name in attached}
    else:
        packed = {name: v.pack() for name, v in values.items() if name not in with_gemv}
    amx = packed_woq if cpu_woq.amx_available() else {}
    gemv_rows = GEMV_MAX_ROWS if amx else GEMV_MAX_ROWS_WITHOUT_AMX
    count = 0
    for name, module in layers:
        if name in packed or name in packed_woq:
            module.kernel = QuantizedSmallBatches(
                gemv=cpu_woq.WoqGemv(packed_woq[name]) if name in with_gemv else None,
                int4=packed.get(name),
                woq=amx.get(name),
                dense=dense[name],
                weight=module.weight,
                gemv_rows=gemv_rows,
            )
            count += 1
    logger.info(
        "quantized kernels on %d layers: VNNI GEMV for <= %d rows on %d, torch int4 for <= %d on %d, "
        "AMX for <= %d on %d",
        count,
        gemv_rows,
        len(with_gemv),
        INT4_MAX_ROWS,
        len(packed),
        WOQ_MAX_ROWS,
        len(amx),
    )
    return count


def _four_bit_weights(
    model: nn.Module, layers: list[tuple[str, nn.Module]], *, quantization: str, gguf_path: Path | None
) -> tuple[dict[str, Any], dict[str, WoqWeight]] | None:
    """(4-bit values by name, the kernels' packed weights by module name): a GGUF's own blocks, or with "int4"
    (or "w4a8") each weight quantized per group of 32; None where there is neither."""
    from structgen.models import int4, packed_cache, woq

    if gguf_path is not None:

        def build() -> tuple[dict[str, Any], dict[str, WoqWeight]]:
            values = int4.load_gguf_int4_weights(gguf_path, model.config)
            return values, woq.build_woq_kernels(model, values, woq.load_gguf_q8_0_weights(gguf_path))

        return packed_cache.four_bit_weights(
            gguf_path, model, build=build, values_needed=lambda v, p: _int4_values_used(model, layers, v, p)
        )
    if quantization not in ("int4", "w4a8"):
        return None
    values = {
        name: int4.quantize_int4(module.weight.float())
        for name, module in layers
        if module.weight.shape[0] % int4.ROW_ALIGNMENT == 0
    }
    return values, woq.build_woq_kernels(model, values, {}, by_module=True)


def _gemv_layers(packed_woq: dict[str, WoqWeight]) -> set[str]:
    """The layers a bf16 model gives the VNNI GEMV (all with packed weights, where the CPU runs it): torch's int4
    copy goes only to the others, and only their int4 values are cached (`_int4_values_used`)."""
    from structgen.kernels import cpu_woq

    return set(packed_woq) if cpu_woq.gemv_available() else set()


def _int4_values_used(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    values: dict[str, Any],
    packed: dict[str, WoqWeight],
) -> set[str]:
    """The int4 values (by HF name) that `attach_int4` hands torch's int4 kernel: a bf16 model's layers the VNNI
    GEMV does not take (none for fp32, whose layers take the AVX2 GEMV alone)."""
    from structgen.models.int4 import layer_sources

    if next(model.parameters()).dtype == torch.float32:
        return set()
    with_gemv = _gemv_layers(packed)
    return {
        source
        for name, module in layers
        if name not in with_gemv
        for source in layer_sources(model, name, module, values)
    }


def _attach_fp32_gemv(
    layers: list[tuple[str, nn.Module]], packed_woq: dict[str, WoqWeight], *, int8_prompts: bool
) -> int:
    """`attach_int4` for an fp32 model: the AVX2 GEMV (fp32 in and out) on the packed blocks for up to
    `GEMV_MAX_ROWS_FP32` rows, with `int8_prompts` ("w4a8") the int8-x kernel on 4-bit layers up to
    `Q8_MAX_ROWS_FP32` (prompt chunks), the dense kernel above. No torch int4 or AMX kernel: both compute in
    bf16."""
    from structgen.kernels import cpu_woq

    count, four_bit = 0, 0
    for name, module in layers:
        if name in packed_woq:
            packed = packed_woq[name]
            module.kernel = QuantizedSmallBatches(
                gemv=cpu_woq.WoqGemv(packed),
                int4=None,
                woq=cpu_woq.WoqQ8(packed) if int8_prompts and packed.bits == 4 else None,  # mid-size batches
                dense=module.kernel,
                weight=module.weight,
                gemv_rows=GEMV_MAX_ROWS_FP32,
                woq_rows=Q8_MAX_ROWS_FP32,
            )
            count += 1
            four_bit += int8_prompts and packed.bits == 4
    logger.info(
        "quantized kernels on %d fp32 layers: AVX2 GEMV for <= %d rows, int8-x for <= %d on %d",
        count,
        GEMV_MAX_ROWS_FP32,
        Q8_MAX_ROWS_FP32,
        four_bit,
    )
    return count
