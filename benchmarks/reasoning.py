"""`python benchmarks/reasoning.py ...`: the code lives in `structgen/bench/reasoning.py`."""

import sys

from structgen.bench.reasoning import main

sys.exit(main())
