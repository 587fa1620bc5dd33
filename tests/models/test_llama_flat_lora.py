"""LoRA adapters on the flat CPU forward: the all-native decode step adds the rows' adapters inside its one call,
bit for bit what the flat loop's wrapped projections add, and steps without adapter rows stay native too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from paged_harness import PagedRunner, random_structgen_model
from test_llama_flat import STEPS

from structgen.lora.adapter import LoRAModule, TargetShapes
from structgen.lora.layers import LoRAStep, attach_lora_layers
from structgen.models.llama_flat import enable_flat_forward


class WithSlots:
    """The flat forward, with token i of each step on slot `pattern[i % len(pattern)]` (-1: the base model)."""

    def __init__(self, flat: Any, step: LoRAStep, pattern: list[int]) -> None:
        self.flat, self.step, self.pattern = flat, step, pattern

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        slots = [self.pattern[i % len(self.pattern)] for i in range(len(input_ids))]
        self.step.set(slots, device=torch.device("cpu"))
        try:
            return self.flat(input_ids, *args)
        finally:
            self.step.clear()


def run_steps(model: torch.nn.Module) -> list[dict[int, torch.Tensor]]:
    runner = PagedRunner(model, shuffle_seed=3)
    return [runner.step(batch) for batch in STEPS]


def model_with_adapters() -> tuple[torch.nn.Module, LoRAStep]:
    from structgen.models.cpu_linear import attach_int4, prepare_cpu_linears

    model = random_structgen_model(dtype=torch.bfloat16)
    prepare_cpu_linears(model)
    attach_int4(model, quantization="int4", gguf_path=None)
    assert enable_flat_forward(model)
    step = LoRAStep()
    shapes = TargetShapes.from_config(model.config)
    wrappers = attach_lora_layers(model, step, shapes, num_slots=2, max_rank=8)
    g = torch.Generator().manual_seed(5)
    for (layer, fused), wrapper in wrappers.items():
        for slot, rank in ((0, 8), (1, 4)):
            modules = [
                LoRAModule(
                    a=(torch.randn(rank, i, generator=g) / i**0.5).bfloat16(),
                    b=(torch.randn(o, rank, generator=g) * 0.5).bfloat16(),
                )
                if (slot + p + layer) % 3  # each slot leaves some parts alone
                else None
                for p, (i, o) in enumerate(shapes.parts[fused])
            ]
            wrapper.load(slot, modules)
    return model, step


@pytest.mark.parametrize("pattern", [[0], [1, -1, 0], [-1]])
def test_native_step_adds_the_adapters_as_the_flat_loop_does(pattern: list[int]) -> None:
    from structgen.kernels import cpu_woq

    if not cpu_woq.gemv_available():
        pytest.skip("no VNNI GEMV here: no native decode step")
    model, step = model_with_adapters()
    flat = model.model.flat_forward
    native = flat.native_decode
    assert native is not None and len(native.lora) == 2 * (6 + 4 + 5 + 4)  # a, ranks, ka, b per part
    model.model.flat_forward = WithSlots(flat, step, pattern)
    flat.native_decode = None
    expected = run_steps(model)
    calls: list[int] = []

    class Counted:
        max_rows, lora = native.max_rows, native.lora

        def __call__(self, embedded: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(embedded.shape[0])
            return native(embedded, *args, **kwargs)

    flat.native_decode = Counted()
    got = run_steps(model)
    assert calls == [3, 2, 4, 3]  # the decode steps went native, with or without adapter rows
    for step_expected, step_got in zip(expected, got, strict=True):
        for seq, logits in step_expected.items():
            assert torch.equal(step_got[seq], logits), f"sequence {seq} differs"
    if pattern != [-1]:  # and the adapters did change the logits
        model.model.flat_forward = flat
        base = run_steps(model)
        assert not torch.equal(base[-1][1], got[-1][1])
