"""The flat CPU forward: the module path's outputs bit for bit, and only where it applies."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, random_structgen_model

from structgen.models.llama_flat import enable_flat_forward, flat_forward_blocker

STEPS: list[dict[int, list[int]]] = [
    {0: list(range(5, 30)), 1: list(range(40, 47))},  # prefills of two lengths
    {0: [3], 1: [9], 2: list(range(100, 140))},  # decodes beside a new prefill
    {0: [11], 1: [12], 2: [13]},
    {0: [14], 2: [15]},
]


def _logits(model: torch.nn.Module) -> list[dict[int, torch.Tensor]]:
    runner = PagedRunner(model, shuffle_seed=3)
    return [runner.step(batch) for batch in STEPS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_forward_gives_the_module_paths_logits(dtype: torch.dtype) -> None:
    model = random_structgen_model(dtype=dtype)
    expected = _logits(model)
    assert enable_flat_forward(model)
    assert model.model.flat_forward is not None
    got = _logits(model)
    for step_expected, step_got in zip(expected, got, strict=True):
        for seq, logits in step_expected.items():
            assert torch.equal(step_got[seq], logits), f"sequence {seq} differs"


@pytest.mark.parametrize(
    ("architecture", "reason"),
    [("Qwen3ForCausalLM", "q/k norm"), ("Qwen2ForCausalLM", "biased projections")],
)
def test_flat_forward_is_not_set_where_it_does_not_apply(architecture: str, reason: str) -> None:
    model = random_structgen_model(architecture)
    assert flat_forward_blocker(model) == reason
    assert not enable_flat_forward(model) and model.model.flat_forward is None
