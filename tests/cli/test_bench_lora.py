"""`structgen bench lora` at toy sizes on `tiny`: both sides reported, every adapter output complete and unlike
the base model's. The numbers themselves mean nothing at these sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen.cli import main


def test_a_tiny_run_reports_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lora.json"
    args = ["--model", "tiny", "--requests", "4", "--adapters", "2", "--rank", "4", "--max-tokens", "6"]
    assert main(["bench", "lora", *args, "--passes", "2", "--threads", "1", "--json", str(out)]) == 0
    assert "ratio lora/base" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["model"], report["requests"], report["adapters"], report["rank"]) == ("tiny", 4, 2, 4)
    assert report["base_tok_s"] > 0 and report["lora_tok_s"] > 0 and report["ratio"] > 0
    assert len(report["ratio_per_pass"]) == 2 and report["target_ratio"] == 0.8
    assert isinstance(report["meets_target"], bool)
    assert report["lora_completed"] == report["base_completed"] == "8/8" and report["all_lora_completed"]
    assert report["lora_differ_from_base"] > 0
    # Two adapters, two slots: each loaded once in the warm-up, never evicted.
    assert (report["slot_loads"], report["evictions"]) == (2, 0)
