#!/usr/bin/env bash
# Everything a lent GPU is for, in ONE device call (start-up costs minutes; see the device tool's
# README): the Triton kernel and runtime tests on the real GPU, then benchmarks/gpu_decode.py.
# Results land in $OUT (the device tool brings that folder back) or benchmarks/results/.
#   here:   make gpu-wheels          (pytest for the GPU machine, which has none)
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".gpu-wheels"])
# A second call, if device time is left: the megakernel's knobs, A/B in one run each, e.g.
#   python benchmarks/gpu_decode.py --paths eager,graph,megakernel --mk-prefetch 1 --mk-programs-per-sm 2
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python -c "import pytest" 2>/dev/null && [ -d .gpu-wheels ]; then   # `make gpu-wheels`, carried
    python -m pip install -q --no-index --find-links .gpu-wheels pytest 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -x \
    tests/kernels/test_triton_dense.py \
    tests/runtime/test_plan.py tests/runtime/test_graph.py tests/runtime/test_megakernel.py \
    2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
# the tests may take 150 s of the call's 600: the benchmark stops itself by 400 s (later flags win)
python benchmarks/gpu_decode.py --out "$OUT/gpu_decode_$(date -u +%Y-%m-%d).json" --budget 300 --deadline 400 "$@" \
    2>&1 | tee "$OUT/gpu_decode.log" | tail -60
