"""The scripts in `examples/`, each run as a subprocess against a real server on the shared SmolLM2 engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle")]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, base_url: str, *args: str) -> list[str]:
    env = {**os.environ, "STRUCTGEN_BASE_URL": base_url}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_extract(base_url: str) -> None:
    summary, document = run_example("extract.py", base_url)
    assert json.loads(document) == {
        "name": "Maria",
        "age": 34,
        "address": {"city": "Lisbon", "country": "Portugal"},
    }
    assert summary == "Maria, 34, from Lisbon (Portugal)"


def test_extract_reports_an_unreachable_server_in_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "extract.py"), "--base-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: cannot reach") and done.stderr.count("\n") == 1


def test_stream_partial(base_url: str) -> None:
    lines = run_example("stream_partial.py", base_url)
    partials = [json.loads(line.removeprefix("partial: ")) for line in lines[:-1]]
    assert lines[-1].startswith("final: ")
    final = json.loads(lines[-1].removeprefix("final: "))
    assert len(partials) >= 3 and partials[-1] == final
    assert 1 <= len(final["ingredients"]) <= 3 and "ancake" in final["dish"]


def test_tool_agent(base_url: str) -> None:
    lines = run_example("tool_agent.py", base_url, "--question", "What is the weather in Paris?")
    calls = [line for line in lines if line.startswith("call: get_weather(")]
    assert calls and "'sky':" in calls[0]
    # The answer may span lines (the model quotes the tool's result): find where it starts.
    assert any(line.startswith(("answer: ", "stopped after 2 steps")) for line in lines[len(calls) :])
