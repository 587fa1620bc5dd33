"""`structgen bench cpu-linears` times each kernel this CPU has on small products and refuses bad arguments."""

from __future__ import annotations

import json

import pytest
from structgen.kernels import cpu_ops, cpu_woq

from structgen.bench.cpu_linears import main


def test_each_kernel_is_timed_against_the_dense_one(tmp_path, capsys) -> None:
    if not cpu_ops.available():  # (built on first use; every CI machine has a compiler)
        pytest.skip("no native CPU kernels on this machine")
    out = tmp_path / "linears.json"
    argv = [
        "--rows",
        "1,5",
        "--shapes",
        "64x64,32x96",
        "--layers",
        "2",
        "--lm-head",
        "64x32",
        "--repeats",
        "2",
    ]
    assert main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["kernels"][0] == "fp32 dense"
    if cpu_woq.avx2_gemv_available():
        assert {"int16-x GEMV (AVX2)", "int8-x (AVX2)"} <= set(results["kernels"])
    for rows in ("1", "5"):
        assert set(results["ms"][rows]) == set(results["kernels"])
        assert all(ms > 0 for ms in results["ms"][rows].values())
    printed = capsys.readouterr().out
    assert "| rows | fp32 dense |" in printed and "| 5 |" in printed


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (["--rows", "0"], "must be positive"),
        (["--layers", "0"], "must be positive"),
        (["--rows", "x"], "--rows takes integers"),
        (["--shapes", "64x48"], "multiples of 32, got 64x48"),
        (["--lm-head", "64"], "N x K pairs"),
    ],
)
def test_bad_arguments_exit_with_a_message(bad: list[str], said: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err
