"""The GPU benchmark refuses clearly without CUDA (its `--cpu-check` mode is run by hand: it takes ~30 s here)."""

from __future__ import annotations

import pytest
import torch

from structgen.bench.kernels import main


def test_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err
