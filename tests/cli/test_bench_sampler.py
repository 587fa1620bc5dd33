"""`structgen bench sampler`: every case runs on a small batch and lands in the JSON report, in the mode asked
for, with glibc's thresholds fixed as the engine's runner fixes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen.bench import sampler
from structgen.engine import host_memory


def test_a_small_run_reports_every_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(True) or True)
    out = tmp_path / "sampler.json"
    argv = ["--batch", "4", "--vocab", "512", "--iters", "1", "--device", "cpu", "--json", str(out)]
    assert sampler.main([*argv, "--logprobs-mode", "processed_logprobs"]) == 0
    report = json.loads(out.read_text())
    assert (report["batch"], report["vocab"], report["logprobs_mode"]) == (4, 512, "processed_logprobs")
    assert set(report["cases"]) == {"greedy", "sampled", "mixed", "top_p", "top_p_flat", "logprobs"}
    assert all(case["ms"] > 0 for case in report["cases"].values())
    assert "top_p_flat" in capsys.readouterr().out
    assert calls == [True]  # the thresholds fixed once, before the buffers are allocated
