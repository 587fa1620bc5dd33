"""`python benchmarks/tools.py ...`: the code lives in `structgen/bench/tools.py`."""

import sys

from structgen.bench.tools import main

sys.exit(main())
