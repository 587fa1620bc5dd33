"""`structgen bench gpu-engine`: refuses clearly without CUDA, and its code runs end to end on the CPU
(`--cpu-check`: the torch backend, small sizes) with every structured output that finished valid."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from structgen.attention import BACKEND_ENV_VAR
from structgen.bench.gpu_engine import main


def test_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_unknown_shape_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cpu-check", "--shapes", "enums,nope"]) == 2
    assert "unknown shapes ['nope']" in capsys.readouterr().err


def test_cpu_check_runs_the_whole_path(tmp_path: Path) -> None:
    before = os.environ.get(BACKEND_ENV_VAR)
    out = tmp_path / "engine.json"
    assert main(["--cpu-check", "--shapes", "enums", "--json", str(out)]) == 0
    assert os.environ.get(BACKEND_ENV_VAR) == before  # the backends it tries do not leak into the process
    payload = json.loads(out.read_text())
    (agree,) = payload["agreement"]
    assert agree["backend"] == "torch" and agree["same_as_torch"] == 1.0 and agree["broken"] == 0
    (row,) = payload["throughput"]
    assert row["shape"] == "enums" and row["requests"] == 4 and row["broken"] == 0
    assert row["free_tok_s"] > 0 and row["constrained_tok_s"] > 0
    assert row["ratio_sampled"] <= row["ratio"]  # forced tokens only add to what is counted
