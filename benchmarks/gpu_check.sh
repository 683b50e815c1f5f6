#!/bin/bash
# The GPU checks, as one script for a session lent a GPU machine (see BENCHMARKS.md, "cuda-ipc
# on a GPU"). That machine has its own Python and torch, and no package index.
#
#   bash benchmarks/gpu_check.sh wheels   # here: the wheels it lacks, into .gpu/wheels
#   bash benchmarks/gpu_check.sh          # there (carry .gpu): install, test, measure
#
# Writes its logs under $OUT. Every step has its own time limit, so one that hangs costs
# only its own minutes of the lease.
set -u
if [ "${1:-}" = wheels ]; then
  mkdir -p .gpu/wheels
  exec .venv/bin/pip download -q -d .gpu/wheels --only-binary=:all: --no-deps \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    msgspec structlog pyzmq pytest pytest-asyncio pytest-timeout pluggy iniconfig
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
{
  date; nvidia-smi -L; python3 --version
  python3 -m pip install -q --no-index --no-deps .gpu/wheels/*.whl
  # Editable, so the transports' entry points are registered (PYTHONPATH alone registers none).
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
} >"$OUT/env.log" 2>&1
tail -3 "$OUT/env.log"
echo "== the CUDA tests (cuda-ipc conformance and the rest)"
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfEs \
  -k "cuda or Cuda or leftovers or waiting or nccl" tests/test_process_transports.py \
  >"$OUT/pytest.log" 2>&1
tail -15 "$OUT/pytest.log"
for mib in 16 64 256; do
  echo "== cuda-ipc, 1 GiB in $mib MiB buckets"
  timeout 60 python3 benchmarks/gpu_cuda_ipc.py --gib 1 --repeat 4 \
    --bucket-mib "$mib" --no-conformance 2>&1 | tail -1 | tee "$OUT/cuda_ipc_$mib.json"
done
echo "== torch+nccl (skipped with one GPU)"
timeout 120 python3 benchmarks/gpu_torch_nccl.py --gib 1 --repeat 3 2>&1 | tail -1 \
  | tee "$OUT/torch_nccl.json"
date
