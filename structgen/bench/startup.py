"""How long structgen takes to start, each measure in fresh processes, against the start-up of earlier sessions.

    structgen bench startup [--model M] [--repeats 5] [--off exports,iri,gguf,packed,lazy-kv,lazy-pack]
                            [--measures ...]
                            [--json OUT]

Measures (the median of `--repeats` fresh processes, alternating the two sides when `--off` is given):
- `help`: `structgen --help`, process start to exit;
- `import`: a process that runs `import structgen.engine.llm, structgen.server.app` (torch, the engine, the
  server), start to exit;
- `engine`: `LLM(model=M)` in a process that has imported them (the model's files in the page cache: they are
  read once first, after converting a GGUF on the first run of a machine);
- `serve`: `structgen serve --model M` from process start until `GET /v1/models` answers, and `first`: the
  first chat completion after that (8 tokens);
- `generate`: `structgen generate --model M --prompt ... --max-tokens 16`, process start to exit (a one-shot
  command: start-up and one short request).

`--off` runs each measure a second time with parts of session 36's start-up switched off in the child processes,
for a before/after in the same code: `exports` (`structgen.structured` imports every module it exports, and so
torch and jsonschema, as soon as anything under it is imported: the CLI's help did), `iri` (rfc3987-syntax's IRI
parser built at import, as `jsonschema` builds it when nothing defers it) and `gguf` (GGUF headers read by the
`gguf` package's `GGUFReader`); and session 38's `packed` (the 4-bit kernels' weights built from the GGUF in
every process, not read from `structgen.models.packed_cache`); session 39's `lazy-kv` (every CPU KV cache committed
at start, as `structgen serve`'s is, where `LLM` and the one-shot commands now commit pages as blocks fill:
`CacheConfig.commit_cpu_kv_at_start`); session 40's `lazy-pack` (every CPU linear layer's weight reordered for
oneDNN at start, as `structgen serve`'s are, where `LLM` and the one-shot commands now reorder each at its first
product: `EngineConfig.pack_cpu_weights_at_start`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OFF_PARTS = ("exports", "iri", "gguf", "packed", "lazy-kv", "lazy-pack")

# Run first in a child with parts switched off: each puts the previous start-up back for that process.
_OFF_CODE = {
    "exports": "import structgen.structured as _s\nfor _name in _s.__all__:\n    getattr(_s, _name)\n",
    "iri": "import rfc3987_syntax.syntax_helpers\n",
    "gguf": (
        "import structgen.models.gguf as _gguf\n"
        "from structgen.bench.startup import gguf_package_reader as _reader\n"
        "_gguf.open_gguf = _reader\n"
    ),
    "packed": "import os as _os\n_os.environ['STRUCTGEN_PACKED_CACHE'] = '0'\n",
    "lazy-kv": (
        "import structgen.config as _config\n"
        "_cache_init = _config.CacheConfig.__init__\n"
        "def _committed(self, *args, **kwargs):\n"
        "    _cache_init(self, *args, **{**kwargs, 'commit_cpu_kv_at_start': True})\n"
        "_config.CacheConfig.__init__ = _committed\n"
    ),
    "lazy-pack": (
        "import structgen.config as _config\n"
        "_engine_init = _config.EngineConfig.__init__\n"
        "def _packed(self, *args, **kwargs):\n"
        "    _engine_init(self, *args, **{**kwargs, 'pack_cpu_weights_at_start': True})\n"
        "_config.EngineConfig.__init__ = _packed\n"
    ),
}


def preamble(off: set[str]) -> str:
    """The code a child runs first to switch `off` parts off."""
    return "".join(_OFF_CODE[part] for part in sorted(off))


def gguf_package_reader(path: str | Path) -> Any:
    """A `GGUFFile` read by the `gguf` package's `GGUFReader`, its metadata decoded as structgen did before."""
    from gguf import GGUFReader, GGUFValueType

    from structgen.models.gguf_file import GGUFFile, GGUFTensor

    reader = GGUFReader(path)

    def scalar(part: Any, kind: Any) -> Any:
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.tolist()[0]

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types[0] == GGUFValueType.ARRAY:
            metadata[key] = [scalar(field.parts[i], field.types[-1]) for i in field.data]
        else:
            metadata[key] = scalar(field.parts[field.data[0]], field.types[0])
    tensors = [GGUFTensor(t.name, t.tensor_type, t.shape, t.data) for t in reader.tensors]
    return GGUFFile(Path(path), int(metadata.get("GGUF.version", 3)), metadata, tensors)


