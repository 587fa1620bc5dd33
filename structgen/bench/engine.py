"""Engine benchmarks: throughput against Hugging Face `generate`, KV waste, prefix caching, decode scaling.

    structgen bench engine [all|throughput|kv-waste|prefix|decode] [--model tiny] [--model smollm2-135m]
                                [--threads N] [--device cpu|cuda] [--hf-batches K] [--json OUT.json]

(a) `throughput`: 64 requests, prompt lengths uniform in 16..512 and output lengths in 8..256 (seed 0, random
    ordinary token ids, ignore_eos), through `LLM.generate` all at once, and through HF `generate` in static
    batches of 8 (left-padded; each batch runs to its longest output) on the same checkpoint directory, fp32.
    Throughput is useful output tokens / wall time; the ratio is engine / HF, measured in the same run.
    `--hf-batches K` times only the first K batches of 8 for HF (its rate is per token, so a subset estimates
    it; the default runs all 8 batches).
(b) `kv-waste`: the same kind of workload (seed 1) through the engine, sampling after every step (allocated - used token slots)
    / allocated, where allocated = blocks held by running sequences x block size and used = tokens with KV in
    them; reported at steady state (steps where every running sequence decodes, nothing waits) and overall.
(c) `prefix`: time to first token of a request with a 1,000-token prefix + 24-token suffix on a warm engine,
    then of a second request sharing the prefix with another suffix (cache hit); ratio first / second.
(d) `decode`: decode tokens/s at batch sizes 1..64 (64-token prompts, prefilled first, then 32 decode steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from structgen.engine.llm import LLM
from structgen.models.registry import resolve_model
from structgen.sampling_params import SamplingParams

NUM_REQUESTS = 64
PROMPT_LENS = (16, 512)
OUTPUT_LENS = (8, 256)
HF_BATCH = 8


def workload(seed: int = 0, num: int = NUM_REQUESTS) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; ordinary ids so no tokenizer special case is hit."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(1000, 30000) for _ in range(rng.randint(*PROMPT_LENS))], rng.randint(*OUTPUT_LENS))
        for _ in range(num)
    ]


def make_llm(model: str, device: str, *, dtype: str = "float32", **kwargs: Any) -> LLM:
    defaults: dict[str, Any] = {"kv_cache_tokens": 64 * 800, "max_num_seqs": 64}
    return LLM(model, device=device, dtype=dtype, **(defaults | kwargs))


def params_for(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


# -- (a) throughput ----------------------------------------------------------------------------------------------


def bench_engine_throughput(llm: LLM, work: list[tuple[list[int], int]]) -> dict[str, float]:
    llm.generate([{"prompt_token_ids": list(range(2000, 2032))}], params_for(4))  # warm-up, shares no prefix
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], [params_for(n) for _, n in work])
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in work)
    return {"seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed}


def bench_hf_throughput(
    model_dir: Path,
    work: list[tuple[list[int], int]],
    device: str,
    max_batches: int | None,
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    batches = [work[i : i + HF_BATCH] for i in range(0, len(work), HF_BATCH)][:max_batches]
    _hf_generate(model, [(work[0][0][:32], 4)], device)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for batch in batches:
        tokens += _hf_generate(model, batch, device)
    elapsed = time.perf_counter() - start
    # Raw: every generated row-token, including those past a request's own length (static-batch waste).
    raw = sum(len(batch) * max(n for _, n in batch) for batch in batches)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "raw_tok_per_s": raw / elapsed,
        "batches": len(batches),
    }


def _hf_generate(model: Any, batch: list[tuple[list[int], int]], device: str) -> int:
    """One static batch, left-padded; runs until its longest output. Returns the useful tokens it made."""
    width = max(len(p) for p, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, (prompt, _) in enumerate(batch):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    longest = max(n for _, n in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=longest,
            min_new_tokens=longest,  # ignore EOS, like the engine's ignore_eos
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == width + longest
    return sum(n for _, n in batch)


# -- (b) KV waste ------------------------------------------------------------------------------------------------


def bench_kv_waste(llm: LLM, work: list[tuple[list[int], int]]) -> dict[str, float]:
    engine = llm.engine
    for i, (prompt, n) in enumerate(work):
        engine.add_request(f"kv-{i}", prompt, params_for(n), stream=False)
    bs = engine.block_manager.block_size
    steady, overall = [], []
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        allocated = sum(len(s.block_table) for s in running) * bs
        if not allocated:
            continue
        used = sum(s.num_computed_tokens for s in running)
        waste = (allocated - used) / allocated
        overall.append(waste)
        if not engine.scheduler.waiting and all(s.num_computed_tokens == len(s) - 1 for s in running):
            steady.append(waste)
    return {
        "steady_mean": statistics.fmean(steady) if steady else float("nan"),
        "steady_max": max(steady) if steady else float("nan"),
        "steady_steps": len(steady),
        "overall_mean": statistics.fmean(overall),
        "block_size": bs,
    }


# -- (c) prefix caching ------------------------------------------------------------------------------------------


def bench_prefix(llm: LLM, prefix_len: int = 1000, repeats: int = 3) -> dict[str, float]:
    engine = llm.engine
    rng = random.Random(1)

    def ttft(prompt: list[int], request_id: str) -> float:
        engine.add_request(request_id, prompt, params_for(1), stream=False)
        while engine.has_unfinished():
            for out in engine.step():
                assert out.metrics is not None and out.metrics.ttft is not None
                return out.metrics.ttft
        raise AssertionError("no output")

    ttft([rng.randrange(1000, 30000) for _ in range(64)], "warm-up")
    firsts, seconds = [], []
    for r in range(repeats):
        prefix = [rng.randrange(1000, 30000) for _ in range(prefix_len)]  # new each time: a cold cache
        firsts.append(ttft([*prefix, *(rng.randrange(1000, 30000) for _ in range(24))], f"first-{r}"))
        seconds.append(ttft([*prefix, *(rng.randrange(1000, 30000) for _ in range(24))], f"second-{r}"))
    first, second = statistics.median(firsts), statistics.median(seconds)
    return {"first_ttft_s": first, "second_ttft_s": second, "speedup": first / second}


# -- (d) decode scaling ------------------------------------------------------------------------------------------


def bench_decode(
    llm: LLM, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), steps: int = 32
) -> dict[str, float]:
    engine = llm.engine
    rng = random.Random(2)
    results = {}
    for size in sizes:
        for i in range(size):
            prompt = [rng.randrange(1000, 30000) for _ in range(64)]
            engine.add_request(f"d{size}-{i}", prompt, params_for(steps + 2), stream=False)
        while any(not s.is_prefill_done or not s.output_token_ids for s in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
        results[str(size)] = size * steps / elapsed
        while engine.has_unfinished():
            engine.step()
    return results


# -- driver ------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "machine": f"{_cpu_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_at_start": os.getloadavg()[0],
    }
    work = workload()
    for model in args.model:
        results: dict[str, Any] = {}
        report[model] = results
        llm = make_llm(model, args.device, dtype=args.dtype)
        dtype = next(llm.engine.model.parameters()).dtype
        results["dtype"] = str(dtype).removeprefix("torch.")
        if args.bench in ("all", "throughput"):
            engine = bench_engine_throughput(llm, work)
            hf = bench_hf_throughput(resolve_model(model), work, args.device, args.hf_batches, dtype=dtype)
            results["throughput"] = {
                "engine": engine,
                "hf": hf,
                "ratio": engine["tok_per_s"] / hf["tok_per_s"],
            }
            print(
                f"[{model}] throughput: engine {engine['tok_per_s']:.1f} tok/s ({engine['seconds']:.1f} s), "
                f"HF static batches of {HF_BATCH} {hf['tok_per_s']:.1f} useful tok/s ({hf['raw_tok_per_s']:.1f} "
                f"raw; {hf['batches']} batches, {hf['seconds']:.1f} s) -> {results['throughput']['ratio']:.2f}x",
                flush=True,
            )
        if args.bench in ("all", "kv-waste"):
            # Fresh prompts: the throughput run left the first workload in the prefix cache.
            waste = results["kv_waste"] = bench_kv_waste(llm, workload(seed=1))
            print(
                f"[{model}] KV waste: steady state {waste['steady_mean']:.2%} mean / {waste['steady_max']:.2%} max "
                f"over {waste['steady_steps']} steps, whole run {waste['overall_mean']:.2%} "
                f"(block size {waste['block_size']})",
                flush=True,
            )
        if args.bench in ("all", "prefix"):
            prefix = results["prefix"] = bench_prefix(llm)
            print(
                f"[{model}] prefix caching: TTFT first {prefix['first_ttft_s'] * 1e3:.1f} ms, second (1,000 shared "
                f"tokens) {prefix['second_ttft_s'] * 1e3:.1f} ms -> {prefix['speedup']:.1f}x",
                flush=True,
            )
        if args.bench in ("all", "decode"):
            decode = results["decode"] = bench_decode(llm)
            line = ", ".join(f"{b}: {v:.0f}" for b, v in decode.items())
            print(f"[{model}] decode tok/s by batch size: {line}", flush=True)
        del llm
    report["load_average_at_end"] = os.getloadavg()[0]
    return report


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "bench", nargs="?", default="all", choices=["all", "throughput", "kv-waste", "prefix", "decode"]
    )
    parser.add_argument(
        "--model", action="append", help="tiny, smollm2-135m or a path (repeatable; default tiny)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--hf-batches", type=int, default=None, help="time only the first K HF batches of 8")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the engine's dtype (auto: the CPU's fast one); HF generate runs in the same resolved dtype",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.model = args.model or ["tiny"]
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), file=sys.stderr)
    return 0
