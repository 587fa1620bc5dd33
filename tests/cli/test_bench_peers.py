"""`structgen bench peers`: its workload (schemas, prompts), the counting of answers, the ratio table, peer
detection and start/stop hygiene with fake peer scripts, and one end-to-end run of structgen's row on `tiny`.
No real peer is ever started here."""

from __future__ import annotations

import asyncio
import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

from structgen.bench import peers_servers as servers
from structgen.bench.peers import ServerResult, format_ratios, format_table, main, ratios
from structgen.bench.peers_workload import (
    SCHEMAS,
    TEXTS,
    Reply,
    count_structured,
    extraction_requests,
    first_token_s,
    free_requests,
    long_prompt,
    post,
)
from structgen.commands.bench import BENCHMARKS, _load

ROOT = Path(__file__).resolve().parents[2]


# -- the workload ---------------------------------------------------------------------------------------------


def test_every_schema_is_a_strict_json_schema_and_together_they_cover_the_keywords() -> None:
    assert len(SCHEMAS) >= 3
    keywords: set[str] = set()
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False, name
        assert sorted(schema["required"]) == sorted(schema["properties"]), name  # strict: all required
        for prop in schema["properties"].values():
            keywords |= {prop["type"]} | set(prop)
            if prop["type"] == "array":
                assert prop["items"]["type"] == "string"
    assert {"string", "integer", "array", "enum", "pattern"} <= keywords
    # Every kind of note has its schema, and an obviously right answer validates.
    assert {kind for kind, _ in TEXTS} == set(SCHEMAS) and len(TEXTS) >= 16
    order = {"order_id": "KTR-4821", "customer": "Jamal", "items": ["lamp"], "quantity": 3, "status": "paid"}
    jsonschema.validate(order, SCHEMAS["order"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(order | {"order_id": "ktr-4821"}, SCHEMAS["order"])


def test_prompts_are_distinct_and_mix_the_schemas() -> None:
    items = extraction_requests(64)
    contents = [e.messages[0]["content"] for e in items]
    assert len(set(contents)) == 64
    assert {e.kind for e in items[:4]} == set(SCHEMAS)  # any 4 consecutive requests use every schema
    more = [e.messages[0]["content"] for e in extraction_requests(150)]
    assert len(set(more)) == 150 and more[:64] == contents
    free = [m[0]["content"] for m in free_requests(70)]
    assert len(set(free)) == 70
    # The single-stream and warm-up prompts start past the measured ones: none repeats a measured prompt.
    assert free_requests(3, offset=64) == [[{"role": "user", "content": c}] for c in free[64:67]]


def test_long_prompt_is_new_for_every_random_stream_and_about_the_size_asked() -> None:
    a, b = long_prompt(random.Random(1), 1000), long_prompt(random.Random(2), 1000)
    assert a != b and a.splitlines()[0] != b.splitlines()[0]  # different from the very first token
    assert long_prompt(random.Random(1), 1000) == a
    # ~3.15 characters a token (SmolLM2's BPE on these notes): between 900 and 1,024 tokens' worth.
    assert 3000 < len(a) < 3400
    assert len(long_prompt(random.Random(3), 100)) < 450


# -- counting answers -----------------------------------------------------------------------------------------


def test_count_structured_validates_each_finished_output_against_its_own_schema() -> None:
    items = extraction_requests(6)
    assert [e.kind for e in items[:2]] == ["person", "event"]
    person = {"name": "Maria", "age": 34, "city": "Lisbon", "occupation": "biologist", "languages": ["pt"]}
    event = {
        "title": "Planning",
        "kind": "meeting",
        "date": "2025-03-14",
        "duration_minutes": 90,
        "attendees": [],
    }
    replies = [
        Reply(status=200, text=json.dumps(person), finish_reason="stop", completion_tokens=30),
        Reply(
            status=200,
            text=json.dumps(event | {"date": "14 March"}),
            finish_reason="stop",
            completion_tokens=20,
        ),
        Reply(status=200, text='{"order_id": "AB', finish_reason="stop", completion_tokens=5),  # not JSON
        Reply(
            status=200, text='{"name": "Aur', finish_reason="length", completion_tokens=192
        ),  # cut: not counted
        Reply(status=500, error="Unexpected empty grammar stack"),
        Reply(status=None, error="ConnectError: refused"),
    ]
    counts = count_structured(items, replies, wall_s=2.0)
    assert (counts.requests, counts.finished, counts.valid, counts.invalid, counts.errors) == (6, 3, 1, 2, 2)
    assert counts.tokens == 247 and counts.tokens_per_s == pytest.approx(123.5)
    assert [e["schema"] for e in counts.invalid_examples] == ["event", "order"]
    assert "does not match" in counts.invalid_examples[0]["error"]
    assert counts.first_error == "Unexpected empty grammar stack"
    assert counts.samples["person"] == json.dumps(person)
    with pytest.raises(ValueError):  # replies must line up with the requests
        count_structured(items, replies[:5], wall_s=1.0)


def _mock_client(handler: httpx.MockTransport) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://peer", transport=handler)


def test_post_reads_an_answer_and_turns_failures_into_replies() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["model"] == "ok":
            choice = {"message": {"role": "assistant", "content": '{"a": 1}'}, "finish_reason": "stop"}
            usage = {"prompt_tokens": 12, "completion_tokens": 7}
            return httpx.Response(200, json={"choices": [choice], "usage": usage})
        if body["model"] == "500":
            return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})
        raise httpx.ConnectError("refused")

    async def go() -> list[Reply]:
        async with _mock_client(httpx.MockTransport(handler)) as client:
            return [await post(client, "/v1/chat/completions", {"model": m}) for m in ("ok", "500", "down")]

    ok, failed, down = asyncio.run(go())
    assert (ok.status, ok.text, ok.finish_reason, ok.completion_tokens, ok.prompt_tokens) == (
        200, '{"a": 1}', "stop", 7, 12,
    )  # fmt: skip
    assert (failed.status, failed.error, failed.completion_tokens) == (500, "boom", 0)
    assert down.status is None and "ConnectError" in (down.error or "")


