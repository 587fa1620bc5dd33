"""Coverage of the structured-output layer over every JSONSchemaBench (MaskBench) schema.

For each schema: which backend `auto` picks and by which path (exact / rewritten / restricted / relaxed +
validated),
or why none can serve it; then each labelled instance (compact JSON, `ensure_ascii=False`) is walked
through the chosen grammar and validated with `jsonschema`:

- an invalid instance the chosen grammar accepts on the exact/rewritten/restricted path is a silently wrong
  acceptance (must be 0);
- an invalid instance that passes *both* the grammar and the validator would be presented as valid;
- llguidance alone on the raw schema is measured in the same run as the baseline.

Tasks run in forked worker processes killed at `--kill-after` seconds, so the run takes minutes:

    structgen bench coverage --workers 2 --out /tmp/coverage.jsonl [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from structgen.bench import shared_data

DATA = shared_data() / "jsonschemabench"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backends", default="llguidance,xgrammar,outlines")
    ap.add_argument("--time-limit", type=float, default=10.0, help="compile time limit per schema (s)")
    ap.add_argument("--kill-after", type=float, default=20.0, help="hard per-schema limit (s)")
    ap.add_argument("--limit", type=int, default=0, help="schemas per subset (0: all)")
    ap.add_argument("--out", type=Path, default=None, help="per-schema results (jsonl)")
    ap.add_argument("--json", type=Path, default=None, help="the summary numbers per subset")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    rows = []
    for path in sorted(args.data.glob("*.jsonl")):
        with path.open() as f:
            for k, line in enumerate(f):
                if args.limit and k >= args.limit:
                    break
                rows.append(json.loads(line))
    backends = args.backends.split(",")
    out = args.out.open("w") if args.out else None
    results: list[dict[str, Any]] = [{} for _ in rows]
    started = time.monotonic()
    done = 0

    def on_result(i: int, result: dict[str, Any]) -> None:
        nonlocal done
        result = {"id": rows[i]["id"], "subset": rows[i]["subset"], **result}
        results[i] = result
        done += 1
        if out:
            out.write(json.dumps(result) + "\n")
            out.flush()
        if done % 250 == 0:
            print(f"  {done}/{len(rows)} schemas, {time.monotonic() - started:.0f} s", file=sys.stderr)

    tasks = [(r["schema"], r.get("tests", []), backends, args.time_limit) for r in rows]
    _load_tokenizer()
    run_killable(tasks, _init, _work, workers=args.workers, timeout_s=args.kill_after, on_result=on_result)
    print(f"{len(rows)} schemas in {time.monotonic() - started:.0f} s with {args.workers} workers\n")
    numbers = report(results)
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2) + "\n")
    return 0


# -- per schema, in a worker --------------------------------------------------------------------------------


_TOKENIZER: Any = None


def _load_tokenizer() -> Any:
    """The `tiny` model's cl100k tokenizer, loaded once in the parent and inherited by each forked worker."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from structgen.models.registry import resolve_model
        from structgen.structured import TokenizerInfo
        from structgen.tokenizer import Tokenizer

        model_dir = resolve_model("tiny")
        tokenizer = Tokenizer.from_dir(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        _TOKENIZER = tokenizer, TokenizerInfo.from_tokenizer(tokenizer, vocab_size=config["vocab_size"])
    return _TOKENIZER


def _init() -> Any:
    from structgen.structured import create_backend

    tokenizer, info = _load_tokenizer()
    cache: dict[str, Any] = {}

    def backend(name: str) -> Any:
        if name not in cache:
            cache[name] = create_backend(name, info)
        return cache[name]

    return tokenizer, info, backend


def _work(state: Any, task: Any) -> dict[str, Any]:
    from structgen.structured import StructuredOutputError, StructuredOutputsParams, compile_spec
    from structgen.structured.validate import validate_json
    from structgen.validate.labels import grammar_accepts, instance_text

    tokenizer, info, backend = state
    schema, tests, names, time_limit = task
    res: dict[str, Any] = {}
    try:
        spec = StructuredOutputsParams(json=schema).to_spec()
    except StructuredOutputError as e:
        return {"outcome": "invalid", "error": str(e)[:300]}
    t0 = time.perf_counter()
    try:
        # The library on the raw schema: no normalization, none of our support checks.
        backend("llguidance")._compile(spec)
        res["llguidance_alone"] = True
    except Exception:
        res["llguidance_alone"] = False
    res["llguidance_alone_s"] = time.perf_counter() - t0
    try:
        compiled = compile_spec(spec, [backend(n) for n in names], time_limit_s=time_limit)
    except StructuredOutputError as e:
        keyword = getattr(e, "keyword", None)
        return {
            **res,
            "outcome": type(e).__name__,
            "keyword": keyword,
            "path": getattr(e, "path", None),
            "error": str(e)[:300],
        }
    res.update(
        outcome=compiled.serving_path,
        backend=compiled.backend,
        compile_s=compiled.compile_time_s,
        changes=sorted({f"{c.kind}:{c.keyword}" for c in compiled.changes}),
    )
    eos = info.eos_token_ids[0]
    counts: Counter[str] = Counter()
    for test in tests:
        text = instance_text(test["data"])
        if test["valid"]:
            forced, total = _jump_forward_share(
                compiled.new_grammar(), tokenizer.encode(text, add_special_tokens=False)
            )
            counts["jf_forced"] += forced
            counts["jf_total"] += total
        accepted = grammar_accepts(
            compiled.new_grammar(), tokenizer.encode(text, add_special_tokens=False), eos
        )
        validated = validate_json(text, schema).valid
        label = "valid" if test["valid"] else "invalid"
        counts[f"{label}"] += 1
        counts[f"{label}_accepted"] += accepted
        counts[f"{label}_validated"] += validated
        counts[f"{label}_presented_valid"] += accepted and validated
    res["tests"] = dict(counts)
    return res


def _jump_forward_share(grammar: Any, ids: list[int]) -> tuple[int, int]:
    """Replay a valid output: where the grammar forces tokens that are the output's own next tokens, they
    come from jump-forward (no forward pass); every other token is sampled. Returns (forced, total)."""
    forced = i = 0
    while i < len(ids):
        jump = grammar.find_jump_forward()
        if jump and ids[i : i + len(jump)] == jump:
            assert grammar.accept_tokens(jump)
            forced += len(jump)
            i += len(jump)
        elif grammar.accept_tokens(ids[i : i + 1]):
            i += 1
        else:
            return forced, i  # an instance the grammar refuses (e.g. another property order): stop here
    return forced, len(ids)


# -- report -------------------------------------------------------------------------------------------------


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the tables; return the per-subset outcome counts (what `--json` writes)."""
    by_subset: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_subset[r["subset"]].append(r)
    served_paths = ("exact", "rewritten", "restricted", "relaxed")
    head = (
        "| subset | schemas | llguidance alone | served | exact | rewritten | restricted | relaxed+validated "
        "| not served | killed |"
    )
    print(head)
    print("|---|" + "---:|" * (head.count("|") - 2))
    total: Counter[str] = Counter()
    numbers: dict[str, Any] = {"subsets": {}}
    for subset in sorted(by_subset):
        rs = by_subset[subset]
        c = Counter(r.get("outcome", "killed" if r.get("killed") else "error") for r in rs)
        alone = sum(bool(r.get("llguidance_alone")) for r in rs)
        served = sum(c[p] for p in served_paths)
        n = len(rs)
        not_served = n - served - c["killed"]
        total.update(c)
        numbers["subsets"][subset] = {"schemas": n, "llguidance_alone": alone, "served": served, **c}
        total["n"] += n
        total["alone"] += alone
        print(
            f"| {subset} | {n} | {_pct(alone, n)} | {_pct(served, n)} | {_pct(c['exact'], n)} | "
            f"{_pct(c['rewritten'], n)} | {_pct(c['restricted'], n)} | {_pct(c['relaxed'], n)} | {not_served} | "
            f"{c['killed']} |"
        )
    n = total["n"]
    served = sum(total[p] for p in served_paths)
    print(
        f"| **all** | {n} | {_pct(total['alone'], n)} | **{_pct(served, n)}** | {_pct(total['exact'], n)} | "
        f"{_pct(total['rewritten'], n)} | {_pct(total['restricted'], n)} | {_pct(total['relaxed'], n)} | "
        f"{n - served - total['killed']} | {total['killed']} |"
    )

    print("\nBackend chosen:", dict(Counter(r.get("backend") for r in results if r.get("backend"))))
    tests: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        if r.get("tests"):
            tests[r["outcome"]].update(r["tests"])
    print(
        "\n| path | valid instances accepted | invalid accepted by the grammar | invalid presented as valid |"
    )
    print("|---|---:|---:|---:|")
    for path in served_paths:
        t = tests[path]
        print(
            f"| {path} | {t['valid_accepted']}/{t['valid']} | {t['invalid_accepted']}/{t['invalid']} | "
            f"{t['invalid_presented_valid']} |"
        )
    jf = Counter()
    for r in results:
        if r.get("tests") and r.get("outcome") in served_paths:
            jf.update({k: v for k, v in r["tests"].items() if k.startswith("jf_")})
    if jf["jf_total"]:
        print(
            f"\nJump-forward: {jf['jf_forced']}/{jf['jf_total']} tokens of the valid instances are forced "
            f"({100 * jf['jf_forced'] / jf['jf_total']:.1f}%), so need no forward pass"
        )
    reasons = Counter(
        f"{r.get('outcome')}: {r.get('keyword')}" for r in results if r.get("outcome") not in served_paths
    )
    print("\nNot served:", dict(reasons.most_common(12)))
    relaxed = Counter(
        ch
        for r in results
        if r.get("outcome") == "relaxed"
        for ch in r.get("changes", [])
        if ch.startswith("relax")
    )
    rewritten = Counter(
        ch
        for r in results
        if r.get("outcome") in served_paths
        for ch in r.get("changes", [])
        if ch.startswith("rewrite")
    )
    print("Relaxed keywords (schemas):", dict(relaxed.most_common(12)))
    print("Rewrites (schemas):", dict(rewritten.most_common(12)))
    times = sorted(r["compile_s"] for r in results if "compile_s" in r)
    if times:
        print(
            f"Compile time: p50 {times[len(times) // 2] * 1e3:.1f} ms, p99 {times[int(len(times) * 0.99)] * 1e3:.0f} ms"
        )
    numbers["tests"] = {path: dict(tests[path]) for path in served_paths}
    return numbers


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:.1f}%" if n else "-"


# -- a process pool whose tasks can be killed ---------------------------------------------------------------


def run_killable(
    tasks: Iterable[Any],
    init: Callable[[], Any],
    work: Callable[[Any, Any], Any],
    *,
    workers: int,
    timeout_s: float,
    on_result: Callable[[int, Any], None],
) -> None:
    """`work(state, task)` in forked processes (`state = init()` once each); a task past `timeout_s` is
    reported as `{"killed": True}` and its process replaced. Grammar libraries compile in native code that
    Python cannot interrupt, so a deadline that holds needs a process to kill."""
    ctx = mp.get_context("fork")
    queue = list(enumerate(tasks))[::-1]

    def spawn() -> dict[str, Any]:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, init, work), daemon=True)
        proc.start()
        parent.recv()  # "ready": start-up time does not count against the first task
        return {"proc": proc, "conn": parent, "task": None, "t0": 0.0}

    def feed(w: dict[str, Any]) -> None:
        w["task"] = None
        if queue:
            w["task"], task = queue.pop()
            w["t0"] = time.monotonic()
            w["conn"].send(task)

    pool = [spawn() for _ in range(workers)]
    for w in pool:
        feed(w)
    while any(w["task"] is not None for w in pool):
        ready = wait([w["conn"] for w in pool if w["task"] is not None], timeout=0.25)
        for k, w in enumerate(pool):
            if w["task"] is None:
                continue
            if w["conn"] in ready:
                try:
                    result = w["conn"].recv()
                except EOFError:
                    result = {"crashed": True}
                on_result(w["task"], result)
                if result.get("crashed"):
                    pool[k] = spawn()
                    feed(pool[k])
                else:
                    feed(w)
            elif time.monotonic() - w["t0"] > timeout_s:
                w["proc"].kill()
                w["proc"].join()
                on_result(w["task"], {"killed": True})
                pool[k] = spawn()
                feed(pool[k])
    for w in pool:
        w["conn"].send(None)
        w["proc"].join(timeout=5)


def _serve(conn: Connection, init: Callable[[], Any], work: Callable[[Any, Any], Any]) -> None:
    state = init()
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            result = work(state, task)
        except Exception as e:
            result = {"outcome": "crash", "error": f"{type(e).__name__}: {e}"[:300]}
        conn.send(result)
