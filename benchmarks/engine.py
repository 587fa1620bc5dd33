"""`python benchmarks/engine.py ...` is `structgen bench ...`: the code lives in `structgen/bench/engine.py`."""

import sys

from structgen.bench.engine import main

sys.exit(main())
