"""`python benchmarks/prefill_attention.py ...` is `structgen bench prefill-attention ...`: the code lives in
`structgen/bench/prefill_attention.py`."""

import sys

from structgen.bench.prefill_attention import main

sys.exit(main())
