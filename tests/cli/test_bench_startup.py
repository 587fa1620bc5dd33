"""`structgen bench startup`: each measure runs in fresh processes, `--off` switches session 36's start-up parts
(and session 38's packed-weight cache) off in those processes only, and bad arguments exit with a message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from structgen.bench import startup
from structgen.models.gguf_file import open_gguf


def test_a_tiny_run_times_help_serve_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "startup.json"
    # import and engine are the same `_python` as help, with a printed timing; serve is the other path.
    argv = ["--model", "tiny", "--repeats", "1", "--measures", "help,serve,generate", "--json", str(out)]
    assert startup.main(argv) == 0
    result = json.loads(out.read_text())
    medians = result["median_s"]["now"]
    assert set(medians) == {"help", "serve", "first", "generate"}
    assert all(value > 0 for value in medians.values())
    assert medians["serve"] > medians["help"]  # the server loads the engine before it answers
    assert medians["generate"] > medians["help"]  # and so does a one-shot generate, which also answers
    assert "| serve |" in capsys.readouterr().out


def test_a_timing_printed_by_the_child_is_the_measure() -> None:
    assert startup._python("print('SECONDS 0.125')", off=set()) == 0.125


def test_the_off_preambles_put_the_previous_start_up_back() -> None:
    code = (
        "import sys\nimport structgen.structured.validate\n"
        "state = ['rfc3987_syntax.syntax_helpers' in sys.modules, 'torch' in sys.modules]\n"
        "import os\nimport structgen.models.gguf as g\nfrom structgen.config import CacheConfig, EngineConfig\n"
        "print(*state, g.open_gguf.__module__, os.environ.get('STRUCTGEN_PACKED_CACHE'),\n"
        "      CacheConfig(commit_cpu_kv_at_start=False).commit_cpu_kv_at_start,\n"
        "      EngineConfig(pack_cpu_weights_at_start=False).pack_cpu_weights_at_start)\n"
    )

    def state(off: set[str]) -> str:
        done = subprocess.run(
            [sys.executable, "-c", startup.preamble(off) + code], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    assert state(set(startup.OFF_PARTS)) == "True True structgen.bench.startup 0 True True"
    assert state(set()).endswith("None False False")


def test_the_gguf_package_reader_reads_what_structgen_reads(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "Ġc"])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    weights = np.random.default_rng(0).normal(size=(2, 64)).astype(np.float32)
    writer.add_tensor("w", quantize(weights, GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs, ours = startup.gguf_package_reader(tmp_path / "m.gguf"), open_gguf(tmp_path / "m.gguf")
    assert {k: v for k, v in theirs.metadata.items() if not k.startswith("GGUF.")} == ours.metadata
    assert np.array_equal(np.asarray(theirs.tensors[0].data), np.asarray(ours.tensors[0].data))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (["--off", "cache"], "--off takes exports, iri, gguf"),
        (["--measures", "tea"], "--measures help"),
        (["--repeats", "0"], "--repeats >= 1"),
    ],
)
def test_bad_arguments_exit_with_a_message(
    bad: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        startup.main(bad)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
