"""`python benchmarks/structured_coverage.py ...` is `structgen bench ...`: the code lives in `structgen/bench/structured_coverage.py`."""

import sys

from structgen.bench.structured_coverage import main

sys.exit(main())
