"""`python benchmarks/mask_fill.py ...` is `structgen bench ...`: the code lives in `structgen/bench/mask_fill.py`."""

import sys

from structgen.bench.mask_fill import main

sys.exit(main())
