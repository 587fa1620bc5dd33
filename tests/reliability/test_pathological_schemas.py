"""Pathological specs are refused fast and by name (pre-compile limits, per-backend guards), no schema makes a
backend read a file or fetch a URL, and a compile past its time limit does not keep the compile pool busy."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from structgen.models.registry import resolve_model
from structgen.structured import (
    CompileBusyError,
    CompileTimeoutError,
    InvalidSpecError,
    SchemaLimits,
    StructuredOutputConfig,
    StructuredOutputManager,
    StructuredOutputsParams,
    StructuredSpec,
    TokenizerInfo,
    UnsupportedSchemaError,
    create_backend,
)
from structgen.structured.support import LLGUIDANCE_SUPPORT, XGRAMMAR_SUPPORT, SchemaSupport
from structgen.tokenizer import Tokenizer


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.fixture(scope="module")
def tiny_info() -> TokenizerInfo:
    model_dir = resolve_model("tiny")
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return TokenizerInfo.from_tokenizer(Tokenizer.from_dir(model_dir), vocab_size=vocab_size)


@pytest.fixture(scope="module")
def manager(tiny_info: TokenizerInfo) -> StructuredOutputManager:
    return StructuredOutputManager(tiny_info, StructuredOutputConfig(compile_timeout_s=20.0))


@pytest.mark.parametrize(
    ("schema", "keyword", "limit"),
    [
        (
            {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}},
            "properties",
            "max_properties",
        ),
        ({"enum": [f"value{i}" for i in range(100_000)]}, "enum", "max_enum_values"),
        ({"anyOf": [{"const": i} for i in range(2_000)]}, "anyOf", "max_branches"),
        ({"type": "string", "pattern": "a" * 20_000}, "pattern", "max_pattern_length"),
        (nested(100), "properties", "max_depth"),
    ],
)
def test_limits_refuse_fast_and_by_name(
    schema: dict[str, Any], keyword: str, limit: str, manager: StructuredOutputManager
) -> None:
    spec = StructuredOutputsParams(json=schema).to_spec()
    start = time.perf_counter()
    with pytest.raises(UnsupportedSchemaError) as info:
        manager.compile(spec)
    assert time.perf_counter() - start < 2.0
    assert info.value.keyword == keyword
    assert info.value.path is not None and info.value.path.startswith("#")
    assert f"limits.{limit}" in str(info.value)


def test_a_1000_level_schema_is_refused_not_a_recursion_error(manager: StructuredOutputManager) -> None:
    with pytest.raises(InvalidSpecError, match=r"keyword 'properties' at #/properties/a.*max_depth"):
        StructuredOutputsParams(json=nested(1000))
    # A spec built from text directly (no serialization on the way) reaches the manager's own check.
    text = "".join('{"type":"object","properties":{"a":' for _ in range(1000)) + "{}" + "}}" * 1000
    with pytest.raises(UnsupportedSchemaError, match="max_depth"):
        manager.compile(StructuredSpec("json_schema", text))


def test_limits_are_configurable(tiny_info: TokenizerInfo) -> None:
    strict = StructuredOutputManager(
        tiny_info, StructuredOutputConfig(limits=SchemaLimits(max_enum_values=3))
    )
    with pytest.raises(UnsupportedSchemaError, match="over the limit of 3"):
        strict.compile(StructuredOutputsParams(choice=["a", "b", "c", "d"]).to_spec())
    assert strict.compile(StructuredOutputsParams(choice=["a", "b", "c"]).to_spec()).backend == "llguidance"
    with pytest.raises(ValueError, match="max_depth"):
        SchemaLimits(max_depth=0)


@pytest.mark.parametrize(("support", "n"), [(XGRAMMAR_SUPPORT, 200), (LLGUIDANCE_SUPPORT, 500)])
def test_backends_are_not_tried_on_too_many_optional_properties(support: SchemaSupport, n: int) -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}
    found = support.find_unsupported(wide)
    assert [(f.keyword, f.path) for f in found] == [("properties", "#")]
    required = dict(wide, required=list(wide["properties"]))
    assert support.find_unsupported(required) == []


def test_an_object_llguidance_cannot_serve_is_refused_by_name(manager: StructuredOutputManager) -> None:
    # 1,000 optional properties compile in llguidance, whose parser then fails at the first `{`: found by
    # the reliability benchmark as "grammar rejected sampled tokens" errors.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    with pytest.raises(UnsupportedSchemaError) as info:
        manager.compile(StructuredOutputsParams(json=wide).to_spec())
    assert (info.value.keyword, info.value.path) == ("properties", "#")
    assert "optional properties" in str(info.value)


def test_catastrophic_regex_compiles_fast(manager: StructuredOutputManager) -> None:
    start = time.perf_counter()
    manager.compile(StructuredOutputsParams(regex="(a+)+b").to_spec())
    manager.compile(StructuredOutputsParams(json={"type": "string", "pattern": "^(a|a)*(b+)+$"}).to_spec())
    assert time.perf_counter() - start < 5.0


@pytest.fixture
def listener() -> Any:
    """A loopback TCP listener that records whether anyone connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    yield server
    server.close()


