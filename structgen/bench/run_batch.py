"""`structgen run-batch` vs the HTTP server on the same structured requests.

`--requests` JSON Schema extraction requests (the workload of `structgen bench completion`: three strict schemas,
prompts from seeded word lists; greedy, `max_tokens` 128) go through `structgen run-batch` (the CLI in a child
process, as users run it) and through `structgen serve` (a child process on a free loopback port, every request in
flight at once from an async httpx client, plain answers), with the same model and engine flags. Each pass runs
both, each in a fresh process; the side that goes first alternates from pass to pass. Both are timed from the
first request to the last answer: run-batch's summary line gives its time (model load excluded), the server's
clock starts once `/health` answers.

    python benchmarks/run_batch.py [--model smollm2-135m] [--requests 200] [--max-tokens 128] [--repeat 3]
        [--max-num-seqs 256] [--kv-cache-tokens 65536] [--threads N] [--json OUT]

Reports requests/s and output tokens/s of each side (medians over the passes) and the ratio run-batch / server
(target >= 1.0). Every answer must succeed and validate against its schema; exit 1 when one does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from structgen.bench.extraction_workload import extraction_requests

SIDES = ("run_batch", "server")
# run-batch's summary line: "... in 12.34 s (16.21 requests/s, ...)".
_SUMMARY_WALL = re.compile(r"failed in ([0-9.]+) s \(")


def request_bodies(count: int, *, model: str, max_tokens: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(chat body, its schema) for each request."""
    bodies = []
    for item in extraction_requests(count):
        body = {
            "model": model,
            "messages": item.messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "extraction", "schema": item.schema, "strict": True},
            },
        }
        bodies.append((body, item.schema))
    return bodies


def check_answers(answers: list[tuple[int, Any]], schemas: list[dict[str, Any]]) -> dict[str, int]:
    """Counts of (status, body) answers: succeeded, valid under their schema, and output tokens."""
    import jsonschema

    succeeded = valid = tokens = 0
    for (status, body), schema in zip(answers, schemas, strict=True):
        if status != 200:
            continue
        succeeded += 1
        tokens += body["usage"]["completion_tokens"]
        try:
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return {"succeeded": succeeded, "valid": valid, "tokens": tokens}


def run_batch_side(
    bodies: list[tuple[dict[str, Any], dict[str, Any]]], engine_args: list[str], folder: Path
) -> dict[str, Any]:
    requests = folder / "requests.jsonl"
    results = folder / "results.jsonl"
    with requests.open("w", encoding="utf-8") as out:
        for i, (body, _) in enumerate(bodies):
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            out.write(json.dumps(line) + "\n")
    command = [sys.executable, "-m", "structgen.cli", "run-batch", "-i", str(requests), "-o", str(results)]
    done = subprocess.run(
        [*command, "--no-progress", *engine_args],
        capture_output=True,
        text=True,
        env=_child_env(),
        check=False,
    )
    found = _SUMMARY_WALL.search(done.stderr)
    if found is None:
        raise RuntimeError(f"run-batch printed no summary (exit {done.returncode}):\n{done.stderr[-4000:]}")
    lines = [json.loads(x) for x in results.read_text(encoding="utf-8").splitlines()]
    answers = [
        (x["response"]["status_code"], x["response"]["body"]) if x["response"] else (0, None) for x in lines
    ]
    return {"wall_s": float(found.group(1)), **check_answers(answers, [s for _, s in bodies])}


def server_side(
    bodies: list[tuple[dict[str, Any], dict[str, Any]]], model: str, engine_args: list[str], folder: Path
) -> dict[str, Any]:
    from structgen.bench import peers_servers

    # As many waiting requests as the workload sends at once: the server must not answer 429.
    extra = [*engine_args, "--max-waiting-requests", str(max(512, len(bodies)))]
    options = peers_servers.Options(model=model, extra_args={"structgen": extra}, log_dir=folder)
    launch = peers_servers.start("structgen", options)
    try:
        wall, answers = asyncio.run(_send_all(launch.url, [b for b, _ in bodies]))
    finally:
        peers_servers.stop(launch)
    return {"wall_s": wall, **check_answers(answers, [s for _, s in bodies])}


