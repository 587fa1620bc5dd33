"""Triton kernels, one per module, each beside a pure-torch reference (installed as `structgen.kernels`).

Nothing here imports the rest of structgen: kernels sit at the bottom of the layering."""
