"""Rotary position embeddings, neox style ("rotate half") as HF Llama applies them, with RoPE scaling variants.

cos/sin are computed once per forward for the batch's positions (in float32, as transformers does) and shared by
every layer, so no table of `max_position_embeddings` rows is kept in memory.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from structgen.kernels.cpu_ops import rotary_reference


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; cos/sin scaled by mscale."""
    factor = float(scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; `cos_sin(positions)` per forward, `apply` per layer."""

    def __init__(
        self,
        *,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        max_position_embeddings: int,
    ) -> None:
        super().__init__()
        rope_type = "default" if rope_scaling is None else rope_scaling["rope_type"]
        # Computed on the CPU in float32 like transformers, then moved, so every device gets identical values.
        with torch.device("cpu"):
            inv_freq = _default_inv_freq(head_dim, rope_theta)
            self.attention_scaling = 1.0
            if rope_type == "linear":
                inv_freq = inv_freq / float(rope_scaling["factor"])
            elif rope_type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif rope_type == "yarn":
                inv_freq, self.attention_scaling = _yarn_inv_freq(
                    head_dim, rope_theta, rope_scaling, max_position_embeddings
                )
            # "dynamic" (NTK) only departs from the default beyond max_position_embeddings, which the engine
            # never lets a sequence reach, so within range it is the default.
            elif rope_type not in ("default", "dynamic"):
                raise ValueError(f"unsupported rope type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, `[num_tokens, 1, head_dim // 2]`, broadcastable over heads."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `[num_tokens, heads, head_dim]` by position; same arithmetic as HF's `x*cos + rotate_half(x)*sin`
        (the native rotary kernel's reference)."""
        return rotary_reference(x, cos, sin)