async def _send_all(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[tuple[int, Any]]]:
    import httpx

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, Any]:
        response = await client.post("/v1/chat/completions", json=body)
        return response.status_code, response.json()

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(one(client, b) for b in bodies))
        return time.perf_counter() - start, list(answers)


def _child_env() -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false"}


def _rates(result: dict[str, Any], requests: int) -> dict[str, Any]:
    wall = max(result["wall_s"], 1e-9)
    return {
        **result,
        "wall_s": round(result["wall_s"], 3),
        "requests_per_s": round(requests / wall, 3),
        "tokens_per_s": round(result["tokens"] / wall, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or a local path")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="passes; the side that goes first alternates")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="for both sides (serve's default)")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536, help="for both sides")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both (default: torch's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.repeat < 1:
        ap.error("--requests and --repeat must be at least 1")

    engine_args = ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.threads is not None:
        engine_args += ["--threads", str(args.threads)]
    bodies = request_bodies(args.requests, model=args.model, max_tokens=args.max_tokens)
    passes = []
    with tempfile.TemporaryDirectory(prefix="structgen-bench-run-batch-") as tmp:
        for i in range(args.repeat):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            results: dict[str, Any] = {"order": list(order)}
            for side in order:
                folder = Path(tmp) / f"pass{i}-{side}"
                folder.mkdir()
                if side == "run_batch":
                    raw = run_batch_side(bodies, ["--model", args.model, *engine_args], folder)
                else:
                    raw = server_side(bodies, args.model, engine_args, folder)
                results[side] = _rates(raw, args.requests)
                row = results[side]
                print(
                    f"pass {i + 1} {side:9} {row['requests_per_s']:8.2f} req/s {row['tokens_per_s']:9.1f} tok/s "
                    f"{row['valid']}/{args.requests} valid",
                    file=sys.stderr,
                )
            passes.append(results)
    summary = {side: _median_side(passes, side) for side in SIDES}
    report = {
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "engine_args": engine_args,
        "passes": passes,
        **summary,
        "ratio_requests_per_s": round(
            summary["run_batch"]["requests_per_s"] / summary["server"]["requests_per_s"], 3
        ),
        "ratio_tokens_per_s": round(
            summary["run_batch"]["tokens_per_s"] / summary["server"]["tokens_per_s"], 3
        )
        if summary["server"]["tokens_per_s"]
        else None,
    }
    failures = [
        f"pass {i + 1} {side}: {p[side]['succeeded']} succeeded, {p[side]['valid']} valid"
        for i, p in enumerate(passes)
        for side in SIDES
        if p[side]["valid"] != args.requests
    ]
    report["all_valid"] = not failures
    _print_table(report)
    for failure in failures:
        print(f"not every answer succeeded and validated: {failure}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


def _median_side(passes: list[dict[str, Any]], side: str) -> dict[str, float]:
    return {
        key: round(statistics.median(p[side][key] for p in passes), 3)
        for key in ("requests_per_s", "tokens_per_s", "wall_s")
    }


def _print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['requests']} structured requests on {report['model']}, max_tokens {report['max_tokens']}, "
        f"median of {report['repeat']} pass(es)"
    )
    print(f"{'side':10} {'req/s':>8} {'tok/s':>9} {'wall s':>8}")
    for side in SIDES:
        row = report[side]
        print(f"{side:10} {row['requests_per_s']:8.2f} {row['tokens_per_s']:9.1f} {row['wall_s']:8.2f}")
    print(
        f"run-batch / server: {report['ratio_requests_per_s']}x requests/s, {report['ratio_tokens_per_s']}x "
        "output tokens/s (target >= 1.0x)"
    )
