"""The CPU prefill-attention kernel against the path it replaces, per layer: one sequence's prompt (or a chunk of
one on a cached prefix) attended causally, the kernel reading the paged cache and the torch backend's SDPA path
(`torch_backend.prefill_attention`: SDPA causal on the fresh keys, or on the gathered context with a mask).

    structgen bench prefill-attention [--cases 128,384,1024,2048,512/2048] [--heads 9,3,64]
                                      [--dtype auto|bfloat16|float32] [--threads N] [--repeats 11]
                                      [--cpu-time] [--json OUT]

A case is NEW (a whole prompt) or NEW/CONTEXT (NEW tokens on CONTEXT - NEW cached ones), its blocks scattered in
the cache. The two paths alternate call by call; reported: each one's median and minimum milliseconds, GFLOP/s
(the causal products' 4 x heads x head_dim flops a visible score), SDPA's median over the kernel's and the largest
difference of their outputs. `--cpu-time` times by the thread's CPU time instead of the wall clock: with
`--threads 1` a reading that another process's load (on a shared machine) stretches less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

BLOCK_SIZE = 16


def _case(
    new: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0
) -> tuple[Callable[[], Any], Callable[[], Any], torch.Tensor, torch.Tensor]:
    """The kernel's call and SDPA's, and the outputs they write."""
    from structgen.attention.backend import AttentionMetadata
    from structgen.attention.torch_backend import prefill_attention as sdpa_path
    from structgen.kernels import cpu_prefill_attention

    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK_SIZE)
    shape = (blocks + 8, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].int()
    query = torch.randn(new, num_heads, head_dim, generator=gen).to(dtype)
    positions = torch.arange(context - new, context)
    slots = table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    # The new tokens' keys and values as the layer has them (the backend writes them to the cache first).
    key = key_cache.flatten(0, 1)[slots].clone()
    value = value_cache.flatten(0, 1)[slots].clone()
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_tables=table[None],
        context_lens=torch.tensor([context], dtype=torch.int32),
        query_start_loc=torch.tensor([0, new], dtype=torch.int32),
        max_query_len=new,
        max_context_len=context,
        block_size=BLOCK_SIZE,
        query_lens_cpu=[new],
        context_lens_cpu=[context],
    )
    scale = head_dim**-0.5
    kernel_out, sdpa_out = torch.zeros_like(query), torch.zeros_like(query)

    def kernel() -> None:
        cpu_prefill_attention.prefill_attention(
            query, key_cache, value_cache, block_table=table, context_len=context, scale=scale, out=kernel_out
        )

    def sdpa() -> None:
        sdpa_path(query, key, value, key_cache, value_cache, metadata, out=sdpa_out, scale=scale)

    return kernel, sdpa, kernel_out, sdpa_out


def measure(
    cases: list[tuple[int, int]],
    *,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    repeats: int,
    cpu_time: bool = False,
) -> list[dict[str, Any]]:
    from structgen.kernels import cpu_build, cpu_prefill_attention

    if not cpu_prefill_attention.available(dtype):
        raise SystemExit(
            f"prefill-attention: the kernel does not run here for {dtype} "
            f"({cpu_build.unavailable_reason() or 'this CPU lacks the instructions it needs'})"
        )
    clock = time.thread_time if cpu_time else time.perf_counter
    rows = []
    for new, context in cases:
        kernel, sdpa, kernel_out, sdpa_out = _case(new, context, heads, dtype)
        kernel(), sdpa()  # warm: buffers, pages, SDPA's first-call setup
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for _ in range(repeats):
            for name, call in (("kernel", kernel), ("sdpa", sdpa)):
                start = clock()
                call()
                times[name].append((clock() - start) * 1e3)
        num_heads, _, head_dim = heads
        visible = new * (context - new) + new * (new + 1) / 2  # scores a causal pass needs
        flops = 4 * num_heads * head_dim * visible
        row: dict[str, Any] = {"new": new, "context": context}
        for name, t in times.items():
            median = statistics.median(t)
            row[name] = {
                "median_ms": round(median, 3),
                "min_ms": round(min(t), 3),
                "gflop_s": round(flops / median / 1e6, 1),
            }
        row["sdpa_over_kernel"] = round(row["sdpa"]["median_ms"] / row["kernel"]["median_ms"], 2)
        row["max_abs_diff"] = float((kernel_out.float() - sdpa_out.float()).abs().max())
        rows.append(row)
    return rows


def _parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        new, _, context = item.partition("/")
        cases.append((int(new), int(context or new)))
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cases", default="128,384,1024,2048,512/2048", help="NEW or NEW/CONTEXT, comma-separated"
    )
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    ap.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="queries and KV cache (default: the engine's auto choice on this CPU)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--cpu-time", action="store_true", help="time by thread CPU time (with --threads 1)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        cases = _parse_cases(args.cases)
        num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    except ValueError:
        ap.error(
            "--cases takes NEW or NEW/CONTEXT items and --heads three integers, e.g. --cases 1024,512/2048"
        )
    if any(not 0 < new <= context for new, context in cases) or num_heads % num_kv_heads or args.repeats < 1:
        ap.error("--cases need 0 < NEW <= CONTEXT; query heads a multiple of KV heads; --repeats positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    from structgen.models.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype, checkpoint_dtype=None, device="cpu")
    started = time.strftime("%H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()[0]
    rows = measure(
        cases,
        heads=(num_heads, num_kv_heads, head_dim),
        dtype=dtype,
        repeats=args.repeats,
        cpu_time=args.cpu_time,
    )
    print(
        f"heads {args.heads}, {dtype}, {torch.get_num_threads()} threads, {args.repeats} calls each alternated, "
        f"{'thread CPU time' if args.cpu_time else 'wall clock'}; {started}, load {load:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end"
    )
    print(
        "| new / context | kernel ms (min) | GFLOP/s | SDPA ms (min) | GFLOP/s | SDPA / kernel | max diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        k, s = r["kernel"], r["sdpa"]
        print(
            f"| {r['new']} / {r['context']} | {k['median_ms']} ({k['min_ms']}) | {k['gflop_s']} | "
            f"{s['median_ms']} ({s['min_ms']}) | {s['gflop_s']} | {r['sdpa_over_kernel']}x | "
            f"{r['max_abs_diff']:.1e} |"
        )
    if args.json:
        payload = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "results": rows}
        payload["args"]["dtype"] = str(dtype).removeprefix("torch.")
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
