"""`structgen run-batch`: an OpenAI batch file through the in-process server on `tiny` — mixed endpoints, structured
requests, malformed lines and requests the server refuses (each reported in place), input order, stdin / stdout,
exit codes; and the line parsing and bounded concurrency on their own."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cli_helpers import write_jsonl

from structgen.cli import main
from structgen.commands.batch_file import BatchResult, LineError, parse_line
from structgen.commands.run_batch import run_lines

# llguidance alone: building the fallback backends for a 100k vocabulary takes long on a shared CPU.
ENGINE = ["--model", "tiny", "--kv-cache-tokens", "2048", "--max-num-seqs", "8"]
ENGINE += ["--structured-backend", "llguidance", "--no-progress"]
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Give me a number."}]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def line(custom_id: str, url: str, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


# (custom_id, the line) in input order; the expectations are in the tests below.
MIXED = [
    line(
        "chat-schema",
        CHAT,
        {"messages": USER, "max_tokens": 16, "response_format": json_schema_format(SCHEMA)},
    ),
    line("completion", "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 4}),
    "this line is not JSON",
    line("too-hot", CHAT, {"messages": USER, "temperature": 5}),
    line("bad-schema", CHAT, {"messages": USER, "response_format": json_schema_format({"type": "wrong"})}),
    line(
        "regex",
        "/v1/completions",
        {"prompt": "digits", "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}"}},
    ),
    {"method": "POST", "url": CHAT, "body": {"messages": USER}},
    line("embeddings", "/v1/embeddings", {"input": "x"}),
    line("streamed", CHAT, {"messages": USER, "stream": True}),
    line("completion", CHAT, {"messages": USER}),  # a custom_id used before
    line("other-model", CHAT, {"model": "gpt-4o", "messages": USER, "max_tokens": 2}),
    line(
        "json-object", CHAT, {"messages": USER, "max_tokens": 12, "response_format": {"type": "json_object"}}
    ),
    line("responses", "/v1/responses", {"input": "Say hi.", "max_output_tokens": 4}),
]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, Any]], str]:
    """One run over `MIXED` (the model loads once): the exit code, the output lines and stderr."""
    folder = tmp_path_factory.mktemp("mixed")
    requests = write_jsonl(folder / "requests.jsonl", MIXED)
    # A blank line is no request: it gets no output line.
    requests.write_text(requests.read_text() + "\n  \n")
    results = folder / "results.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        stderr = io.StringIO()
        patch.setattr("sys.stderr", stderr)
        code = main(["run-batch", "-i", str(requests), "-o", str(results), *ENGINE])
    return code, [json.loads(x) for x in results.read_text().splitlines()], stderr.getvalue()


def by_id(outputs: list[dict[str, Any]], custom_id: str) -> dict[str, Any]:
    (found,) = [o for o in outputs if o["custom_id"] == custom_id and o["response"] is not None]
    return found


def test_one_output_line_per_input_line_in_input_order(mixed: Any) -> None:
    code, outputs, _ = mixed
    assert code == 1  # some lines failed
    expected = [x["custom_id"] if isinstance(x, dict) and "custom_id" in x else None for x in MIXED]
    assert [o["custom_id"] for o in outputs] == expected
    ids = [o["id"] for o in outputs]
    assert all(re.fullmatch(r"batch_req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)
    for output in outputs:
        assert set(output) == {"id", "custom_id", "response", "error"}
        assert (output["response"] is None) != (output["error"] is None)


def test_chat_and_completions_answer_as_the_server_does(mixed: Any) -> None:
    _, outputs, _ = mixed
    chat = by_id(outputs, "chat-schema")["response"]
    assert chat["status_code"] == 200 and chat["request_id"] == chat["body"]["id"]
    assert chat["body"]["object"] == "chat.completion" and chat["body"]["model"] == "tiny"
    choice = chat["body"]["choices"][0]
    # tiny never closes its JSON by itself: budget closing finishes it, valid under the schema.
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert choice["structured"]["valid"] is True and choice["finish_reason"] == "stop"
    completion = by_id(outputs, "completion")["response"]
    assert completion["status_code"] == 200 and completion["body"]["object"] == "text_completion"
    assert completion["body"]["usage"]["completion_tokens"] == 4
    regex = by_id(outputs, "regex")["response"]["body"]
    assert re.fullmatch(r"[0-9]{3}", regex["choices"][0]["text"])
    json_object = by_id(outputs, "json-object")["response"]["body"]
    assert isinstance(json.loads(json_object["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(
    ("custom_id", "status", "param", "code", "words"),
    [
        ("too-hot", 400, "temperature", "invalid_request", "less than or equal to 2"),
        ("bad-schema", 400, "response_format", "unsupported_schema", 'got "wrong"'),
        ("other-model", 404, "model", "model_not_found", "'gpt-4o' does not exist"),
    ],
)
def test_refused_requests_keep_their_status_and_openai_error_body(
    mixed: Any, custom_id: str, status: int, param: str, code: str, words: str
) -> None:
    _, outputs, _ = mixed
    output = by_id(outputs, custom_id)
    assert output["error"] is None and output["response"]["status_code"] == status
    assert re.fullmatch(r"req_[0-9a-f]{32}", output["response"]["request_id"])
    error = output["response"]["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code) and words in error["message"]


def test_malformed_lines_are_reported_in_place(mixed: Any) -> None:
    _, outputs, _ = mixed
    errors = [(o["custom_id"], o["error"]["code"]) for o in outputs if o["error"] is not None]
    assert errors == [
        (None, "invalid_json_line"),
        (None, "missing_required_parameter"),
        ("embeddings", "invalid_url"),
        ("streamed", "stream_not_supported"),
        ("completion", "duplicate_custom_id"),
    ]
    assert all(o["error"]["message"] for o in outputs if o["error"] is not None)


def test_a_responses_line_is_sent_to_the_app(mixed: Any) -> None:
    """/v1/responses is no line error: the app answers it (404 until it serves the route)."""
    _, outputs, _ = mixed
    output = by_id(outputs, "responses")
    assert output["error"] is None and output["response"]["status_code"] in (200, 404)


def test_summary_counts_every_line(mixed: Any) -> None:
    _, outputs, stderr = mixed
    succeeded = sum(1 for o in outputs if o["response"] is not None and o["response"]["status_code"] == 200)
    summary = stderr.strip().splitlines()[-1]
    expected = f"{len(MIXED)} lines, {succeeded} succeeded, {len(MIXED) - succeeded} failed in "
    assert summary.startswith(f"structgen run-batch: {expected}"), summary
    assert re.search(r"requests/s, [0-9.]+ output tok/s\)$", summary)


def test_stdin_to_stdout_all_succeeded_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        line("a", "/v1/completions", {"prompt": "One", "max_tokens": 2}),
        line("b", CHAT, {"messages": USER, "max_completion_tokens": 3, "n": 2}),
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in rows)))
    assert main(["run-batch", "-i", "-", "-o", "-", *ENGINE, "--max-concurrency", "1"]) == 0
    captured = capsys.readouterr()
    outputs = [json.loads(x) for x in captured.out.splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"]) for o in outputs] == [("a", 200), ("b", 200)]
    assert len(outputs[1]["response"]["body"]["choices"]) == 2
    # stderr is no terminal here: no progress bar, only the summary.
    assert captured.err.startswith("structgen run-batch: 2 lines, 2 succeeded, 0 failed in ")
    assert captured.err.count("\n") == 1


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.jsonl"
    missing = tmp_path / "nope.jsonl"
    assert main(["run-batch", "-i", str(missing), "-o", str(results), "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err == f"structgen run-batch: cannot read {missing}: No such file or directory\n"
    assert not results.exists()
    requests = write_jsonl(tmp_path / "requests.jsonl", [line("a", CHAT, {"messages": USER})])
    assert main(["run-batch", "-i", str(requests), "-o", str(tmp_path / "no" / "dir.jsonl")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(requests), "-o", str(results), "--max-concurrency", "0"]) == 2
    assert capsys.readouterr().err == "structgen run-batch: --max-concurrency must be at least 1\n"
    with pytest.raises(SystemExit) as exited:
        main(["run-batch", "-o", str(results)])  # no -i
    assert exited.value.code == 2
    assert "the following arguments are required: -i/--input" in capsys.readouterr().err


# -- parts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("[1, 2]", "invalid_json_line"),
        ('{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}', "invalid_custom_id"),
        ('{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}', "invalid_custom_id"),
        ('{"custom_id": "x", "url": "/v1/completions", "body": {}}', "missing_required_parameter"),
        ('{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_method"),
        ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": [1]}', "invalid_body"),
        ('{"custom_id": "x", "method": "POST", "url": "v1/completions", "body": {}}', "invalid_url"),
    ],
)
def test_parse_line_names_the_problem(text: str, code: str) -> None:
    parsed = parse_line(text, set())
    assert isinstance(parsed, LineError) and parsed.code == code and parsed.message


def test_parse_line_accepts_each_url_and_tracks_custom_ids() -> None:
    seen: set[str] = set()
    for i, url in enumerate(("/v1/chat/completions", "/v1/completions", "/v1/responses")):
        parsed = parse_line(json.dumps(line(f"id-{i}", url, {"stream": False})), seen)
        assert not isinstance(parsed, LineError) and (parsed.url, parsed.body) == (url, {"stream": False})
    assert seen == {"id-0", "id-1", "id-2"}


def test_at_most_window_requests_in_flight_and_results_in_order() -> None:
    """Admission control never sees more than the window: a stand-in app notes how many requests it holds at once
    and answers the later lines first."""
    in_flight = most = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal in_flight, most
        body = json.loads((await receive())["body"])
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01 * (10 - body["n"]))
        in_flight -= 1
        answer = json.dumps({"id": f"x-{body['n']}", "usage": {"completion_tokens": body["n"]}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    lines = [json.dumps(line(f"c{n}", "/v1/completions", {"n": n})) for n in range(10)]
    emitted: dict[int, BatchResult] = {}
    asyncio.run(run_lines(app, lines, window=3, emit=emitted.__setitem__))
    assert most == 3
    assert sorted(emitted) == list(range(10))
    assert [emitted[i].record["response"]["request_id"] for i in range(10)] == [f"x-{n}" for n in range(10)]
    assert all(r.ok for r in emitted.values()) and sum(r.output_tokens for r in emitted.values()) == 45


def test_run_batch_answers_a_responses_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A /v1/responses line, structured through `text.format`, is answered by the Responses route; its
    `usage.output_tokens` counts in the summary."""
    body = {"input": "Give me a number.", "max_output_tokens": 16}
    body["text"] = {"format": {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}}
    requests = write_jsonl(tmp_path / "requests.jsonl", [line("resp", "/v1/responses", body)])
    results = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(requests), "-o", str(results), *ENGINE]) == 0
    (output,) = [json.loads(x) for x in results.read_text().splitlines()]
    response = output["response"]
    assert output["error"] is None and response["status_code"] == 200
    answer = response["body"]
    assert answer["object"] == "response" and answer["status"] == "completed"
    assert response["request_id"] == answer["id"] and answer["id"].startswith("resp_")
    (message,) = [item for item in answer["output"] if item["type"] == "message"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), SCHEMA)
    assert answer["usage"]["output_tokens"] > 0
    err = capsys.readouterr().err
    assert err.startswith("structgen run-batch: 1 lines, 1 succeeded, 0 failed in ")
    assert float(re.search(r"([0-9.]+) output tok/s", err).group(1)) > 0