def _connected(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar", "outlines"])
def test_no_backend_reads_files_or_fetches_urls(
    backend_name: str, tiny_info: TokenizerInfo, listener: socket.socket, tmp_path: Any
) -> None:
    target = tmp_path / "secret.json"
    target.write_text('{"type": "integer"}')
    port = listener.getsockname()[1]
    backend = create_backend(backend_name, tiny_info)
    for ref in (f"http://127.0.0.1:{port}/s.json", target.as_uri(), str(target)):
        schema = {"type": "object", "properties": {"x": {"$ref": ref}}, "required": ["x"]}
        spec = StructuredOutputsParams(json=schema).to_spec()
        with pytest.raises(UnsupportedSchemaError) as info:
            backend.compile(spec)
        assert info.value.keyword == "$ref", info.value
        # Even past our support table, straight into the library: no fetch, whatever it answers.
        with contextlib.suppress(Exception):
            backend._compile(spec)
        assert not _connected(listener), f"{backend_name} fetched {ref}"


@pytest.fixture
def stuck_manager(tiny_info: TokenizerInfo, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`make(**config)`: a manager (1 s compile limit, one worker) whose compiles of regexes starting with
    "stuck" hang, like a native call that ignores its time limit, until `release` is set."""
    release = threading.Event()
    managers = []

    def make(**config: Any) -> StructuredOutputManager:
        manager = StructuredOutputManager(
            tiny_info, StructuredOutputConfig(compile_timeout_s=1.0, compile_workers=1, **config)
        )
        original = manager._compile

        def compile_(spec: StructuredSpec, limit: float) -> Any:
            if spec.kind == "regex" and spec.text.startswith("stuck"):
                release.wait(30)
            return original(spec, limit)

        for name in ("xgrammar", "outlines"):  # built now (seconds): only the stuck compiles may be slow
            manager.backend(name)
        monkeypatch.setattr(manager, "_compile", compile_)
        managers.append(manager)
        return manager

    make.release = release  # type: ignore[attr-defined]
    yield make
    release.set()
    for manager in managers:
        manager.shutdown()


def test_timed_out_compiles_do_not_saturate_the_pool(stuck_manager: Any) -> None:
    manager = stuck_manager(max_abandoned_compiles=1)
    # One after the other: each runs (on a fresh pool) and is abandoned at its time limit.
    for i in range(2):
        with pytest.raises(CompileTimeoutError):
            manager.compile(StructuredOutputsParams(regex=f"stuck{i}").to_spec())
    assert manager.num_abandoned == 2 and manager.stats.abandoned == 2
    # More compiles are stuck than allowed: new ones are refused, fast, until some finish.
    start = time.perf_counter()
    with pytest.raises(CompileBusyError):
        manager.compile(StructuredOutputsParams(regex="[0-9]+").to_spec())
    assert time.perf_counter() - start < 1.0
    stuck_manager.release.set()
    deadline = time.monotonic() + 10
    while manager.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.num_abandoned == 0
    assert manager.compile(StructuredOutputsParams(regex="[0-9]+").to_spec()).backend == "llguidance"


def test_one_stuck_compile_leaves_room_for_others(stuck_manager: Any) -> None:
    manager = stuck_manager()
    with pytest.raises(CompileTimeoutError):
        manager.compile(StructuredOutputsParams(regex="stuck").to_spec())
    start = time.perf_counter()
    assert manager.compile(StructuredOutputsParams(regex="[a-z]+").to_spec()).backend == "llguidance"
    assert time.perf_counter() - start < 2.0  # not queued behind the stuck one on the single worker
