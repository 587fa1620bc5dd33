"""Tensor-parallel scaling on CPU (gloo) and communication volume on paper; see `structgen.bench.tp_scaling`."""

from structgen.bench.tp_scaling import main

if __name__ == "__main__":
    raise SystemExit(main())
