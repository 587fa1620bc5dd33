#!/usr/bin/env bash
# One lent-GPU call (the device tool): the Triton kernels and 8B decode (`gpu.py`), then the whole engine on
# `tiny` (`gpu_engine.py`). The image there has torch and triton but none of the service's own dependencies:
# they travel as wheels in .whl (fetched here by benchmarks/gpu_wheels.sh), and the package is laid out by
# hand (kernels/ and grammars/ install inside structgen/). Every log lands in $OUT. A part whose timeout is 0
# is left out. See BENCHMARKS.md, "Triton kernels and GPU decode".
#   usage (on the device machine): bash benchmarks/gpu_lease.sh [KERNELS_TIMEOUT_S] [ENGINE_TIMEOUT_S] [gpu.py args]
set -u
kernels_s=${1:-240}
engine_s=${2:-180}
shift $(($# < 2 ? $# : 2))  # the rest goes to gpu.py
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/pkg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 3; }
rm -rf /tmp/pkg/structgen && cp -r structgen /tmp/pkg/ && cp -r kernels /tmp/pkg/structgen/kernels \
    && cp -r grammars /tmp/pkg/structgen/grammars
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
if [ "$kernels_s" -gt 0 ]; then  # a timeout of 0 leaves the part out
    timeout "$kernels_s" python3 benchmarks/gpu.py --json "$out/kernels.json" "$@" 2>&1 | tee "$out/kernels.log"
    echo "gpu.py exit: ${PIPESTATUS[0]}" | tee -a "$out/kernels.log"
fi
if [ "$engine_s" -gt 0 ]; then
    timeout "$engine_s" python3 benchmarks/gpu_engine.py --json "$out/engine.json" 2>&1 | tee "$out/engine.log"
    echo "gpu_engine.py exit: ${PIPESTATUS[0]}" | tee -a "$out/engine.log"
fi
