"""`python benchmarks/reliability.py ...` is `structgen bench reliability ...`: the code is in `structgen/bench/reliability.py`."""

import sys

from structgen.bench.reliability import main

sys.exit(main())
