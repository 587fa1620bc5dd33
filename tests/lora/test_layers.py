"""`LoRALinear`: the dense masked product (GPU, no compiler) and the CPU kernel give each token its own adapter's
update, and nothing to base-model tokens or projections no adapter of the step touches."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from structgen.kernels import cpu_lora

from structgen.lora.adapter import LoRAModule
from structgen.lora.layers import LoRALinear, LoRAStep

PARTS = ((32, 24), (32, 8), (32, 8))  # a fused qkv: (in, out) of q, k, v
RANKS = {0: [4, 0, 2], 1: [0, 0, 0], 2: [3, 3, 3]}  # slot -> rank per part (slot 1: an adapter elsewhere)


def build(
    native: bool, step: LoRAStep, *, dtype: torch.dtype = torch.float32
) -> tuple[LoRALinear, dict[int, list[LoRAModule | None]], torch.Tensor]:
    """A fused-qkv-like projection with three slots loaded (`RANKS`); bf16 runs on oneDNN's packed product, as
    the CPU's bf16 layers do."""
    from structgen.models.cpu_linear import PackedLinear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 32, generator=g).to(dtype)
    base: Any = lambda x: x @ weight.t()  # noqa: E731
    if dtype == torch.bfloat16:
        # A CPU without oneDNN's bf16 reorder (AVX2 only) keeps the plain product, as its bf16 layers do.
        with contextlib.suppress(RuntimeError):
            base = PackedLinear.from_weight(weight)
    layer = LoRALinear.build(
        base, step, PARTS, num_slots=3, max_rank=4, dtype=dtype, device=torch.device("cpu"), native=native
    )
    modules: dict[int, list[LoRAModule | None]] = {}
    for slot, ranks in RANKS.items():
        modules[slot] = [
            LoRAModule(
                a=torch.randn(r, 32, generator=g).to(dtype), b=torch.randn(out, r, generator=g).to(dtype)
            )
            if r
            else None
            for r, (_, out) in zip(ranks, PARTS, strict=True)
        ]
        layer.load(slot, modules[slot])
    return layer, modules, weight


def expected(x: torch.Tensor, slots: list[int], modules: dict, weight: torch.Tensor) -> torch.Tensor:
    y = x @ weight.t()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        start = 0
        for module, (_, out) in zip(modules[slot], PARTS, strict=True):
            if module is not None:
                y[t, start : start + out] += module.b @ (module.a @ x[t])
            start += out
    return y


NATIVE = [False, *([True] if cpu_lora.available() else [])]


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("slots", [[0, -1, 2, 2, 0, 1], [2, 2, 2], [-1, 0], [1, -1]])
def test_each_token_gets_its_own_adapter(native: bool, slots: list[int]) -> None:
    step = LoRAStep()
    layer, modules, weight = build(native, step)
    x = torch.randn(len(slots), 32, generator=torch.Generator().manual_seed(1))
    step.set(slots, device=torch.device("cpu"))
    torch.testing.assert_close(layer(x), expected(x, slots, modules, weight), rtol=1e-5, atol=1e-4)
    step.clear()
    torch.testing.assert_close(layer(x), x @ weight.t())


def test_reloading_a_slot_replaces_it() -> None:
    step = LoRAStep()
    layer, modules, weight = build(False, step)
    layer.load(0, modules[2])  # slot 0 now holds what slot 2 holds: its old parts must be gone
    assert layer.ranks[0].tolist() == [3, 3, 3]
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    step.set([0, 2], device=torch.device("cpu"))
    torch.testing.assert_close(layer(x), expected(x, [2, 2], modules, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_lora.available(), reason="native CPU kernels unavailable")
def test_bf16_kernel_gives_each_token_its_own_adapter() -> None:
    """On bf16 (the CPU's default) the kernel's shrink runs from A by input pairs (AVX512-BF16 where present)."""
    step = LoRAStep()
    layer, modules, weight = build(True, step, dtype=torch.bfloat16)
    assert layer.ka.numel()  # the by-pairs copy of A is kept for the kernel
    tokens = 27
    slots = [(t % 4) - 1 for t in range(tokens)]
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    step.set(slots, device=torch.device("cpu"))
    got = layer(x).float()
    fp32 = {s: [m and LoRAModule(m.a.float(), m.b.float()) for m in ms] for s, ms in modules.items()}
    want = expected(x.float(), slots, fp32, weight.float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=6e-2)
