"""`python benchmarks/lora.py ...`: the code lives in `structgen/bench/lora.py`."""

import sys

from structgen.bench.lora import main

sys.exit(main())
