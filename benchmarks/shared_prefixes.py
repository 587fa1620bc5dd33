"""`python benchmarks/shared_prefixes.py ...` is `structgen bench shared-prefixes ...`: the code lives in
`structgen/bench/shared_prefixes.py`."""

import sys

from structgen.bench.shared_prefixes import main

sys.exit(main())
