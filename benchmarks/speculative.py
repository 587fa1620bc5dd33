"""`python benchmarks/speculative.py ...`: the code lives in `structgen/bench/speculative.py`."""

import sys

from structgen.bench.speculative import main

sys.exit(main())
