"""Security (issue 10, item 5), on `tiny`: with an API key every route but `/health` needs it (the routes are
enumerated from the app, so a new one cannot slip through); `structgen serve` binds loopback by default; a
`$ref` to a file or URL in a schema or a tool definition is refused with a 400 without the server opening the
file or connecting anywhere. Request size limits (413) are covered by `tests/server/test_limits.py`."""

from __future__ import annotations

import ipaddress
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastapi.routing
import pytest
from reliability_helpers import USER, assert_error, call, keyed_app

from structgen.cli import _build_parser

OPEN_ROUTES = {("/health", "GET")}
# What the enumeration must at least find, so that a broken enumeration cannot pass by finding nothing.
EXPECTED_ROUTES = {
    ("/metrics", "GET"),
    ("/openapi.json", "GET"),
    ("/v1/models", "GET"),
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"),
    ("/v1/responses/{response_id}", "DELETE"),
}


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(path, method) of every HTTP route of `app`, routers included in it too."""
    # FastAPI >= 0.16x keeps included routers as objects of their own; `iter_route_contexts` flattens them.
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    routes = [context.route for context in flatten(app.routes)] if flatten else list(app.routes)
    found = set()
    for route in routes:
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((route.path, method))
    return found


@pytest.fixture(scope="module")
def app(server_tiny_engine: Any) -> Any:
    return keyed_app(server_tiny_engine)


def test_every_route_but_health_needs_the_key(app: Any) -> None:
    routes = app_routes(app)
    assert routes >= EXPECTED_ROUTES | OPEN_ROUTES, routes
    for path, method in sorted(routes - OPEN_ROUTES):
        for headers in (None, {"Authorization": "Bearer wrong-key"}, {"Authorization": "test-key"}):
            response = call(app, method, path, headers=headers, json={} if method == "POST" else None)
            assert_error(response, 401, "API key")
    assert call(app, "GET", "/health", headers=None).json() == {"status": "ok"}
    # With the key the closed routes answer (a GET here, an empty POST body a 400, an id no object has a 404:
    # not a 401).
    for path, method in sorted(routes - OPEN_ROUTES):
        expected = 404 if "{" in path else 200 if method == "GET" else 400
        assert call(app, method, path, json={} if method == "POST" else None).status_code == expected, path


def test_serve_binds_loopback_by_default() -> None:
    args = _build_parser().parse_args(["serve"])
    assert ipaddress.ip_address(args.host).is_loopback


# -- no file reads, no fetches ----------------------------------------------------------------------------------

_watching: list[tuple[str, Any]] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _watching is not None and event in ("open", "socket.connect", "urllib.Request"):
        _watching.append((event, args))


@pytest.fixture
def outside_access() -> Iterator[list[tuple[str, Any]]]:
    """The files opened and the addresses connected to (audit events, every thread) while the test runs."""
    global _watching
    if not getattr(sys, "_structgen_security_audit", False):  # an audit hook cannot be removed: add it once
        sys.addaudithook(_audit)
        sys._structgen_security_audit = True  # type: ignore[attr-defined]
    _watching = []
    try:
        yield _watching
    finally:
        _watching = None


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid schema on disk: a server that followed `file:` refs would compile it happily."""
    path = tmp_path_factory.mktemp("refs") / "schema.json"
    path.write_text(json.dumps({"type": "integer"}))
    return path


def _with_ref(ref: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}


PLACES = {
    "response_format": lambda schema: {
        "messages": USER,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    },
    "tool parameters": lambda schema: {
        "messages": USER,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
        "tool_choice": "required",
    },
    "guided_json": lambda schema: {"messages": USER, "guided_json": schema},
    "a grammar's %json": lambda schema: {
        "messages": USER,
        "guided_grammar": f"start: %json {json.dumps(schema)}",
    },
}
REFS = [
    "file://{file}",
    "file:{file}",
    "{file}",
    "http://192.0.2.1/schema.json",
    "https://192.0.2.1/s.json#/x",
]


@pytest.mark.parametrize("place", PLACES)
def test_refs_to_files_and_urls_are_refused(
    app: Any, place: str, schema_file: Path, outside_access: list[tuple[str, Any]]
) -> None:
    for ref in REFS:
        body = PLACES[place](_with_ref(ref.format(file=schema_file))) | {"max_tokens": 4}
        response = call(app, "POST", "/v1/chat/completions", json=body)
        assert_error(response, 400)
    opened = [args for event, args in outside_access if event == "open" and str(schema_file) in str(args[0])]
    assert not opened, opened
    connects = [args for event, args in outside_access if event != "open"]
    remote = [args for args in connects if not _loopback(args)]
    assert not remote, remote


def test_grammar_imports_are_not_followed(
    app: Any, schema_file: Path, outside_access: list[tuple[str, Any]]
) -> None:
    grammar_file = schema_file.with_name("secret_rules.lark")
    grammar_file.write_text('x: "secret"\n')
    for line in (f"%import {grammar_file} (x)", "%import .secret_rules (x)"):
        body = {"messages": USER, "guided_grammar": f"start: x\n{line}\n", "max_tokens": 4}
        assert_error(call(app, "POST", "/v1/chat/completions", json=body), 400, "grammar")
    reads = [
        args
        for event, args in outside_access
        if event == "open" and Path(str(args[0])).name == grammar_file.name and "w" not in str(args[1])
    ]
    assert not reads, reads


def _loopback(args: tuple[Any, ...]) -> bool:
    address = args[1] if len(args) > 1 else None
    if isinstance(address, tuple) and address:
        try:
            return ipaddress.ip_address(address[0]).is_loopback
        except ValueError:
            return False
    return isinstance(address, str)  # a unix socket path: local
