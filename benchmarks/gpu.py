"""Triton kernels and end-to-end decode on a CUDA GPU; see `structgen.bench.kernels` (`--cpu-check` on a CPU)."""

from structgen.bench.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
