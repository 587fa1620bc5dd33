"""`python benchmarks/startup.py ...` is `structgen bench startup ...`: the code lives in
`structgen/bench/startup.py`."""

import sys

from structgen.bench.startup import main

sys.exit(main())
