"""oneDNN's packed products on the CPU (`cpu_linear.PackedLinear`): reordered at start, or at the first product."""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedRunner, random_structgen_model

from structgen.models.cpu_linear import PackedLinear, prepare_cpu_linears
from structgen.models.linear import kernel_layers

STEPS: list[dict[int, list[int]]] = [{0: list(range(5, 30)), 1: list(range(40, 47))}, {0: [3], 1: [9]}]


def _packed_kernels(model: torch.nn.Module) -> list[PackedLinear]:
    kernels = [module.kernel for _, module in kernel_layers(model)]
    assert kernels and all(isinstance(k, PackedLinear) for k in kernels)
    return kernels  # type: ignore[return-value]


@pytest.mark.parametrize("shape", [(3, 64), (1, 64), (2, 5, 64)])
def test_a_lazy_packed_linear_packs_at_its_first_product_and_gives_the_same_bits(
    shape: tuple[int, ...],
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator)
    x = torch.randn(*shape, generator=generator)
    eager, lazy = PackedLinear.from_weight(weight), PackedLinear.from_weight(weight, lazy=True)
    assert eager.packed is not None and lazy.packed is None
    out = lazy(x)
    assert lazy.packed is not None and out.shape == (*shape[:-1], 48)
    assert torch.equal(out, eager(x))
    packed = lazy.packed
    lazy(x)
    assert lazy.packed is packed  # once


def test_lazy_layers_give_the_models_logits_and_pack_only_what_runs() -> None:
    eager_model, lazy_model = random_structgen_model(), random_structgen_model()
    assert prepare_cpu_linears(eager_model) == prepare_cpu_linears(lazy_model, lazy=True) > 0
    assert all(k.packed is not None for k in _packed_kernels(eager_model))
    assert all(k.packed is None for k in _packed_kernels(lazy_model))
    expected = [PagedRunner(eager_model, shuffle_seed=3).step(batch) for batch in STEPS]
    got = [PagedRunner(lazy_model, shuffle_seed=3).step(batch) for batch in STEPS]
    for step_expected, step_got in zip(expected, got, strict=True):
        for seq, logits in step_expected.items():
            assert torch.equal(step_got[seq], logits), f"sequence {seq} differs"
    assert all(k.packed is not None for k in _packed_kernels(lazy_model))  # every layer ran: every one packed


@pytest.mark.parametrize("pack", [True, False])
def test_load_model_and_the_draft_loader_pack_as_asked(pack: bool) -> None:
    from structgen.engine.model_loading import load_draft_model
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model

    model = load_model(resolve_model("tiny"), pack_cpu_weights_at_start=pack)
    assert all((k.packed is not None) == pack for k in _packed_kernels(model))
    draft, _, _ = load_draft_model(
        "tiny", dtype=torch.float32, device=torch.device("cpu"), quantization="none", pack_weights=pack
    )
    assert all((k.packed is not None) == pack for k in _packed_kernels(draft))
