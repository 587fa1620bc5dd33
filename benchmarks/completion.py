"""`python benchmarks/completion.py ...`: the code lives in `structgen/bench/completion.py`."""

import sys

from structgen.bench.completion import main

sys.exit(main())
