"""`structgen bench lora`: requests spread over several LoRA adapters vs the same requests on the base model
(issue 21).

One engine with LoRA on (`max_loras` = `--adapters`, `max_lora_rank` = `--rank`) and `--adapters` random adapters
of rank `--rank` on q, k, v, o, gate, up and down of every layer (`structgen.lora.random_adapter`, written into a
temporary directory; lora_alpha = 2 x rank, the usual r=16/alpha=32 recipe). A pass sends `--requests` extraction
prompts at once (the workload of `bench completion`: meetings, contacts, orders), greedy and unconstrained, exactly
`--max-tokens` tokens each (EOS ignored, so both sides produce the same number of tokens whatever the weights
make of the prompts): the lora side's requests round-robin over the adapters, the base side's with none. The
sides alternate (base, lora, then lora, base, ...) and each sums the time of its own `engine.step()` calls. Pass k
tags its prompts with k, so that no pass reads another's from the prefix cache; the warm-up puts every adapter
into its slot and caches the chat template's shared prefix for both sides.

The base side runs on an engine of its own without LoRA (the same model loaded again), so the ratio is what
serving adapters costs against serving no adapters at all. Reported: output tokens/s of each
side, their ratio (target >= 0.8), whether every adapter output completed (`--max-tokens` tokens, finish reason
"length"; the exit status is 1 otherwise), how many adapter outputs differ from the base model's on the same
prompt (0 would mean the adapters were not applied), and the adapter slot loads and evictions.

    structgen bench lora [--model smollm2-135m] [--requests 32] [--adapters 4] [--rank 16] [--max-tokens 64]
        [--passes 4] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from structgen.bench.extraction_workload import extraction_requests

SIDES = ("base", "lora")
TARGET_RATIO = 0.8


@dataclass(slots=True)
class Side:
    """One side's counts over its measured passes."""

    seconds: float = 0.0
    tokens: int = 0
    completed: int = 0  # outputs of exactly max_tokens tokens, finished by length
    outputs: dict[str, list[int]] = field(default_factory=dict)  # "pass-index" -> token ids

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def make_llm(args: argparse.Namespace, *, lora: bool) -> Any:
    from structgen.engine.llm import LLM

    prompt_room = 256  # the extraction prompts are ~100 tokens with the chat template
    options: dict[str, Any] = {"enable_lora": True, "max_loras": args.adapters, "max_lora_rank": args.rank}
    return LLM(
        args.model,
        device=args.device,
        kv_cache_tokens=max(8192, 2 * args.requests * (args.max_tokens + prompt_room)),
        max_num_seqs=max(args.requests, 8),
        **(options if lora else {}),
    )


def write_adapters(
    llm: Any, directory: Path, *, count: int, rank: int, target_modules: list[str] | None = None
) -> list[Any]:
    """`count` random adapters for the engine's model in `directory`, as requests naming them (on every
    projection unless `target_modules` names some)."""
    from structgen.lora import LoRARequest
    from structgen.lora.random_adapter import write_random_adapter

    requests = []
    for i in range(count):
        path = write_random_adapter(
            directory / f"adapter-{i}",
            llm.engine.model_dir,
            rank=rank,
            alpha=2 * rank,
            seed=i,
            **({"target_modules": target_modules} if target_modules else {}),
        )
        requests.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
    return requests


def prompts(tokenizer: Any, count: int, tag: str) -> list[dict[str, Any]]:
    """`count` extraction prompts as token ids, each opening with `tag` (a pass's own prompts)."""
    out = []
    for item in extraction_requests(count, seed=7):
        message = {**item.messages[0], "content": f"Ticket {tag}: {item.messages[0]['content']}"}
        text = tokenizer.apply_chat_template([message], add_generation_prompt=True)
        out.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return out


