"""Kernels, one per module, each beside a pure-torch reference (installed as `structgen.kernels`): Triton kernels
for the GPU (`paged_attention_*`, `store_kv`, `apply_token_bitmask`) and native CPU kernels (`csrc/cpu_*.cpp`,
built on first use by `cpu_build`, launched from `cpu_ops`).

Nothing here imports the rest of structgen: kernels sit at the bottom of the layering."""
