"""Which native CPU kernels a tensor may go through: the decoder's norms, rotary and SwiGLU call `native_ops(x)`
and keep their torch formulas (the references the kernels are tested against) when it returns None: on GPUs,
for dtypes the kernels do not take, and on machines where the kernels could not be built (no compiler)."""

from __future__ import annotations

from types import ModuleType

import torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_ops: list[ModuleType | None] = []  # filled on first use: [cpu_ops] or [None]


def native_ops(x: torch.Tensor) -> ModuleType | None:
    """`structgen.kernels.cpu_ops` when `x` can go through it, else None (the first call may build the kernels)."""
    if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES:
        return None
    if not _ops:
        from structgen.kernels import cpu_ops

        _ops.append(cpu_ops if cpu_ops.available() else None)
    return _ops[0]
