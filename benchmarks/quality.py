"""`python benchmarks/quality.py ...` is `structgen bench quality ...`: the code lives in
`structgen/bench/quality.py`."""

import sys

from structgen.bench.quality import main

sys.exit(main())
