"""`structgen bench reasoning`: a tiny run on `tiny-thinking` reports both sides, every output valid, the
reasoning side's outputs reasoning to their budget; a model without markers is refused in one message. The
numbers themselves mean nothing at these sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen.cli import main

BUDGET = 8


def test_a_tiny_run_reports_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "reasoning.json"
    # 96 tokens: the answer's room (~60 tokens) is left after the budget, so the reasoning runs to the budget.
    args = ["--batch", "3", "--max-tokens", "96", "--budget", str(BUDGET), "--passes", "2"]
    args += ["--json", str(out)]
    assert main(["bench", "reasoning", *args]) == 0
    assert "ratio reasoning/plain" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["model"], report["parser"], report["batch"], report["passes"]) == (
        "tiny-thinking",
        "deepseek_r1",
        3,
        2,
    )
    assert report["valid_share"] == 1.0 and len(report["ratio_per_pass"]) == 2
    assert report["ratio"] > 0 and report["reasoning_tok_s"] > 0 and report["plain_tok_s"] > 0
    thinking, plain = report["reasoning"], report["plain"]
    for side in (thinking, plain):
        assert side["outputs"] == side["stop"] == side["valid"] == 6  # 2 passes of 3
        assert side["markers_leaked"] == 0 and side["tokens"] >= side["sampled"] > 0
    # Random weights never close `</think>` themselves: each output reasons to the budget, then `</think>`.
    assert thinking["reasoning_missing"] == 0
    assert 6 * (BUDGET + 1) <= thinking["reasoning_tokens"] <= 6 * (BUDGET + 2)
    assert plain["reasoning_tokens"] == 0


def test_a_model_without_markers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "reasoning", "--model", "tiny", "--batch", "1", "--passes", "1"]) == 2
    err = capsys.readouterr().err
    assert "tiny: " in err and "use --model tiny-thinking" in err
