"""The CPU decode-attention kernel on a batch's paged KV cache, per layer, in three layouts of the same contexts.

    structgen bench decode-attention [--seqs 32] [--context 250-500] [--heads 9,3,64] [--layers 30]
                                     [--pool-blocks 4096] [--threads N] [--repeats 15] [--plain-pages]
                                     [--dtype auto|bfloat16|float32]
                                     [--json OUT]

- `scattered`: each context's blocks at random places in the pool, as a serving engine's cache is once requests
  have come and gone (the case that matters);
- `sequential`: each context's blocks one after another (what the hardware prefetchers follow best);
- `resident`: every sequence reading the same blocks, which then stay in cache: the compute alone.

Each layer has its own key and value caches of `--pool-blocks` blocks (`--layers` of them, allocated as the engine does: on 2 MB pages where
the OS gives them, or `--plain-pages` for `torch.zeros`), so a step reads from memory as a model's would. One
query row per sequence, SmolLM2's heads by default (9 query heads over 3 KV heads of 64), in the dtype the engine
picks on this CPU (`--dtype auto`: bf16 where the CPU computes it natively, fp32 elsewhere). Reported: the
median and minimum microseconds a layer over `--repeats` steps of all layers, and scattered's time over the
other two (over `resident`: how much memory costs on top of the compute).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BLOCK_SIZE = 16
LAYOUTS = ("scattered", "sequential", "resident")


def _tables(lens: list[int], layout: str, num_blocks: int, rng: random.Random) -> torch.Tensor:
    per_seq = [-(-n // BLOCK_SIZE) for n in lens]
    order = list(range(num_blocks))
    if layout == "scattered":
        rng.shuffle(order)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        if layout != "resident":
            used += n
    return tables


def _step(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    query: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One decode step's attention: every layer's call, as the model makes them."""
    from structgen.kernels import cpu_ops

    for key, value in caches:
        cpu_ops.paged_decode_attention(
            query,
            key,
            value,
            block_tables=tables,
            context_lens=context_lens,
            scale=query.shape[-1] ** -0.5,
            out=out,
        )


def measure(
    *,
    seqs: int,
    context: tuple[int, int],
    heads: tuple[int, int, int],
    layers: int,
    repeats: int,
    plain_pages: bool,
    dtype: torch.dtype = torch.bfloat16,
    pool_blocks: int = 4096,
    seed: int = 0,
) -> dict[str, Any]:
    from structgen.attention import allocate_kv_cache
    from structgen.kernels import cpu_build, cpu_ops

    if not cpu_ops.available():
        raise SystemExit(
            f"decode-attention: the native CPU kernels are unavailable ({cpu_build.unavailable_reason()})"
        )
    num_heads, num_kv_heads, head_dim = heads
    rng = random.Random(seed)
    lens = [rng.randint(*context) for _ in range(seqs)]
    num_blocks = max(pool_blocks, sum(-(-n // BLOCK_SIZE) for n in lens))
    caches = allocate_kv_cache(
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        huge_pages=not plain_pages,
    )
    gen = torch.Generator().manual_seed(seed)
    for key, value in caches:
        key.copy_(torch.randn(key.shape, generator=gen))
        value.copy_(torch.randn(value.shape, generator=gen))
    query = torch.randn(seqs, num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty_like(query)
    results: dict[str, Any] = {}
    for layout in LAYOUTS:
        tables = _tables(lens, layout, num_blocks, rng)

        for _ in range(3):
            _step(caches, query, tables, context_lens, out)
        per_layer = []
        for _ in range(repeats):
            start = time.perf_counter()
            _step(caches, query, tables, context_lens, out)
            per_layer.append((time.perf_counter() - start) / layers * 1e6)
        results[layout] = {
            "median_us": round(statistics.median(per_layer), 1),
            "min_us": round(min(per_layer), 1),
        }
    scattered = results["scattered"]["median_us"]
    results["scattered_over_sequential"] = round(scattered / results["sequential"]["median_us"], 3)
    results["scattered_over_resident"] = round(scattered / results["resident"]["median_us"], 3)
    kv_bytes = sum(lens) * num_kv_heads * head_dim * 2 * dtype.itemsize
    results["kv_mb_per_layer"] = round(kv_bytes / 1e6, 2)
    results["scattered_gb_s"] = round(kv_bytes / (scattered * 1e-6) / 1e9, 1)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", default="250-500", help="context lengths drawn from LO-HI")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--pool-blocks", type=int, default=4096, help="blocks in each layer's cache (as a server's)"
    )
    ap.add_argument(
        "--plain-pages", action="store_true", help="KV caches from torch.zeros, not on 2 MB pages"
    )
    ap.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the KV cache's dtype (default: the engine's auto choice on this CPU)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        low, high = (int(x) for x in args.context.split("-"))
        num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    except ValueError:
        ap.error("--context takes LO-HI and --heads three integers, e.g. --context 250-500 --heads 9,3,64")
    if not (0 < low <= high) or num_heads % num_kv_heads or min(args.seqs, args.layers, args.repeats) < 1:
        ap.error("need 0 < LO <= HI, query heads a multiple of KV heads, and positive counts")
    if args.threads:
        torch.set_num_threads(args.threads)
    from structgen.models.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype, checkpoint_dtype=None, device="cpu")
    results = measure(
        seqs=args.seqs,
        dtype=dtype,
        context=(low, high),
        heads=(num_heads, num_kv_heads, head_dim),
        layers=args.layers,
        repeats=args.repeats,
        plain_pages=args.plain_pages,
        pool_blocks=args.pool_blocks,
    )
    print(
        f"{args.seqs} sequences of {low}-{high} tokens, heads {args.heads}, {dtype}, {args.layers} layers, "
        f"{torch.get_num_threads()} threads, {'plain' if args.plain_pages else '2 MB'} pages "
        f"({results['kv_mb_per_layer']} MB of keys and values a layer)"
    )
    print("| layout | median us/layer | min us/layer |\n|---|---:|---:|")
    for layout in LAYOUTS:
        print(f"| {layout} | {results[layout]['median_us']} | {results[layout]['min_us']} |")
    print(
        f"scattered / sequential {results['scattered_over_sequential']}, scattered / resident "
        f"{results['scattered_over_resident']}, scattered reads {results['scattered_gb_s']} GB/s"
    )
    if args.json:
        payload = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
