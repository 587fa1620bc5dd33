"""CpuAttentionBackend (the native kernels) against the dense reference on mixed steps: decode rows, a few new
tokens on a cached context (forced tokens fed with the next pick) attended as decode rows, and prefills."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_ops, cpu_prefill_attention
from test_torch_backend import Scenario

from structgen.attention import cpu_backend, torch_backend

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the native CPU kernels could not be built")

LIMIT = cpu_backend.MAX_EXTEND_AS_DECODE
CASES = {
    # Decode rows, short extensions of cached contexts (up to the limit), a longer extension, fresh prefills.
    "extend": ([40, 0, 17, 100, 5, 64, 3], [3, 7, 1, LIMIT, 2, LIMIT + 4, 1]),
    "extend-only": ([31, 8, 200], [2, 5, 11]),
    "block-edges": ([15, 16, 17, 63], [2, 1, 16, 1]),
}


def run(scenario: Scenario) -> torch.Tensor:
    return scenario.run(cpu_backend.CpuAttentionBackend())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_mixed_steps_match_the_dense_reference(case: str, heads: int, kv_heads: int) -> None:
    cached, new = CASES[case]
    scenario = Scenario(cached, new, heads=heads, kv_heads=kv_heads, head_dim=64, block_size=16, seed=7)
    torch.testing.assert_close(run(scenario).double(), scenario.expected(), atol=2e-5, rtol=2e-5)


def test_bf16_matches_the_torch_backend() -> None:
    cached, new = CASES["extend"]
    scenario = Scenario(cached, new, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    torch.testing.assert_close(run(scenario).float(), scenario.run().float(), atol=2e-2, rtol=2e-2)


# Prompts of several query and key tiles, chunks on cached prefixes (one ending mid-block), a decode row and a
# 3-token prompt.
PREFILLS = ([0, 130, 2, 40, 0], [150, 70, 90, 1, 3])


PREFILL_DTYPES = [
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not cpu_prefill_attention.available(torch.bfloat16), reason="needs AVX512-BF16"
        ),
    ),
    pytest.param(
        torch.float32,
        marks=pytest.mark.skipif(
            not cpu_prefill_attention.available(torch.float32), reason="needs AVX-512F or AVX2 + FMA"
        ),
    ),
]
PREFILL_TOLERANCES = {torch.bfloat16: 2e-2, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
def test_prefills_take_the_kernel_and_match_the_torch_backend(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    calls: list[int] = []
    original = cpu_prefill_attention.prefill_attention

    def spy(query, *args, **kwargs):
        calls.append(query.shape[0])
        return original(query, *args, **kwargs)

    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", spy)
    scenario = Scenario(*PREFILLS, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    tol = PREFILL_TOLERANCES[dtype]
    torch.testing.assert_close(run(scenario).float(), scenario.run().float(), atol=tol, rtol=tol)
    assert calls == [150, 70, 90, 3]  # every sequence but the decode row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefills_fall_back_to_sdpa_where_the_kernel_cannot_run(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    def unavailable(*args, **kwargs):
        raise AssertionError("the kernel ran where it is unavailable")

    monkeypatch.setattr(cpu_prefill_attention, "available", lambda dtype=None: False)
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", unavailable)
    scenario = Scenario(*PREFILLS, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    tol = PREFILL_TOLERANCES[dtype]
    torch.testing.assert_close(run(scenario).float(), scenario.run().float(), atol=tol, rtol=tol)


def test_short_extensions_skip_the_per_sequence_path(monkeypatch: pytest.MonkeyPatch) -> None:
    attended: list[int] = []
    original = torch_backend.prefill_attention

    def spy(*args, skip=frozenset(), **kwargs):
        metadata = args[5]
        attended.extend(i for i, n in enumerate(metadata.query_lens_cpu) if n > 1 and i not in skip)
        return original(*args, skip=skip, **kwargs)

    monkeypatch.setattr(cpu_backend, "prefill_attention", spy)
    monkeypatch.setattr(
        cpu_prefill_attention, "available", lambda dtype=None: False
    )  # count on the SDPA path
    cached, new = CASES["extend"]
    run(Scenario(cached, new, head_dim=64, block_size=16))
    # Only the fresh prompt (no cache) and the extension past the limit take SDPA.
    assert attended == [1, 5]
