"""Kernel tests run on the CPU in Triton's interpreter. The switch is read when a kernel is decorated, so it is set
here, before any test module imports `structgen.kernels`."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
