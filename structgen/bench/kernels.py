"""Triton kernel benchmark (`benchmarks/gpu.py`, `structgen bench kernels`): correctness, speed, bandwidth.

    python benchmarks/gpu.py [--quick] [--skip-e2e] [--json OUT.json]     # on a CUDA machine
    python benchmarks/gpu.py --cpu-check                                     # anywhere: interpreter, tiny sizes

1. Every kernel on fresh random inputs against its pure-torch reference: relative error ‖out−ref‖/‖ref‖.
2. Each kernel timed (median after warm-up, `triton.testing.do_bench`) next to the torch path it replaces (the
   baseline, in the same run); bytes it must move and the achieved bandwidth as a share of a measured
   device-to-device copy. Decode attention at batch 64 x 4k context is the bandwidth target (>= 80% of copy).
3. End-to-end decode on a Llama-3-8B-shaped model with random bf16 weights built on the GPU (`--quick`: a 1B
   shape): tokens/s at batch 1, 8, 64, 256 against Hugging Face `generate` on the same weights and against the
   bandwidth floor (weight bytes / copy bandwidth per step); see `structgen.bench.kernels_e2e`.
One table at the end. Without CUDA it refuses, except `--cpu-check`, which runs every code path under Triton's
interpreter at tiny sizes (timings there mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(slots=True)
class Row:
    what: str
    shape: str
    rel_err: float | None = None
    ms: float | None = None
    baseline_ms: float | None = None
    bytes_moved: int | None = None
    gbps: float | None = None
    copy_share: float | None = None
    note: str = ""


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of `fn` after warm-up (CUDA: `do_bench`; CPU: a few wall-clock runs)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the ceiling the kernels are measured against."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (time_ms(lambda: dst.copy_(src), device) / 1e3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


@dataclass(slots=True)
class Sizes:
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    store_tokens: int
    decode: tuple[tuple[int, int, bool | None], ...]  # (batch, context, split)
    prefill: tuple[int, int, int]  # (sequences, cached prefix, new tokens)
    bitmask: tuple[int, int]  # (rows, vocab)


GPU_SIZES = Sizes(
    torch.bfloat16,
    32,
    8,
    128,
    16,
    8192,
    ((64, 4096, None), (1, 32768, None), (256, 1024, None)),
    (8, 1536, 512),
    (256, 128256),
)
CPU_SIZES = Sizes(torch.float32, 8, 2, 64, 4, 40, ((3, 70, True), (2, 9, False)), (2, 20, 18), (3, 1000))


def paged_cache(batch: int, context: int, sizes: Sizes, device: torch.device, gen: torch.Generator):
    """A random cache of `batch` sequences of `context` tokens in shuffled blocks: (k, v, tables, lens)."""
    per_seq = -(-context // sizes.block_size)
    shape = (batch * per_seq, sizes.block_size, sizes.kv_heads, sizes.head_dim)
    k = torch.randn(shape, generator=gen, device=device).to(sizes.dtype)
    v = torch.randn(shape, generator=gen, device=device).to(sizes.dtype)
    order = torch.randperm(batch * per_seq, generator=gen, device=device)
    tables = order.view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k, v, tables, lens


def check_store_kv(sizes: Sizes, device: torch.device, gen: torch.Generator) -> Row:
    from structgen.attention.torch_backend import write_kv_cache
    from structgen.kernels.store_kv import store_kv, store_kv_reference

    n, kvh, d = sizes.store_tokens, sizes.kv_heads, sizes.head_dim
    key_cache, value_cache, _, _ = paged_cache(1, 2 * n, sizes, device, gen)
    key = torch.randn(n, kvh, d, generator=gen, device=device).to(sizes.dtype)
    value = torch.randn(n, kvh, d, generator=gen, device=device).to(sizes.dtype)
    slots = torch.randperm(2 * n, generator=gen, device=device)[:n]
    slots[::7] = -1  # padding rows
    ref_k, ref_v = key_cache.cpu().clone(), value_cache.cpu().clone()
    store_kv_reference(key.cpu(), value.cpu(), ref_k, ref_v, slots.cpu())
    store_kv(key, value, key_cache, value_cache, slots)
    err = max(rel_err(key_cache.cpu(), ref_k), rel_err(value_cache.cpu(), ref_v))
    row = Row("store_kv", f"{n} tok x {kvh}x{d} {_dt(sizes.dtype)}", rel_err=err)
    row.ms = time_ms(lambda: store_kv(key, value, key_cache, value_cache, slots), device)
    row.baseline_ms = time_ms(lambda: write_kv_cache(key, value, key_cache, value_cache, slots), device)
    row.bytes_moved = 2 * 2 * key.numel() * key.element_size()  # k and v: read once, written once
    return row


def check_decode(
    batch: int, context: int, split: bool | None, sizes: Sizes, device: torch.device, gen: torch.Generator
) -> Row:
    from structgen.attention.torch_backend import paged_decode_attention
    from structgen.kernels.paged_attention_decode import (
        paged_attention_decode,
        paged_attention_decode_reference,
    )

    k, v, tables, lens = paged_cache(batch, context, sizes, device, gen)
    q = torch.randn(batch, sizes.heads, sizes.head_dim, generator=gen, device=device).to(sizes.dtype)
    scale = sizes.head_dim**-0.5

    def run() -> torch.Tensor:
        return paged_attention_decode(
            q, k, v, tables, lens, max_context_len=context, scale=scale, split=split
        )

    ref = paged_attention_decode_reference(q, k, v, tables, lens, scale=scale)
    row = Row(
        "decode attention", f"b{batch} x ctx{context} {sizes.heads}/{sizes.kv_heads}h {_dt(sizes.dtype)}"
    )
    row.rel_err = rel_err(run(), ref)
    row.ms = time_ms(run, device)
    row.baseline_ms = time_ms(
        lambda: paged_decode_attention(
            q, k, v, block_tables=tables, context_lens=lens, max_context_len=context, scale=scale
        ),
        device,
    )
    row.bytes_moved = 2 * batch * context * sizes.kv_heads * sizes.head_dim * k.element_size() + 2 * q.nbytes
    return row


def check_prefill(sizes: Sizes, device: torch.device, gen: torch.Generator) -> Row:
    from structgen.attention import AttentionMetadata, TorchAttentionBackend
    from structgen.kernels.paged_attention_prefill import (
        paged_attention_prefill,
        paged_attention_prefill_reference,
    )

    seqs, cached, new = sizes.prefill
    k_cache, v_cache, tables, lens = paged_cache(seqs, cached + new, sizes, device, gen)
    n = seqs * new
    q = torch.randn(n, sizes.heads, sizes.head_dim, generator=gen, device=device).to(sizes.dtype)
    key = torch.randn(n, sizes.kv_heads, sizes.head_dim, generator=gen, device=device).to(sizes.dtype)
    value = torch.randn_like(key)
    starts = torch.arange(0, n + 1, new, dtype=torch.int32, device=device)
    scale = sizes.head_dim**-0.5
    args = (q, key, value, k_cache, v_cache, tables, lens, starts)
    ref = paged_attention_prefill_reference(*args, scale=scale)
    row = Row("prefill attention", f"{seqs} seq x {new} new on {cached} cached {_dt(sizes.dtype)}")
    row.rel_err = rel_err(paged_attention_prefill(*args, max_query_len=new, scale=scale), ref)
    row.ms = time_ms(lambda: paged_attention_prefill(*args, max_query_len=new, scale=scale), device)
    positions = torch.arange(cached, cached + new, device=device)
    slots = tables.long()[:, positions // sizes.block_size] * sizes.block_size + positions % sizes.block_size
    metadata = AttentionMetadata(
        slot_mapping=slots.flatten(),
        block_tables=tables,
        context_lens=lens,
        query_start_loc=starts,
        max_query_len=new,
        max_context_len=cached + new,
        block_size=sizes.block_size,
        query_lens_cpu=[new] * seqs,
        context_lens_cpu=[cached + new] * seqs,
    )
    torch_backend = TorchAttentionBackend()
    row.baseline_ms = time_ms(
        lambda: torch_backend.forward(q, key, value, (k_cache, v_cache), metadata, scale=scale), device
    )
    flops = 4 * seqs * sizes.heads * sizes.head_dim * new * (cached + (new + 1) / 2)
    row.note = f"{flops / (row.ms / 1e3) / 1e12:.1f} TFLOP/s"
    return row


def check_bitmask(sizes: Sizes, device: torch.device, gen: torch.Generator) -> Row:
    from structgen.kernels.apply_token_bitmask import apply_token_bitmask, apply_token_bitmask_reference
    from structgen.structured.bitmask import _apply_torch, bitmask_width

    rows, vocab = sizes.bitmask
    logits = torch.randn(rows, vocab, generator=gen, device=device)
    words = bitmask_width(vocab - 100)  # the tokenizer's vocabulary is smaller than the padded logits
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen, device=device)
    out, ref = logits.clone(), logits.cpu().clone()
    apply_token_bitmask(out, mask)
    apply_token_bitmask_reference(ref, mask.cpu())
    row = Row("bitmask apply", f"{rows} x {vocab} fp32")
    row.rel_err = 0.0 if torch.equal(out.cpu(), ref) else float("inf")  # exact: same values or -inf
    scratch = logits.clone()
    row.ms = time_ms(lambda: apply_token_bitmask(scratch, mask), device)
    row.baseline_ms = time_ms(lambda: _apply_torch(scratch, mask, None, 32 * words), device)
    row.bytes_moved = 2 * logits.nbytes + mask.nbytes
    return row


def _guarded(what: str, check: Callable[[], Row]) -> Row:
    """The check's row, or a row naming its error: one kernel that fails to build or launch must not hide the
    others' numbers (the row has no error figure, so the exit code still says it failed)."""
    try:
        return check()
    except Exception as exc:  # reported in the table; the exit code follows
        import traceback

        traceback.print_exc()
        return Row(what, "-", note=f"failed: {type(exc).__name__}: {str(exc)[:160]}")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], copy_gbps: float) -> None:
    header = ("what", "shape", "rel err", "ms", "torch ms", "speedup", "GB/s", "% copy", "note")
    table = [header]
    for r in rows:
        speedup = r.baseline_ms / r.ms if r.ms and r.baseline_ms else None
        table.append(
            (
                r.what,
                r.shape,
                _fmt(r.rel_err, ".1e"),
                _fmt(r.ms, ".3f"),
                _fmt(r.baseline_ms, ".3f"),
                _fmt(speedup, ".1f") + ("x" if speedup else ""),
                _fmt(r.gbps, ".0f"),
                _fmt(None if r.copy_share is None else 100 * r.copy_share, ".0f"),
                r.note,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print(f"\ndevice-to-device copy: {copy_gbps:.0f} GB/s")
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structgen bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="end-to-end on a 1B-shaped model, fewer steps")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument(
        "--cpu-check", action="store_true", help="all code paths under the interpreter, tiny sizes"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    if args.cpu_check:
        if "structgen.kernels.store_kv" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("error: --cpu-check must start before structgen.kernels is imported", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. imported below
        device, sizes = torch.device("cpu"), CPU_SIZES
    elif not torch.cuda.is_available():
        print(
            "error: the kernel benchmark needs CUDA (use --cpu-check to run its code paths on the CPU)",
            file=sys.stderr,
        )
        return 2
    else:
        device, sizes = torch.device("cuda"), GPU_SIZES
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(args.seed)
    copy_bps = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
    checks: list[tuple[str, Callable[[], Row]]] = [("store_kv", lambda: check_store_kv(sizes, device, gen))]
    checks += [
        (f"decode attention b{b} ctx{c}", lambda b=b, c=c, s=s: check_decode(b, c, s, sizes, device, gen))
        for b, c, s in sizes.decode
    ]
    checks += [
        ("prefill attention", lambda: check_prefill(sizes, device, gen)),
        ("bitmask apply", lambda: check_bitmask(sizes, device, gen)),
    ]
    rows = [_guarded(what, check) for what, check in checks]
    for r in rows:
        if r.bytes_moved is not None and r.ms:
            r.gbps = r.bytes_moved / (r.ms / 1e3) / 1e9
            r.copy_share = r.bytes_moved / (r.ms / 1e3) / copy_bps
    e2e, e2e_error, fp32 = [], None, None
    if not args.skip_e2e:
        from structgen.bench.kernels_e2e import run_e2e

        print_table(rows, copy_bps / 1e9)  # the kernels' table first, should the end-to-end part fail
        try:
            from structgen.bench.kernels_e2e import float32_check

            fp32 = float32_check(device=device, cpu_check=args.cpu_check)
            print(fp32.summary(), flush=True)
            e2e = run_e2e(device=device, quick=args.quick, cpu_check=args.cpu_check, copy_bps=copy_bps)
        except Exception as exc:  # the kernels' numbers still get written; the exit code says it failed
            import traceback

            traceback.print_exc()
            e2e_error = f"{type(exc).__name__}: {exc}"
    print_table(rows, copy_bps / 1e9)
    if e2e:
        from structgen.bench.kernels_e2e import print_e2e

        print_e2e(e2e)
    if fp32 is not None:
        print(fp32.summary())
    print(
        f"\nwall time {time.perf_counter() - started:.0f} s on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter)'}"
    )
    if args.json:
        payload = {
            "copy_gbps": copy_bps / 1e9,
            "kernels": [asdict(r) for r in rows],
            "e2e": [asdict(r) for r in e2e],
            "e2e_error": e2e_error,
            "e2e_float32": None if fp32 is None else asdict(fp32),
        }
        args.json.write_text(json.dumps(payload, indent=2))
    kernels_ok = all(r.rel_err is not None and r.rel_err < 2e-2 for r in rows)
    return 0 if kernels_ok and e2e_error is None else 1
