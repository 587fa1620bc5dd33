"""`python benchmarks/sampler.py ...` is `structgen bench ...`: the code lives in `structgen/bench/sampler.py`."""

import sys

from structgen.bench.sampler import main

sys.exit(main())
