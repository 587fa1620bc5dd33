"""The GPU benchmark refuses clearly without CUDA (its `--cpu-check` mode is run by hand: it takes ~30 s here)."""

from __future__ import annotations

import pytest
import torch

from structgen.bench.kernels import main


def test_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_a_failing_check_is_a_row_and_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One kernel that fails to build or launch leaves the others' numbers (the device time they cost is not
    lost) and fails the run."""
    from structgen.bench import kernels

    def broken(*args: object) -> kernels.Row:
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(kernels, "check_bitmask", broken)
    assert main(["--cpu-check", "--skip-e2e"]) == 1
    out = capsys.readouterr().out
    assert "failed: RuntimeError: no such kernel here" in out
    assert "store_kv" in out and "decode attention" in out  # the other checks still ran


def test_logit_comparison_judges_rows_by_the_reference_margin() -> None:
    """A row is decisive by the reference's own top-two margin against the dtype's rounding, so a wrong result
    on a clear row counts as a disagreement (judged by the two sides' difference, it would drop out)."""
    from structgen.bench.kernels_e2e import compare_logits

    ref = torch.tensor([[5.0, 1.0, 0.0], [1.0, 1.001, 0.0], [0.0, 4.0, 2.0]])
    ours = ref.clone()
    ours[1] = torch.tensor([1.001, 1.0, 0.0])  # a near tie swapped: rounding can do that, not decisive
    ours[2, 0] = 9.0  # a clear row got wrong
    err, decisive, agree = compare_logits(ours, ref, tolerance=1e-2)
    assert decisive == 2 and agree == 0.5  # rows 0 and 2; row 2 disagrees
    assert err > 0.5
    exact = compare_logits(ref.clone(), ref, tolerance=1e-2)
    assert exact == (0.0, 2, 1.0)
