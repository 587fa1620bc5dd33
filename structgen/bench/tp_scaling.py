"""Tensor-parallel scaling (`benchmarks/tp_scaling.py`): measured on this machine, and on paper for real shapes.

    python benchmarks/tp_scaling.py [all|throughput|broadcast|comm] [--model tiny] [--device cpu]
                                    [--requests 16] [--output-tokens 32] [--json OUT.json]

(a) `throughput`: generation tokens/s of `--requests` requests (64 random token ids each, `--output-tokens`
    greedy tokens, ignore_eos) through `LLMEngine`: TP 1 with all cores, TP 1 with one thread, and TP 2 with one
    thread per rank (the same cores split between ranks); start-up is not timed. Ratio: TP 2 / the faster TP 1.
(b) `broadcast`: the per-step cost of handing a decode batch (32 sequences, 64-block tables) to one worker over
    gloo: the header + flat int64 payload of `structgen.distributed.step_io` against pickling the same lists
    with `broadcast_object_list` (the baseline), median of 300 steps each.
(c) `comm`: bytes each decoded token puts on the wire per layer and per step, from the model shapes (no run):
    two all-reduces of hidden_size per layer (after o_proj and down_proj) and the logits gather to rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # hidden_size, num_hidden_layers, vocab_size, dtype bytes (bf16 on a GPU), the TP sizes its heads allow
    "SmolLM2-135M": {"hidden": 576, "layers": 30, "vocab": 49152, "bytes": 2, "tp": (3,)},  # 9 heads, 3 KV
    "Llama-3-8B": {"hidden": 4096, "layers": 32, "vocab": 128256, "bytes": 2, "tp": (2, 4, 8)},  # 32 / 8 KV
}
# Link bandwidth per direction and a typical small-message all-reduce latency (NCCL, 2 GPUs), for the estimate.
LINKS: dict[str, tuple[float, float]] = {"NVLink 4 (H100)": (450e9, 8e-6), "PCIe 4.0 x16": (25e9, 25e-6)}
BROADCAST_STEPS = 300


def _engine(model: str, device: str, tp_size: int, kv_tokens: int) -> Any:
    from structgen.config import CacheConfig, EngineConfig
    from structgen.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=model, device=device, tensor_parallel_size=tp_size, cache=CacheConfig(kv_cache_tokens=kv_tokens)
    )
    return LLMEngine(config)


def measure_throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    from structgen.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 50000, (64,), generator=generator).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    kv_tokens = args.requests * (64 + args.output_tokens + 32)
    all_threads = torch.get_num_threads()
    rows = []
    for tp_size, threads in ((1, all_threads), (1, 1), (2, 1)):
        torch.set_num_threads(threads)  # workers copy rank 0's thread count
        engine = _engine(args.model, args.device, tp_size, kv_tokens)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        started = time.perf_counter()
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        elapsed = time.perf_counter() - started
        engine.shutdown()
        rows.append(
            {"tp": tp_size, "threads_per_rank": threads, "tokens": tokens, "tok_per_s": tokens / elapsed}
        )
        print(f"  TP {tp_size}, {threads} thread(s)/rank: {tokens / elapsed:8.1f} tok/s", flush=True)
    torch.set_num_threads(all_threads)
    return rows


def _decode_batch() -> tuple[list[int], ...]:
    num_seqs, num_blocks, block_size = 32, 64, 16
    tables = [[s * num_blocks + b for b in range(num_blocks)] for s in range(num_seqs)]
    context = [900 + s for s in range(num_seqs)]
    ids = list(range(5000, 5000 + num_seqs))
    slots = [
        tables[s][(c - 1) // block_size] * block_size + (c - 1) % block_size for s, c in enumerate(context)
    ]
    return (
        ids,
        [c - 1 for c in context],
        slots,
        context,
        list(range(num_seqs + 1)),
        [b for t in tables for b in t],
        ids,
    )


def _broadcast_rank(rank: int, port: int, results: Any) -> None:
    """Both ranks of the broadcast benchmark; rank 0 times and reports through `results`."""
    from structgen.attention import AttentionMetadata
    from structgen.distributed.parallel_state import init_process_group
    from structgen.distributed.step_io import Command, StepInput, receive_header, receive_step, send_step

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    init_process_group(rank=rank, world_size=2, port=port, device=cpu)
    ids, positions, slots, context, starts, tables, rows = _decode_batch()
    timings: dict[str, float] = {}
    for mode in ("tensors", "pickle"):
        samples = []
        for _ in range(BROADCAST_STEPS):
            torch.distributed.barrier()
            started = time.perf_counter()
            if mode == "pickle":
                objects = [(ids, positions, slots, context, starts, tables, rows)] if rank == 0 else [None]
                torch.distributed.broadcast_object_list(objects, src=0)
                if rank != 0:  # the worker builds the same tensors as from the flat payload
                    [torch.tensor(x) for x in objects[0]]  # type: ignore[union-attr]
            elif rank == 0:
                metadata = AttentionMetadata(
                    slot_mapping=torch.tensor(slots),
                    block_tables=torch.tensor(tables, dtype=torch.int32).view(len(context), -1),
                    context_lens=torch.tensor(context, dtype=torch.int32),
                    query_start_loc=torch.tensor(starts, dtype=torch.int32),
                    max_query_len=1,
                    max_context_len=max(context),
                    block_size=16,
                    query_lens_cpu=[1] * len(context),
                    context_lens_cpu=context,
                )
                step = StepInput(torch.tensor(ids), torch.tensor(positions), metadata, torch.tensor(rows), [])
                send_step(step, device=cpu)
            else:
                header = receive_header(cpu)
                assert header[0] == Command.STEP
                receive_step(header, device=cpu, block_size=16)
            samples.append(time.perf_counter() - started)
        timings[mode] = statistics.median(samples) * 1e6
    if rank == 0:
        results.put(timings)
    torch.distributed.destroy_process_group()


def measure_serialization(repeats: int = 2000) -> dict[str, float]:
    """The CPU work either way costs in one process, without the wire: pickle + unpickle + tensors from lists
    (what `broadcast_object_list` adds) against concatenating and splitting the flat payload."""
    import pickle

    batch = _decode_batch()
    tensors = [torch.tensor(x) for x in batch]
    sizes = [t.numel() for t in tensors]
    timings = {}
    for mode in ("tensors", "pickle"):
        started = time.perf_counter()
        for _ in range(repeats):
            if mode == "pickle":
                [torch.tensor(x) for x in pickle.loads(pickle.dumps(batch))]
            else:
                torch.cat(tensors).split(sizes)
        timings[mode] = (time.perf_counter() - started) / repeats * 1e6
    return timings


def measure_broadcast() -> dict[str, float]:
    import torch.multiprocessing as mp

    from structgen.distributed.parallel_state import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    peer = ctx.Process(target=_broadcast_rank, args=(1, port, results), daemon=True)
    peer.start()
    _broadcast_rank(0, port, results)
    peer.join(30)
    timings = results.get(timeout=5)
    cpu = measure_serialization()
    for label, t in (("over gloo", timings), ("CPU work only", cpu)):
        print(
            f"  decode step of 32 seqs, {label}: tensors {t['tensors']:.0f} us, pickle {t['pickle']:.0f} us "
            f"(pickle / tensors = {t['pickle'] / t['tensors']:.2f}x)"
        )
    return {**timings, **{f"cpu_{k}": v for k, v in cpu.items()}}


def communication_volume() -> list[dict[str, Any]]:
    """Per decoded token: all-reduce payload per layer, per step, logits gather, and the ring traffic per GPU."""
    rows = []
    for name, s in SHAPES.items():
        per_layer = 2 * s["hidden"] * s["bytes"]  # two all-reduces of one hidden vector
        for tp in s["tp"]:
            ring = 2 * (tp - 1) / tp  # a ring all-reduce sends and receives this multiple of the payload
            gather = s["vocab"] * s["bytes"] * (tp - 1) / tp  # what rank 0 receives per sampled token
            row: dict[str, Any] = {
                "model": name,
                "tp": tp,
                "allreduce_bytes_per_layer": per_layer,
                "allreduce_bytes_per_token": per_layer * s["layers"],
                "ring_bytes_per_gpu_per_token": ring * per_layer * s["layers"],
                "gather_bytes_per_token": gather,
                "collectives_per_step": 2 * s["layers"] + 2,  # + the embedding all-reduce and the gather
            }
            for link, (bandwidth, latency) in LINKS.items():
                # Batch 1 decode is latency-bound: one small collective after another.
                row[f"{link} us/step @ batch 1"] = row["collectives_per_step"] * latency * 1e6 + (
                    (row["ring_bytes_per_gpu_per_token"] + gather) / bandwidth * 1e6
                )
                row[f"{link} us/step @ batch 256"] = row["collectives_per_step"] * latency * 1e6 + (
                    256 * (row["ring_bytes_per_gpu_per_token"] + gather) / bandwidth * 1e6
                )
            rows.append(row)
            print(
                f"  {name:13s} TP {tp}: {per_layer / 1024:6.2f} KiB/layer, "
                f"{per_layer * s['layers'] / 1024:7.1f} KiB all-reduced + {gather / 1024:6.1f} KiB gathered "
                f"per token; {row['collectives_per_step']} collectives/step; est. comm/step "
                + ", ".join(
                    f"{link}: {row[f'{link} us/step @ batch 1']:.0f} us (b1) / "
                    f"{row[f'{link} us/step @ batch 256']:.0f} us (b256)"
                    for link in LINKS
                )
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/tp_scaling.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "throughput", "broadcast", "comm"])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.output_tokens < 1:
        print("error: --requests and --output-tokens must be at least 1", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.what in ("all", "throughput"):
        print(f"throughput ({args.model}, {args.requests} requests x {args.output_tokens} tokens):")
        rows = measure_throughput(args)
        report["throughput"] = rows
        # The baseline is the faster TP 1 run: on a loaded machine, intra-op threads can cost more than they give.
        best = max(rows[0]["tok_per_s"], rows[1]["tok_per_s"])
        report["ratio_tp2_over_best_tp1"] = rows[2]["tok_per_s"] / best
        print(f"  ratio TP 2 / best TP 1: {rows[2]['tok_per_s'] / best:.2f}x")
    if args.what in ("all", "broadcast"):
        print("step broadcast (gloo, 2 ranks):")
        report["broadcast_us"] = measure_broadcast()
    if args.what in ("all", "comm"):
        print("communication per decoded token (on paper):")
        report["comm"] = communication_volume()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0
