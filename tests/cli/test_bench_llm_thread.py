"""`structgen bench llm-thread` on `tiny`: every side generates its tokens, each in a process of its own, and the
report has them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen.bench import llm_thread
from structgen.cli import main


def test_a_tiny_run_reports_every_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "llm_thread.json"
    argv = ["--model", "tiny", "--tokens", "6", "--repeats", "1", "--rounds", "1", "--threads", "1"]
    argv += ["--json", str(out)]
    assert main(["bench", "llm-thread", *argv]) == 0
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"same thread", "worker thread", "before"}
    assert all(len(runs) == 1 and min(runs) > 0 for runs in report["runs"].values())
    assert report["ratio"] == pytest.approx(report["median"]["worker thread"] / report["median"]["before"])
    assert "worker thread / before" in capsys.readouterr().out


def test_bad_arguments_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        llm_thread.main(["--tokens", "0"])
    assert exit_info.value.code == 2
    assert "--tokens, --repeats and --rounds must be >= 1" in capsys.readouterr().err
