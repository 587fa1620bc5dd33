"""Where the real public test data lives: `../shared/data` beside the repository (read there, never copied)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
JSONSCHEMABENCH = DATA / "jsonschemabench"
VLLM_SAMPLES = DATA / "vllm-samples"
BFCL = DATA / "bfcl"
