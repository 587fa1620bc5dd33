"""`python benchmarks/peers.py ...` is `structgen bench peers ...`: the code lives in `structgen/bench/peers.py`."""

import sys

from structgen.bench.peers import main

sys.exit(main())
