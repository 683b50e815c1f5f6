#!/usr/bin/env bash
# The headline figures of BENCHMARKS.md, in one run, at torch's default settings (no
# --threads): run it on an otherwise quiet machine from the repository root.
#
#   bash benchmarks/headline.sh [OUT_DIR](default out/headline; takes about 10 minutes)
#
# 1. The transport table, 1 GiB, 7 timed syncs per cell: shm vs two memcpys at once,
#    zmq+tcp vs raw pyzmq, the fused fp32 -> bf16 cast vs bf16, 16 KiB vs 8 MiB tensors,
#    peak extra memory vs ring + largest tensor; CPU seconds per side; the project's
#    targets on it (benchmarks/targets.py).
# 2. shm vs verl's shared-memory path at its best bucket size, measured in one run
#    (benchmarks/baseline_verl.py).
# 3. Into vLLM: update_weights over shm vs vLLM's own reload_weights from in-memory tensors
#    of the same ~400 MiB bf16 Qwen3 (fp32 in the engine), alternating, per bucket size.
# 4. The demo on the same model size, at its defaults (quiet output).
set -euo pipefail
OUT=${1:-out/headline}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" -m streamsync bench --size 1GiB --runs 7 \
    --transport shm --transport zmq+tcp \
    --scenario dense --scenario dense-fp32-cast --scenario small-tensors --scenario large-tensors \
    --json "$OUT/bench.json" | tee "$OUT/bench.md"
"$PY" benchmarks/targets.py "$OUT/bench.json" | tee "$OUT/targets.md"
"$PY" benchmarks/baseline_verl.py --size 1GiB --runs 7 --json "$OUT/verl.json" \
    | tee "$OUT/verl.md"
"$PY" -m streamsync bench --vllm-only --runs 5 \
    --vllm-bucket-bytes 16MiB --vllm-bucket-bytes 32MiB --vllm-bucket-bytes 64MiB \
    --json "$OUT/vllm.json" | tee "$OUT/vllm.md"
"$PY" -m streamsync demo --steps 3 --json "$OUT/demo.json" | tee "$OUT/demo.txt"
