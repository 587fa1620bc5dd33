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
    # A few new tokens on a cached context (forced tokens, speculative proposals): each one a decode row.
    {0: [16, 17], 2: [18, 19]},
    {1: [20, 21, 22]},
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_decode_step_gives_the_flat_forwards_logits(dtype: torch.dtype) -> None:
    """Decode steps of few rows (up to the GEMV's) run all layers in one native call, also where a sequence has
    a few new tokens; the same kernels, the same bits. bf16 layers take the VNNI GEMV, fp32 ones the AVX2 one."""
    from structgen.kernels import cpu_woq

    from structgen.models.cpu_linear import (
        GEMV_MAX_ROWS,
        GEMV_MAX_ROWS_FP32,
        GEMV_MAX_ROWS_WITHOUT_AMX,
        attach_int4,
        prepare_cpu_linears,
    )

    model = random_structgen_model(dtype=dtype)
    prepare_cpu_linears(model)
    gemv = cpu_woq.gemv_available() if dtype == torch.bfloat16 else cpu_woq.avx2_gemv_available()
    if dtype == torch.float32 and not gemv:
        pytest.skip("fp32 layers get a GEMV only on AVX2")
    attach_int4(model, quantization="int4", gguf_path=None)
    assert enable_flat_forward(model)
    flat = model.model.flat_forward
    if not gemv:
        assert flat.native_decode is None  # no GEMV kernels, no native step
        return
    native = flat.native_decode
    if dtype == torch.float32:
        rows = GEMV_MAX_ROWS_FP32
    else:
        rows = GEMV_MAX_ROWS if cpu_woq.amx_available() else GEMV_MAX_ROWS_WITHOUT_AMX
    assert native is not None and native.max_rows == rows
    calls: list[int] = []

    class Counted:
        max_rows = native.max_rows

        def __call__(self, embedded: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            calls.append(embedded.shape[0])
            return native(embedded, *args, **kwargs)  # type: ignore[arg-type]

    flat.native_decode = None
    expected = _logits(model)
    flat.native_decode = Counted()  # type: ignore[assignment]
    got = _logits(model)
    # The decode steps (3 and 2 rows) and those of a few tokens per sequence (4 and 3 rows, each token a decode
    # row); the ones with a prefill stay in Python.
    assert calls == [3, 2, 4, 3]
    for step_expected, step_got in zip(expected, got, strict=True):
        for seq, logits in step_expected.items():
            assert torch.equal(step_got[seq], logits), f"sequence {seq} differs"


def test_native_decode_step_needs_the_gemv_on_every_projection() -> None:
    from structgen.models.llama_flat import NativeDecodeStep

    model = random_structgen_model(dtype=torch.bfloat16)  # bf16 kernels only: no packed 4-bit weights
    assert NativeDecodeStep.build(model.model) is None
