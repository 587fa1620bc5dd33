"""Weight-only quantized layers for decode batches (`kernels/cpu_woq.py`), from a GGUF's own blocks.

At 4-32 rows a step reads every weight once, and in bf16 that read is the step (SmolLM2: 270 MB). The AMX kernel
reads the GGUF's blocks instead, Q4_1 for the layers (~5 bits a weight) and Q8_0 for the tied embedding / lm_head
(~8.5 bits), and expands them to bf16 in L1: on this project's 2-core Xeon, SmolLM2's layers at 32 rows take
~0.5x the bf16 time, and its lm_head ~0.6x (BENCHMARKS.md). The expanded weights are the GGUF's values rounded
to bf16, which is what the bf16 copy of a GGUF-born checkpoint holds too. The same packed weights feed the VNNI
GEMV for 1-4 rows (a single stream), which reads them at ~2x the rate of torch's int4 kernel and AMX's tiles.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from structgen.errors import ModelLoadError
from structgen.models.gguf import read_gguf
from structgen.models.int4 import (
    Int4Values,
    concat_int4,
    fp16_field,
    gguf_block_tensors,
    gguf_blocks,
    layer_sources,
)
from structgen.models.linear import kernel_layers

if TYPE_CHECKING:
    from structgen.kernels.cpu_woq import WoqWeight

logger = logging.getLogger(__name__)

_Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8


def q8_0_codes(raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 data of a [N, K] weight as (int8 codes [N, K], fp32 d [N, K / 32]): w = d q."""
    blocks = gguf_blocks(raw, shape, _Q8_0_BLOCK_BYTES, kind="Q8_0")
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(shape)
    return codes, fp16_field(blocks[..., 0:2])


def load_gguf_q8_0_weights(gguf_path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every 2-D Q8_0 tensor of a GGUF as (codes, d) under its HF parameter name (not q/k: Q8_0 attention
    projections would need llama.cpp's row permutation undone, and are left to the other paths)."""
    from gguf import GGMLQuantizationType

    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for tensor, name, shape in gguf_block_tensors(read_gguf(gguf_path), {GGMLQuantizationType.Q8_0}):
        if ".q_proj." in name or ".k_proj." in name:
            continue
        try:
            out[name] = q8_0_codes(np.asarray(tensor.data), shape)
        except ValueError as exc:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    return out


def woq_from_int4(values: Int4Values) -> WoqWeight:
    """`Int4Values` (w = (q - 8) s + z, groups of 32) in the AMX kernel's Q4_1 form w = d q + m."""
    from structgen.kernels import cpu_woq

    if values.group_size != cpu_woq.GROUP:
        raise ValueError(f"the AMX kernel takes groups of {cpu_woq.GROUP}, got {values.group_size}")
    return cpu_woq.pack_woq(values.q, values.scales, values.zeros - 8 * values.scales, bits=4)


def build_woq_kernels(
    model: nn.Module,
    int4_weights: Mapping[str, Int4Values],
    q8_weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    by_module: bool = False,
) -> dict[str, WoqWeight]:
    """The kernels' packed weight for every linear layer (and the lm_head) that the GGUF's Q4 / Q8_0 blocks cover
    entirely and whose shape the kernels take, by module name; {} where none of the AMX kernel and the VNNI
    and AVX2 GEMVs can run. The weights are keyed by HF parameter name (as the GGUF loaders return them), or
    by module name with `by_module` (weights quantized here)."""
    from structgen.kernels import cpu_woq

    if not (cpu_woq.amx_available() or cpu_woq.gemv_available() or cpu_woq.avx2_gemv_available()):
        return {}
    kernels: dict[str, WoqWeight] = {}
    available = {*int4_weights, *q8_weights}
    for module_name, module in kernel_layers(model):
        n, k = module.weight.shape
        if cpu_woq.check_shape(n, k) is not None:
            continue
        names = [module_name] if by_module else layer_sources(model, module_name, module, available)
        if all(name in int4_weights for name in names):
            kernels[module_name] = woq_from_int4(concat_int4([int4_weights[name] for name in names]))
        elif all(name in q8_weights for name in names):
            codes = torch.cat([q8_weights[name][0] for name in names])
            scales = torch.cat([q8_weights[name][1] for name in names])
            kernels[module_name] = cpu_woq.pack_woq(codes, scales, bits=8)
        else:
            continue
        if (kernels[module_name].out_features, kernels[module_name].in_features) != (n, k):
            raise ModelLoadError(f"quantized weight for {module_name} does not match the layer's [{n}, {k}]")
    return kernels
