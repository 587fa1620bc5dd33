"""Tensor parallelism over torch.distributed: rank 0 is the engine's own process, ranks 1..N-1 are workers.

Rank 0 schedules, applies structured-output masks and samples; every step it broadcasts the flattened batch
(`step_io`) and all ranks run their shard of the forward (`structgen.models.linear` does the all-reduces and
gathers the logits to rank 0). `TensorParallelGroup` (`group.py`) starts and stops the workers (`worker.py`).
"""

from structgen.distributed.group import TensorParallelGroup
from structgen.distributed.parallel_state import TensorParallelError, check_tensor_parallel

__all__ = ["TensorParallelError", "TensorParallelGroup", "check_tensor_parallel"]
