"""`python benchmarks/run_batch.py ...`: the code lives in `structgen/bench/run_batch.py`."""

import sys

from structgen.bench.run_batch import main

sys.exit(main())
