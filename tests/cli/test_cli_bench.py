"""`structgen bench NAME`: dispatch to `structgen.bench.<module>`, the `benchmarks/` wrappers, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from structgen.cli import main
from structgen.commands.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_a_moved_benchmark_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sampler.json"
    args = ["bench", "sampler", "--batch", "2", "--vocab", "256", "--iters", "1", "--json", str(out)]
    assert main([*args, "--logprobs-mode", "processed_logprobs"]) == 0
    table = capsys.readouterr().out
    assert "x argmax" in table and "top_p_flat" in table
    report = json.loads(out.read_text())
    assert (
        set(report["cases"]) == {"greedy", "sampled", "mixed", "top_p", "top_p_flat", "logprobs"}
        and report["argmax_ms"] > 0
        and report["logprobs_mode"] == "processed_logprobs"
    )


def test_wrapper_script_is_the_same_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    args = ["--batch", "1", "--vocab", "128", "--iters", "1", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sampler.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["batch"] == 1


def test_every_moved_benchmark_exposes_main() -> None:
    import importlib

    for name in ("engine", "structured", "mask-fill", "coverage", "sampler"):
        module = importlib.import_module(f"structgen.bench.{BENCHMARKS[name][0]}")
        assert callable(module.main)


def test_unknown_or_missing_benchmark_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "no-such"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("structgen bench: unknown benchmark 'no-such' (one of: engine, structured,")
    assert err.count("\n") == 1
    assert main(["bench", "../x"]) == 2
    assert "unknown benchmark '../x'" in capsys.readouterr().err


def test_bench_completion_on_tiny_finishes_every_output_with_the_features_on(tmp_path: Path) -> None:
    """A small run of `structgen bench completion`: the random-weight model never closes its JSON, so every
    output off is cut and every output on is closed and valid."""
    out = tmp_path / "completion.json"
    args = ["--model", "tiny", "--extraction", "3", "--bfcl-per-category", "1", "--max-tokens", "24"]
    args += ["--bfcl-max-tokens", "40", "--max-num-seqs", "8", "--json", str(out)]
    assert main(["bench", "completion", *args]) == 0
    report = json.loads(out.read_text())
    off, on = report["passes"]
    for workload in ("extraction", "bfcl"):
        assert off[workload]["truncated"] == off[workload]["outputs"] - off[workload]["errors"]
        assert on[workload]["truncated"] == 0
        assert (
            on[workload]["valid"]
            == on[workload]["finished"]
            == on[workload]["outputs"] - on[workload]["errors"]
        )
    assert report["throughput_on_over_off"]["extraction"]
