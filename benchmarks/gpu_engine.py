"""The whole engine (scheduler, sampler, structured masks) on a CUDA GPU; see `structgen.bench.gpu_engine`."""

from structgen.bench.gpu_engine import main

if __name__ == "__main__":
    raise SystemExit(main())
