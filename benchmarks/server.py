"""`python benchmarks/server.py ...`: the code lives in `structgen/bench/server.py`."""

import sys

from structgen.bench.server import main

sys.exit(main())
