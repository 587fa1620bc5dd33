"""What the CPU kernels' arithmetic does to the model's predictions: teacher-forced scoring of real text with
`prompt_logprobs`, each quantization setting against a reference setting, in one run.

    structgen bench quality [--model smollm2-135m] [--quantization none,auto,w4a8] [--chunk 512] [--documents 32]
                            [--max-doc-tokens 384] [--threads N] [--json OUT]

The documents are BFCL questions each followed by its functions' JSON (`../shared/data/bfcl/`, or
`$STRUCTGEN_DATA`): English and JSON, what a structured-output service reads and writes. Every setting scores
the same token ids; the first setting listed is the reference. Per setting the table gives:

- `nll`, `ppl`: the mean negative log-likelihood of the documents' tokens (nats) and its perplexity;
- `dnll`: the mean of |this setting's logprob - the reference's| per token, and `max`: the largest;
- `top1`: the share of positions whose most likely next token is the reference's (what greedy decoding reads);
- `s`: the seconds the scoring took (a prefill throughput, with `--chunk` rows a step).

`--chunk` (the scheduler's token budget) decides which kernels run, because the quantized layers pick one by the
rows of a step (`structgen.models.cpu_linear`): up to 256 rows the int16-x GEMV (what decode batches run), above
it the dense fp32 product, or with `w4a8` int8-x up to 2,048 rows (what prompt chunks run). `none` is the dense
product of the same 4-bit weights: the exact reference for both.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from structgen.bench import shared_data
from structgen.config import QUANTIZATION_CHOICES


@dataclass(slots=True)
class Scores:
    """One setting's scoring of every document: per scored token its logprob and the best next token there."""

    logprobs: list[float]
    best: list[int]
    seconds: float


@dataclass(slots=True)
class Row:
    quantization: str
    chunk: int
    tokens: int
    nll: float
    ppl: float
    dnll_mean: float
    dnll_max: float
    top1_agreement: float
    seconds: float


def documents(data: Path, *, count: int) -> list[str]:
    """`count` texts: a BFCL question, then its functions as JSON (the simple and multiple files in turn)."""
    files = ["BFCL_v4_simple_python.json", "BFCL_v4_multiple.json"]
    entries = [[json.loads(line) for line in (data / "bfcl" / f).read_text().splitlines()] for f in files]
    texts = []
    for i in range(count):
        entry = entries[i % len(files)][i // len(files)]
        question = " ".join(turn["content"] for turn in entry["question"][0])
        texts.append(f"{question}\n{json.dumps(entry['function'])}")
    return texts


def score(
    model: str, quantization: str, prompts: list[list[int]], *, chunk: int, threads: int | None
) -> Scores:
    """Every prompt's tokens scored by `model` with `quantization`, `chunk` rows a step at most."""
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.llm_engine import LLMEngine
    from structgen.sampling_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    longest = max(len(p) for p in prompts)
    config = EngineConfig(
        model=model,
        quantization=quantization,
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_model_len=max(longest + 1, chunk)),
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params, stream=False)
        outputs: dict[str, Any] = {}
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] = out
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    logprobs: list[float] = []
    best: list[int] = []
    for i in range(len(prompts)):
        for entry in outputs[str(i)].prompt_logprobs[1:]:
            logprobs.append(entry.logprob)
            best.append(entry.top_logprobs[0][0])
    return Scores(logprobs, best, seconds)


def compare(quantization: str, chunk: int, scores: Scores, reference: Scores) -> Row:
    deltas = [abs(a - b) for a, b in zip(scores.logprobs, reference.logprobs, strict=True)]
    agree = sum(a == b for a, b in zip(scores.best, reference.best, strict=True))
    nll = -sum(scores.logprobs) / len(scores.logprobs)
    return Row(
        quantization=quantization,
        chunk=chunk,
        tokens=len(scores.logprobs),
        nll=nll,
        ppl=math.exp(nll),
        dnll_mean=sum(deltas) / len(deltas),
        dnll_max=max(deltas),
        top1_agreement=agree / len(scores.best),
        seconds=scores.seconds,
    )


def _settings(text: str) -> list[str]:
    settings = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in settings if s not in QUANTIZATION_CHOICES]
    if not settings or unknown:
        raise SystemExit(f"--quantization takes a list of {', '.join(QUANTIZATION_CHOICES)}; got {text!r}")
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structgen bench quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--quantization", default="none,auto,w4a8", help="settings to compare; the first is the reference"
    )
    parser.add_argument("--chunk", type=int, default=512, help="rows a step at most (the scheduler's budget)")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--max-doc-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data", type=Path, default=None, help="the shared data (default: ../shared/data)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    settings = _settings(args.quantization)
    if args.chunk < 1 or args.documents < 1 or args.max_doc_tokens < 2:
        raise SystemExit("--chunk and --documents must be >= 1, --max-doc-tokens >= 2")
    data = args.data or shared_data()
    if not (data / "bfcl").is_dir():
        raise SystemExit(f"no BFCL data under {data} (set --data or $STRUCTGEN_DATA)")

    from structgen.models.registry import resolve_model
    from structgen.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    texts = documents(data, count=args.documents)
    prompts = [tokenizer.encode(t)[: args.max_doc_tokens] for t in texts]
    print(f"{len(prompts)} documents, {sum(len(p) - 1 for p in prompts)} scored tokens, chunk {args.chunk}")
    all_scores = [score(args.model, q, prompts, chunk=args.chunk, threads=args.threads) for q in settings]
    rows = [compare(q, args.chunk, s, all_scores[0]) for q, s in zip(settings, all_scores, strict=True)]
    print(f"{'setting':<10} {'nll':>8} {'ppl':>8} {'dnll':>8} {'max':>7} {'top1':>7} {'s':>7}")
    for row in rows:
        print(
            f"{row.quantization:<10} {row.nll:8.4f} {row.ppl:8.3f} {row.dnll_mean:8.5f} {row.dnll_max:7.3f} "
            f"{row.top1_agreement:7.2%} {row.seconds:7.1f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0
