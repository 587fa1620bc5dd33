"""Small building blocks of the decoder: RMSNorm (optionally fused with the residual add) and SwiGLU.

On the CPU each goes through one native kernel (`structgen.kernels.cpu_ops`); everywhere else through that
kernel's torch reference, the same arithmetic with the same roundings (HF Llama's)."""

from __future__ import annotations

import torch
from torch import nn

from structgen.kernels.cpu_ops import rms_norm_reference, silu_and_mul_reference
from structgen.models.cpu_kernels import native_ops


class RMSNorm(nn.Module):
    """Normalizes in float32 and scales in the model dtype, exactly as HF Llama does (logit parity depends on it)."""

    def __init__(self, hidden_size: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, eps=self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = native_ops(x) if x.dim() == 2 and x.dtype == self.weight.dtype else None
        if ops is not None:
            return ops.rms_norm(x, self.weight, eps=self.eps)
        return self._norm(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the pre-norm decoder's add-then-normalize in one call. The
        native kernel writes the sum into `residual` in place (the decoder owns that stream, nothing else reads it)."""
        ops = native_ops(x) if x.dim() == 2 and x.dtype == self.weight.dtype else None
        if ops is not None and residual.dtype == x.dtype and residual.shape == x.shape:
            return ops.fused_add_rms_norm(x, residual, self.weight, eps=self.eps)
        x = residual + x
        return self._norm(x), x


class SiluAndMul(nn.Module):
    """SwiGLU on a fused `[gate | up]` projection: `silu(gate) * up`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = native_ops(x) if x.dim() == 2 else None
        if ops is not None:
            return ops.silu_and_mul(x)
        return silu_and_mul_reference(x)