def run_pass(
    engine: Any,
    batch: list[dict[str, Any]],
    loras: list[Any],
    side: Side | None,
    *,
    max_tokens: int,
    tag: str,
) -> None:
    """Every prompt of `batch` at once (prompt i with adapter `loras[i]`, None: the base model) to completion,
    counted into `side` (None: a warm-up)."""
    from structgen.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(batch, loras, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, params, stream=False, lora_request=lora)
    seconds, finished = 0.0, []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        seconds += time.perf_counter() - start
        finished += [out for out in outputs if out.finished]
    if side is None:
        return
    side.seconds += seconds
    for out in finished:
        output = out.outputs[0]
        side.tokens += len(output.token_ids)
        side.completed += len(output.token_ids) == max_tokens and output.finish_reason == "length"
        side.outputs[out.request_id.split("-", 1)[1]] = list(output.token_ids)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    llms = {"base": make_llm(args, lora=False), "lora": make_llm(args, lora=True)}
    engines = {side: llm.engine for side, llm in llms.items()}
    sides = {side: Side() for side in SIDES}
    per_pass: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        with tempfile.TemporaryDirectory(prefix="structgen-bench-lora-") as directory:
            adapters = write_adapters(
                llms["lora"],
                Path(directory),
                count=args.adapters,
                rank=args.rank,
                target_modules=args.target_modules,
            )
            loras_of = {
                "base": [None] * args.requests,
                "lora": [adapters[i % len(adapters)] for i in range(args.requests)],
            }
            tokenizer = engines["lora"].tokenizer
            # An unmeasured pass of the measured shape per side: every adapter into its slot, the chat template's
            # shared prefix cached, and the kernels' first calls at each batch size behind them.
            warm = prompts(tokenizer, args.requests, "warm-up")
            for side in SIDES:
                run_pass(
                    engines[side], warm, loras_of[side], None, max_tokens=args.max_tokens, tag=f"warm-{side}"
                )
            for k in range(args.passes):
                batch = prompts(tokenizer, args.requests, f"p{k}")
                for side in SIDES if k % 2 == 0 else SIDES[::-1]:
                    tally, before = sides[side], (sides[side].tokens, sides[side].seconds)
                    run_pass(
                        engines[side],
                        batch,
                        loras_of[side],
                        tally,
                        max_tokens=args.max_tokens,
                        tag=f"{side}{k}",
                    )
                    per_pass[side].append((tally.tokens - before[0]) / (tally.seconds - before[1]))
    finally:
        for llm in llms.values():
            llm.shutdown()
    engine = engines["lora"]
    base, lora = sides["base"], sides["lora"]
    ratio = lora.rate() / base.rate() if base.rate() else 0.0
    outputs = args.requests * args.passes
    return {
        "model": args.model,
        "requests": args.requests,
        "adapters": args.adapters,
        "rank": args.rank,
        "target_modules": args.target_modules or "all",
        "max_tokens": args.max_tokens,
        "passes": args.passes,
        "base_tok_s": round(base.rate(), 1),
        "lora_tok_s": round(lora.rate(), 1),
        "ratio": round(ratio, 3),
        "ratio_per_pass": [round(a / b, 3) for a, b in zip(per_pass["lora"], per_pass["base"], strict=True)],
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "lora_completed": f"{lora.completed}/{outputs}",
        "base_completed": f"{base.completed}/{outputs}",
        "all_lora_completed": lora.completed == outputs,
        # Adapter outputs unlike the base model's on the same prompt: 0 would mean no adapter was applied.
        "lora_differ_from_base": sum(tokens != base.outputs.get(key) for key, tokens in lora.outputs.items()),
        "slot_loads": engine.lora.num_slot_loads,
        "evictions": engine.lora.num_evictions,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registry name or path (default %(default)s)")
    ap.add_argument(
        "--requests", type=int, default=32, help="concurrent requests per pass (default %(default)s)"
    )
    ap.add_argument(
        "--adapters", type=int, default=4, help="random adapters, = max_loras (default %(default)s)"
    )
    ap.add_argument("--rank", type=int, default=16, help="rank of every adapter module (default %(default)s)")
    ap.add_argument(
        "--target-modules",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        default=None,
        help="comma-separated projections the adapters adapt, e.g. q_proj,v_proj (default: all seven)",
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per output (default %(default)s)")
    ap.add_argument("--passes", type=int, default=4, help="measured passes per side (default %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if min(args.requests, args.adapters, args.rank, args.max_tokens, args.passes) < 1:
        ap.error("--requests, --adapters, --rank, --max-tokens and --passes must be >= 1")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    result = measure(args)
    print(f"{'side':6} {'tok/s':>9} {'completed':>10}")
    print(f"{'base':6} {result['base_tok_s']:9} {result['base_completed']:>10}")
    print(f"{'lora':6} {result['lora_tok_s']:9} {result['lora_completed']:>10}")
    verdict = "meets" if result["meets_target"] else "below"
    print(
        f"ratio lora/base: {result['ratio']} ({verdict} the {TARGET_RATIO}x target; per pass: "
        f"{result['ratio_per_pass']}); adapter outputs unlike the base model's: "
        f"{result['lora_differ_from_base']}; slot loads {result['slot_loads']}, evictions {result['evictions']}"
    )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["all_lora_completed"] else 1
