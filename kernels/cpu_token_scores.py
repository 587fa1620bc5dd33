"""Launcher of the prompt-scoring reduction in native code (`csrc/cpu_token_scores.cpp`): per row of float32
logits, the log-normalizer and the rank of one token.

`token_scores_reference` is the torch path, which `structgen.engine.prompt_logprobs` keeps where the library is
not built (or off the CPU); the tests compare the two. The native call makes two passes over each row instead of
four over the whole [rows, vocab] block, and counts the rank in registers rather than through an int64 bool sum.
"""

from __future__ import annotations

import torch
from structgen.kernels import cpu_build
from structgen.kernels.cpu_ops import _kernel_message


def available() -> bool:
    """Whether the native ops can be used (builds them on the first call)."""
    return cpu_build.load()


def token_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp [rows] float32, rank [rows] int64: 1 + the entries strictly above the target) of each row of
    `logits` ([rows, vocab] float32, rows contiguous) and its token `targets[row]` ([rows] int64)."""
    try:
        return torch.ops.structgen_cpu.token_scores(logits, targets)
    except RuntimeError as exc:
        raise ValueError(f"token_scores: {_kernel_message(exc)}") from None


def token_scores_reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_scores` in torch ops (any device)."""
    top = logits.amax(dim=1, keepdim=True)
    log_norm = (logits - top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
    target_logit = logits.gather(1, targets.unsqueeze(1))
    rank = (logits > target_logit).sum(dim=1).add_(1)  # vLLM's rank: ties share the better one
    return log_norm, rank
