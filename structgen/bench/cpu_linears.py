"""A model's linear products on the CPU by batch rows, each kernel this CPU has against the dense one.

    structgen bench cpu-linears [--rows 1,8,32,64,128,256,512] [--shapes 960x576,576x576,3072x576,576x1536]
                                [--layers 30] [--lm-head 49152x576] [--repeats 5] [--threads N] [--json OUT]

Each kernel computes every product of one forward (`--layers` times each of `--shapes`, N x K, 4-bit GGUF
blocks; the `--lm-head` once, 8-bit, as SmolLM2's GGUF has them; `--lm-head none` leaves it out) on random
weights and activations, and the table gives the milliseconds of the whole set, the best of `--repeats` after a
warm-up, and each kernel's time over the dense one's:

- `fp32 dense`: torch's packed fp32 product (oneDNN) on the dequantized weights, what an fp32 model's layers run
  without the quantized kernels;
- `bf16 dense`: the same in bf16, where the CPU computes bf16 natively (AVX512-BF16 or AMX);
- `int16-x GEMV (AVX2)`: `woq_gemv_avx2`, x quantized to int16 (VPMADDWD);
- `int8-x (AVX2)`: `woq_q8_avx2` on the 4-bit products (the lm-head stays on the int16 GEMV: 8-bit weights), x
  quantized to int8 (VPMADDUBSW), an fp32 model's prompt chunks with `--quantization w4a8`;
- `VNNI GEMV`: `woq_gemv` on bf16 x, where the CPU has AVX512-VNNI.

The defaults are SmolLM2-135M's (fused qkv, o, fused gate_up, down; 30 layers) at the row counts of a single
stream, decode batches, a structured step's forced tokens and prompt chunks.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_SHAPES = "960x576,576x576,3072x576,576x1536"
DEFAULT_ROWS = "1,8,32,64,128,256,512"


@dataclass(slots=True)
class _Product:
    packed: Any  # cpu_woq.WoqWeight
    dense_fp32: Callable[[torch.Tensor], torch.Tensor]
    dense_bf16: Callable[[torch.Tensor], torch.Tensor] | None


def _products(shapes: list[tuple[int, int, int]], *, bf16: bool, seed: int) -> list[_Product]:
    from structgen.kernels import cpu_woq
    from structgen.models.cpu_linear import PackedLinear

    gen = torch.Generator().manual_seed(seed)
    products = []
    for n, k, bits in shapes:
        d = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
        if bits == 4:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            packed = cpu_woq.pack_woq(q, d, -torch.rand(n, k // 32, generator=gen) * 0.1, bits=4)
        else:
            q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
            packed = cpu_woq.pack_woq(q8, d, bits=8)
        weight = cpu_woq.dequantize(packed, dtype=torch.float32).contiguous()
        dense_bf16 = PackedLinear.from_weight(weight.bfloat16()) if bf16 else None
        products.append(_Product(packed, PackedLinear.from_weight(weight), dense_bf16))
    return products


def _int8_x(product: _Product, x: torch.Tensor) -> Any:
    """The int8-x kernel on 4-bit products; 8-bit ones (the lm_head) have only the int16-x GEMV."""
    from structgen.kernels import cpu_woq

    if product.packed.bits == 4:
        return cpu_woq.woq_q8_avx2(x, product.packed)
    return cpu_woq.woq_gemv_avx2(x, product.packed)


def _kernels(*, native_bf16: bool) -> dict[str, tuple[torch.dtype, Callable[[_Product, torch.Tensor], Any]]]:
    """name -> (x's dtype, one product), for the kernels this CPU runs."""
    from structgen.kernels import cpu_woq

    kernels: dict[str, tuple[torch.dtype, Callable[[_Product, torch.Tensor], Any]]] = {
        "fp32 dense": (torch.float32, lambda p, x: p.dense_fp32(x)),
    }
    if native_bf16:
        kernels["bf16 dense"] = (torch.bfloat16, lambda p, x: p.dense_bf16(x))  # type: ignore[misc]
    if cpu_woq.avx2_gemv_available():
        kernels["int16-x GEMV (AVX2)"] = (torch.float32, lambda p, x: cpu_woq.woq_gemv_avx2(x, p.packed))
        kernels["int8-x (AVX2)"] = (torch.float32, _int8_x)
    if native_bf16 and cpu_woq.gemv_available():
        kernels["VNNI GEMV"] = (torch.bfloat16, lambda p, x: cpu_woq.woq_gemv(x, p.packed))
    return kernels


def measure(
    *, rows: list[int], shapes: list[tuple[int, int, int]], repeats: int, seed: int = 0
) -> dict[str, Any]:
    from structgen.kernels import cpu_build
    from structgen.models.loader import resolve_dtype

    if not cpu_build.load():
        raise SystemExit(
            f"cpu-linears: the native CPU kernels are unavailable ({cpu_build.unavailable_reason()})"
        )
    native_bf16 = resolve_dtype("auto", checkpoint_dtype=None, device="cpu") == torch.bfloat16
    products = _products(shapes, bf16=native_bf16, seed=seed)
    kernels = _kernels(native_bf16=native_bf16)
    gen = torch.Generator().manual_seed(seed + 1)
    in_features = sorted({k for _, k, _ in shapes})
    table: dict[str, dict[str, float]] = {}
    for count in rows:
        xs = {k: torch.randn(count, k, generator=gen) for k in in_features}
        by_dtype = {dtype: {k: x.to(dtype) for k, x in xs.items()} for dtype, _ in kernels.values()}
        times = {name: float("inf") for name in kernels}
        for run in range(repeats + 1):  # the kernels interleaved, each one's best kept; run 0 warms up
            for name, (dtype, product) in kernels.items():
                inputs = by_dtype[dtype]
                start = time.perf_counter()
                for p in products:
                    product(p, inputs[p.packed.in_features])
                if run:
                    times[name] = min(times[name], (time.perf_counter() - start) * 1e3)
        table[str(count)] = {name: round(ms, 2) for name, ms in times.items()}
    return {"kernels": list(kernels), "ms": table, "threads": torch.get_num_threads()}


def _shapes(text: str, lm_head: str, layers: int) -> list[tuple[int, int, int]]:
    per_layer = []
    for part in text.split(","):
        n, k = (int(v) for v in part.lower().split("x"))
        per_layer.append((n, k, 4))
    shapes = per_layer * layers
    if lm_head != "none":
        n, k = (int(v) for v in lm_head.lower().split("x"))
        shapes.append((n, k, 8))
    for n, k, _ in shapes:
        if n <= 0 or k <= 0 or n % 32 or k % 32:
            raise ValueError(f"each N x K needs N and K positive multiples of 32, got {n}x{k}")
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="batch rows, comma-separated")
    ap.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="a layer's 4-bit products, N x K, comma-separated"
    )
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--lm-head", default="49152x576", help="the 8-bit lm_head, N x K, or none")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        rows = [int(v) for v in args.rows.split(",")]
        shapes = _shapes(args.shapes, args.lm_head, args.layers)
    except ValueError as exc:
        ap.error(f"--rows takes integers and --shapes / --lm-head N x K pairs ({exc})")
    if min(rows) < 1 or args.layers < 1 or args.repeats < 1:
        ap.error("rows, --layers and --repeats must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(rows=rows, shapes=shapes, repeats=args.repeats)
    names = results["kernels"]
    print(
        f"{len(shapes)} products ({args.layers} layers of {args.shapes}, lm_head {args.lm_head}), "
        f"{results['threads']} threads; ms for all, best of {args.repeats} (kernel / fp32 dense)"
    )
    print("| rows | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
    for count, times in results["ms"].items():
        base = times["fp32 dense"]
        cells = [
            f"{times[n]:.1f}" + ("" if n == "fp32 dense" else f" ({times[n] / base:.2f})") for n in names
        ]
        print(f"| {count} | " + " | ".join(cells) + " |")
    if args.json:
        payload = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0
