"""`python benchmarks/cpu_linears.py ...` is `structgen bench cpu-linears ...`: the code lives in
`structgen/bench/cpu_linears.py`."""

import sys

from structgen.bench.cpu_linears import main

sys.exit(main())
