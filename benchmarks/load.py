"""`python benchmarks/load.py ...` is `structgen bench load ...`: the code lives in `structgen/bench/load.py`."""

import sys

from structgen.bench.load import main

sys.exit(main())
