"""`python benchmarks/decode_attention.py ...` is `structgen bench decode-attention ...`: the code lives in
`structgen/bench/decode_attention.py`."""

import sys

from structgen.bench.decode_attention import main

sys.exit(main())
