"""A script that creates a tensor-parallel `LLM` at import time, without an `if __name__ == "__main__":` guard:
the spawned worker imports it again, and the script fails with a message saying what to do, not an EOFError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 120.0  # two processes import torch on a shared 2-core machine; the worker never loads the model

UNGUARDED_SCRIPT = """
import torch
from structgen import LLM

torch.set_num_threads(1)
llm = LLM(model="tiny", device="cpu", tensor_parallel_size=2, kv_cache_tokens=256)
print("created", flush=True)
"""


def test_an_unguarded_script_is_told_to_add_the_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"  # a file: spawn re-imports a main module only when it has a path
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode != 0, done.stdout
    assert "created" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("structgen.distributed.parallel_state.TensorParallelError: "), done.stderr
    assert 'if __name__ == "__main__":' in last and "Safe importing of main module" in last, last
    assert "EOFError" not in done.stderr
    # The worker said why it stopped, once, instead of loading the model and spawning workers of its own.
    assert done.stderr.count("a tensor-parallel worker stopped") == 1, done.stderr
