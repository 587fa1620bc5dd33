"""`python benchmarks/llm_thread.py ...` is `structgen bench llm-thread ...`: the code lives in
`structgen/bench/llm_thread.py`."""

import sys

from structgen.bench.llm_thread import main

sys.exit(main())
