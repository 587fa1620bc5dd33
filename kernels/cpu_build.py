"""Builds and loads the native CPU kernels (`csrc/cpu_*.cpp`) on first use, once a machine.

The kernels are compiled for the machine they run on (`-march=native`: AVX-512/BF16 where the CPU has it), so the
shared library is cached under a key of the sources, the compiler flags, torch's version and the CPU's feature
flags: `$STRUCTGEN_CACHE_DIR/kernels/` (default `~/.cache/structgen/kernels/`). Building needs a C++ compiler
(`$CXX`, else `c++`/`g++`/`clang++`) and takes ~30-60 s on two cores; concurrent first uses wait on one file lock.
Without a compiler, or when `STRUCTGEN_CPU_KERNELS=0`, `load()` returns False after one log line and callers keep
their pure-torch paths. The ops register as `torch.ops.structgen_cpu.*`; launchers are in `cpu_ops.py`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

import torch

logger = logging.getLogger("structgen.kernels")

ENV_SWITCH = "STRUCTGEN_CPU_KERNELS"
CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "cpu_paged_attention.cpp",
    "cpu_prefill_attention.cpp",
    "cpu_prefill_attention_avx2.cpp",
    "cpu_rms_norm.cpp",
    "cpu_rotary.cpp",
    "cpu_activation.cpp",
    "cpu_cache_write.cpp",
    "cpu_woq_linear.cpp",
    "cpu_woq_gemv.cpp",
    "cpu_woq_gemv_avx2.cpp",
    "cpu_woq_q8_avx2.cpp",
    "cpu_decode_step.cpp",
    "cpu_lora.cpp",
    "cpu_sparse_picks.cpp",
    "cpu_inverse_cdf.cpp",
    "cpu_narrow_logits.cpp",
    "cpu_token_scores.cpp",
)
HEADERS = (
    "cpu_avx2_vec.h",
    "cpu_common.h",
    "cpu_context_stager.h",
    "cpu_kernels.h",
    "cpu_prefill_avx2.h",
    "cpu_prefill_tiles.h",
    "cpu_woq_checks.h",
)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "reason": str


def load() -> bool:
    """Whether the native CPU ops are loaded (building them first if needed); never raises."""
    with _lock:
        if "loaded" not in _state:
            loaded, reason = _load()
            _state.update(loaded=loaded, reason=reason)
            if not loaded:
                logger.warning(
                    "native CPU kernels unavailable (%s): using the torch paths, which are slower", reason
                )
        return bool(_state["loaded"])


def unavailable_reason() -> str | None:
    """Why `load()` returned False (None before the first call or when loaded)."""
    return None if _state.get("loaded", True) else str(_state.get("reason"))


def _load() -> tuple[bool, str]:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{ENV_SWITCH}=0"
    compiler = _compiler()
    if compiler is None:
        return False, "no C++ compiler found (set CXX)"
    library = _cache_dir() / f"structgen_cpu_{_build_key(compiler)}.so"
    try:
        if not library.exists():
            _build(compiler, library)
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return (
            False,
            f"build or load failed: {str(exc).strip().splitlines()[-1][:300] if str(exc) else exc!r}",
        )
    return True, ""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("STRUCTGEN_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "structgen"
    return base / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join((compiler, *FLAGS, torch.__version__, _cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, library: Path) -> None:
    """Compile all sources into one shared library, atomically, under a lock other processes wait on."""
    import fcntl  # POSIX only, and only needed to build: imported here so this module loads anywhere

    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key right now
        if library.exists():
            return
        from torch.utils.cpp_extension import include_paths, library_paths

        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        lib_dirs = library_paths()
        command = [
            compiler,
            *FLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in include_paths()),
            f"-I{sysconfig.get_paths()['include']}",
            *(str(CSRC / s) for s in SOURCES),
            *(f"-L{p}" for p in lib_dirs),
            *(f"-Wl,-rpath,{p}" for p in lib_dirs),
            "-lc10",
            "-ltorch_cpu",
            "-o",
            str(library.with_suffix(".tmp.so")),
        ]
        logger.info("building the native CPU kernels (once per machine, ~30-60 s): %s", library.name)
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{result.stderr[-2000:]}")
        os.replace(library.with_suffix(".tmp.so"), library)
