"""`structgen bench server` on `tiny`: the offline and HTTP sides run the same structured requests on one engine,
built and run offline on the step thread (one OpenMP team in the process)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from structgen.bench import server


def test_both_sides_generate_the_same_tokens_on_one_engine(tmp_path: Path) -> None:
    threads_before = torch.get_num_threads()
    # Other tests' engines (the session's shared SmolLM2 one) may be alive in this process: only the bench's own
    # step thread must be gone.
    engines_before = set(_engine_threads())
    out = tmp_path / "server.json"
    try:
        assert (
            server.main(["--model", "tiny", "--requests", "4", "--max-tokens", "4", "--json", str(out)]) == 0
        )
    finally:
        torch.set_num_threads(threads_before)
    result = json.loads(out.read_text())
    assert result["offline"]["tokens"] == result["http"]["tokens"] > 0  # greedy: the same outputs both ways
    assert result["server_overhead_ratio"] > 0
    assert not set(_engine_threads()) - engines_before  # shut down


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "structgen-engine"]
