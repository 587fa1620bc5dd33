"""`structgen bench shared-prefixes` on `tiny`: the prefix cache serves the shared parts, `--off` switches that
off for the run only, and bad arguments exit with a message."""

from __future__ import annotations

import json

import pytest

from structgen.bench.shared_prefixes import main
from structgen.engine import scheduler

SMALL = ["--model", "tiny", "--kv-cache-tokens", "16384", "--contexts", "1", "--context-tokens", "48"]


def test_scoring_reads_the_contexts_from_the_cache_unless_switched_off(tmp_path) -> None:
    before = scheduler.cached_scored_prefix, scheduler.InflightPrefixes
    results = {}
    for off in ("scores,inflight", ""):
        out = tmp_path / f"{off or 'on'}.json"
        # A context's answers together: the first scores the context, the others wait for it and read it.
        argv = ["scoring", *SMALL, "--together", "--off", off, "--json", str(out)]
        assert main(argv) == 0
        results[off] = json.loads(out.read_text())
        assert (scheduler.cached_scored_prefix, scheduler.InflightPrefixes) == before  # put back
    off, on = results["scores,inflight"], results[""]
    assert off["scored_tokens"] == on["scored_tokens"] == 4 * (48 + 12 - 1)
    assert off["hit_rate"] == 0.0 and on["hit_rate"] > 0.5


def test_a_burst_reads_its_shared_prefix_from_the_cache(tmp_path, capsys) -> None:
    out = tmp_path / "burst.json"
    assert main(["burst", "--model", "tiny", "--kv-cache-tokens", "16384", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["bursts"]) == 3 and result["hit_rate"] > 0.8  # 31 of 32 read the 256 shared tokens
    assert "burst 2: all first tokens in" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["scoring", "--off", "cache"], "--off takes scores, inflight"),
        (["scoring", "--contexts", "0"], "--contexts >= 1"),
        (["other"], "invalid choice: 'other'"),
    ],
)
def test_bad_arguments_exit_with_a_message(bad: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