def test_first_token_skips_the_role_only_chunk_and_reads_the_prompt_size() -> None:
    events = [
        {"choices": [{"text": "", "finish_reason": None}]},  # role-only / empty: not a token yet
        {"choices": [{"text": " The", "finish_reason": None}]},
        {"choices": [], "usage": {"prompt_tokens": 987, "completion_tokens": 1}},
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    empty = "data: " + json.dumps(events[0]) + "\n\ndata: [DONE]\n\n"

    async def go(text: str) -> tuple[float, int | None]:
        transport = httpx.MockTransport(lambda _: httpx.Response(200, text=text))
        async with _mock_client(transport) as client:
            return await first_token_s(client, {"prompt": "x"})

    seconds, prompt_tokens = asyncio.run(go(body))
    assert seconds >= 0 and prompt_tokens == 987
    with pytest.raises(RuntimeError, match="no token"):
        asyncio.run(go(empty))


# -- the report -----------------------------------------------------------------------------------------------


def _row(server: str, single: float, free: float, wall: float, ttft: float, invalid: int = 0) -> ServerResult:
    structured = {"tokens_per_s": 640 / wall, "wall_s": wall, "finished": 64, "valid": 64 - invalid}
    structured |= {"invalid": invalid, "errors": 0}
    phases = {
        "single": {"tokens_per_s": single, "errors": 0},
        "free": {"tokens_per_s": free, "errors": 0},
        "structured": structured,
        "ttft": {"median_ms": ttft, "errors": []},
    }
    return ServerResult(server=server, status="ok", phases=phases)


def test_ratios_compare_structgen_with_the_best_peer_per_column() -> None:
    results = [
        _row("structgen", single=110.0, free=250.0, wall=20.0, ttft=300.0),
        _row("vllm", single=31.8, free=295.0, wall=23.1, ttft=200.0),
        _row("llamacpp", single=100.6, free=195.0, wall=22.3, ttft=250.0, invalid=1),
        ServerResult(server="other", status="skipped", reason="not installed: no x"),
    ]
    rows = {r["column"]: r for r in ratios(results)}
    assert rows["single tok/s"]["best_peer"] == "llamacpp"
    assert (
        rows["single tok/s"]["ratio"] == pytest.approx(110 / 100.6, abs=1e-3) and rows["single tok/s"]["met"]
    )
    assert rows["free tok/s"]["best_peer"] == "vllm" and rows["free tok/s"]["met"] is False  # 0.85 < 1.25
    assert rows["json wall s"]["best_peer"] == "llamacpp"  # lower is better
    assert (
        rows["json wall s"]["ratio"] == pytest.approx(20 / 22.3, abs=1e-3)
        and rows["json wall s"]["met"] is False
    )
    assert rows["TTFT ms"]["best_peer"] == "vllm" and rows["TTFT ms"]["met"] is None  # no target
    assert rows["json invalid"]["met"] is True
    text = format_ratios(list(rows.values()))
    assert "1.09x  vs llamacpp" in text and "MISSED" in text and "target >= 1.25x" in text
    table = format_table(results)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["server", "single", "tok/s"] and len(lines) == 6
    assert "64/63 (1 BAD)" in lines[4] and lines[5] == "other      skipped: not installed: no x"


def test_a_peer_with_failed_requests_does_not_set_the_bar_and_missing_peers_give_no_ratio() -> None:
    fast_but_broken = _row("vllm", single=1000.0, free=1000.0, wall=1.0, ttft=1.0)
    fast_but_broken.phases["structured"]["errors"] = 64
    results = [
        _row("structgen", 10.0, 100.0, 30.0, 400.0),
        fast_but_broken,
        _row("llamacpp", 9.0, 80.0, 40.0, 500.0),
    ]
    rows = {r["column"]: r for r in ratios(results)}
    assert rows["json wall s"]["best_peer"] == "llamacpp" and rows["json tok/s"]["best_peer"] == "llamacpp"
    assert rows["free tok/s"]["best_peer"] == "vllm"  # its free phase was clean
    assert "1!" in format_table(results).splitlines()[3]  # flagged in the table
    alone = ratios([_row("structgen", 10.0, 100.0, 30.0, 400.0, invalid=2)])
    assert all(r["ratio"] is None for r in alone) and alone[-1]["met"] is False
    assert format_ratios(alone).count("(no peer ran)") == 5


# -- peers: detection, a failing start, cleanup ---------------------------------------------------------------


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def peers_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "peers-home"
    home.mkdir()
    monkeypatch.setenv("PEERS_DIR", str(home))
    monkeypatch.delenv("PEER_VLLM_VENV", raising=False)
    monkeypatch.delenv("PEER_LLAMACPP_BIN", raising=False)
    return home


def test_peer_detection_needs_the_script_the_install_and_a_model(tmp_path: Path, peers_home: Path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    options = servers.Options(peers_dir=scripts, gguf=tmp_path / "m.gguf", vllm_model=tmp_path)
    assert servers.unavailable("structgen", options) is None
    assert "no " + str(scripts / "vllm_serve.sh") in (servers.unavailable("vllm", options) or "")
    for name, script in servers.SCRIPTS.items():
        _executable(scripts / script)
        assert (servers.unavailable(name, options) or "").startswith(f"not installed: no {peers_home}")
    _executable(peers_home / "vllm-venv" / "bin" / "vllm")
    _executable(peers_home / "llamacpp" / "bin" / "llama-server")
    assert servers.unavailable("vllm", options) is None and servers.unavailable("llamacpp", options) is None
    tiny = servers.Options(model="tiny", peers_dir=scripts)
    assert "no GGUF for model 'tiny'" in (servers.unavailable("llamacpp", tiny) or "")


def _fake_llamacpp(tmp_path: Path, peers_home: Path, body: str) -> list[str]:
    scripts = tmp_path / "scripts"
    _executable(scripts / "llamacpp_serve.sh", "#!/usr/bin/env bash\n" + body)
    _executable(peers_home / "llamacpp" / "bin" / "llama-server")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    gguf = tmp_path / "m.gguf"
    return [
        "--servers",
        "llamacpp",
        "--peers-dir",
        str(scripts),
        "--gguf",
        str(gguf),
        "--log-dir",
        str(tmp_path),
    ]


def test_a_peer_that_fails_to_start_is_reported_with_its_log(
    tmp_path: Path, peers_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _fake_llamacpp(tmp_path, peers_home, 'echo "error: bind failed on port $2" >&2\nexit 1\n')
    out = tmp_path / "r.json"
    assert main([*args, "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "llamacpp: FAILED to start: llamacpp_serve.sh exited with status 1" in printed
    assert "error: bind failed on port" in printed
    (row,) = json.loads(out.read_text())["servers"]
    assert row["status"] == "failed" and row["phases"] == {}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_started_peer_that_does_not_answer_is_stopped(
    tmp_path: Path, peers_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The script starts a "server" in its own process group (as the real ones do) that never listens.
    pid_file = tmp_path / "pid"
    body = f"setsid sleep 300 >/dev/null 2>&1 </dev/null &\necho $! > {pid_file}\necho $!\n"
    args = _fake_llamacpp(tmp_path, peers_home, body)
    assert main([*args, "--skip-ttft"]) == 1
    assert "GET /v1/models failed" in capsys.readouterr().out
    assert not _running(int(pid_file.read_text()))


# -- end to end -----------------------------------------------------------------------------------------------


def test_structgen_row_end_to_end_on_tiny(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    empty = tmp_path / "no-peers"
    empty.mkdir()
    out = tmp_path / "peers.json"
    logs = tmp_path / "logs" / "new"  # not there yet: the benchmark makes it
    n, max_tokens = 4, 6
    code = main(
        ["--model", "tiny", "--servers", "structgen,vllm,llamacpp", "--peers-dir", str(empty),
         "--structgen-args", "--device cpu --kv-cache-tokens 2048", "--requests", str(n), "--concurrency", "2",
         "--max-tokens", str(max_tokens), "--single-requests", "2", "--single-max-tokens", "5",
         "--ttft-tokens", "64", "--start-timeout", "180", "--log-dir", str(logs), "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "vllm: skipped (not installed" in printed and "llamacpp: skipped (not installed" in printed
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and "load average" in report["uptime"] and report["date"]
    ours, vllm, llamacpp = report["servers"]
    assert (vllm["status"], llamacpp["status"]) == ("skipped", "skipped")
    assert ours["status"] == "ok" and ours["model_id"] == "tiny"
    phases = ours["phases"]
    # ignore_eos: every free answer is exactly max_tokens long.
    assert phases["single"]["tokens"] == 2 * 5 and phases["single"]["errors"] == 0
    assert phases["free"]["tokens"] == n * max_tokens and phases["free"]["tokens_per_s"] > 0
    s = phases["structured"]
    assert s["requests"] == n and s["errors"] == 0 and s["finished"] <= n
    assert s["valid"] + s["invalid"] == s["finished"] and s["invalid"] == 0
    assert 0 < s["tokens"] <= n * max_tokens
    ttft = phases["ttft"]
    assert len(ttft["samples_ms"]) == 3 and ttft["errors"] == [] and ttft["median_ms"] > 0
    assert all(isinstance(t, int) and t > 30 for t in ttft["prompt_tokens"])
    assert [r["column"] for r in report["ratios"]][-1] == "json invalid"
    assert "structgen " in printed and "(no peer ran)" in printed
    assert isinstance(ours["pid"], int) and not _running(ours["pid"])  # stopped, children and all
    assert Path(ours["log"]).parent == logs and Path(ours["log"]).stat().st_size > 0


def test_peers_is_a_registered_benchmark_with_a_wrapper_script() -> None:
    assert BENCHMARKS["peers"][0] == "peers" and callable(_load("peers"))
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0 and "--servers" in result.stdout and "--skip-ttft" in result.stdout