def _python(code: str, *, off: set[str], timeout: float = 300) -> float:
    """Seconds a fresh interpreter takes to run `code` (after the `--off` preamble), or the last timing it prints."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", preamble(off) + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"the child process failed:\n{done.stderr[-2000:]}")
    timed = [line for line in done.stdout.splitlines() if line.startswith("SECONDS ")]
    return float(timed[-1].split()[1]) if timed else elapsed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(model: str, *, off: set[str], timeout: float = 300) -> tuple[float, float]:
    """(seconds until `GET /v1/models` answers, seconds of the first chat completion)."""
    port = _free_port()
    code = (
        preamble(off)
        + f"import sys\nfrom structgen.cli import main\nsys.exit(main(['serve', '--model', {model!r}, '--port', '{port}']))"
    )
    start = time.perf_counter()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    server = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"structgen serve exited with {server.returncode}:\n{server.stderr.read()[-2000:]}"
                )
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"structgen serve did not answer within {timeout:.0f} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as reply:
                    model_id = json.loads(reply.read())["data"][0]["id"]
                break
            except OSError:
                time.sleep(0.02)
        ready = time.perf_counter() - start
        body = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        first_start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
        return ready, time.perf_counter() - first_start
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


MEASURES = ("help", "import", "engine", "serve", "generate")


def measure(model: str, *, off: set[str], measures: Sequence[str] = MEASURES) -> dict[str, float]:
    """One fresh process of each measure (`serve` gives `serve` and `first`)."""
    timings: dict[str, float] = {}
    if "help" in measures:
        timings["help"] = _python(
            "import sys\nfrom structgen.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n",
            off=off,
        )
    if "import" in measures:  # the process's whole time, as for help: the `--off` preambles import too
        timings["import"] = _python("import structgen.engine.llm, structgen.server.app\n", off=off)
    if "engine" in measures:
        timings["engine"] = _python(
            "import time\nfrom structgen.engine.llm import LLM\nimport structgen.server.app\n"
            f"start = time.perf_counter()\nLLM(model={model!r})\nprint('SECONDS', time.perf_counter() - start)\n",
            off=off,
        )
    if "serve" in measures:
        timings["serve"], timings["first"] = _serve(model, off=off)
    if "generate" in measures:
        argv = ["generate", "--model", model, "--prompt", "Name three colors.", "--max-tokens", "16"]
        timings["generate"] = _python(f"from structgen.cli import main\nmain({argv!r})\n", off=off)
    return timings


def _warm_up(model: str) -> None:
    """Convert the model on a machine's first run (a GGUF's checkpoint, `tiny`'s random one), cache its packed
    weights (one `LLM` in a child), and bring its files into the page cache, so that no measure pays for these."""
    from structgen.models.packed_cache import cache_files
    from structgen.models.registry import resolve_model

    model_dir = resolve_model(model)
    _python(f"from structgen.engine.llm import LLM\nLLM(model={model!r})\n", off=set())
    for path in [*model_dir.rglob("*"), *cache_files()]:
        if path.is_file():
            with path.open("rb") as f:
                while f.read(1 << 24):
                    pass


def run(model: str, *, repeats: int, off: set[str], measures: Sequence[str] = MEASURES) -> dict[str, Any]:
    sides = {"now": set[str](), "off": off} if off else {"now": set[str]()}
    if {"engine", "serve", "generate"} & set(measures):
        _warm_up(model)
    samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, parts in sides.items():
            samples[side].append(measure(model, off=parts, measures=measures))
    medians = {
        side: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for side, runs in samples.items()
    }
    return {
        "model": model,
        "repeats": repeats,
        "off": sorted(off),
        "measures": list(measures),
        "median_s": medians,
        "samples": samples,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--off", default="", help="comma-separated, of: " + ", ".join(OFF_PARTS))
    ap.add_argument(
        "--measures", default=",".join(MEASURES), help="comma-separated, of: " + ", ".join(MEASURES)
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    off = set(filter(None, args.off.split(",")))
    measures = [m for m in MEASURES if m in args.measures.split(",")]
    if (
        off - set(OFF_PARTS)
        or args.repeats < 1
        or not measures
        or set(args.measures.split(",")) - set(MEASURES)
    ):
        ap.error(f"--off takes {', '.join(OFF_PARTS)}; --measures {', '.join(MEASURES)}; --repeats >= 1")
    result = run(args.model, repeats=args.repeats, off=off, measures=measures)
    medians = result["median_s"]
    print(f"{args.model}: start-up, median of {args.repeats} fresh processes, seconds")
    print("| measure | now |" + (f" off: {','.join(sorted(off))} | off / now |" if off else ""))
    print("|---|---:|" + ("---:|---:|" if off else ""))
    for key in medians["now"]:
        row = f"| {key} | {medians['now'][key]:.2f} |"
        if off:
            row += f" {medians['off'][key]:.2f} | {medians['off'][key] / medians['now'][key]:.2f}x |"
        print(row)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
