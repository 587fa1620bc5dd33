"""`python benchmarks/structured_engine.py ...` is `structgen bench ...`: the code lives in `structgen/bench/structured_engine.py`."""

import sys

from structgen.bench.structured_engine import main

sys.exit(main())
