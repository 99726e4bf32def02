#!/bin/bash
# One device call: install, GPU correctness suite, then timings of the schedule variants.
# Usage (on the device, repo root): bash benchmarks/device_check.sh "<bench args>"
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || tail -5 $OUT/pip.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${RUN_TESTS:-1}" = 1 ]; then
  # six workers where pytest-xdist is installed (the H200 image has it; no extra installs it)
  PARALLEL=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")
  BOB_COMPILE_TUNE=0 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x $PARALLEL -p no:cacheprovider \
    tests/gpu/test_gpu_native_node.py tests/gpu/test_gpu_kernels.py ${TEST_ARGS:-} > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -25 $OUT/gpu_tests.log
fi
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_attention.py --out $OUT $1 > $OUT/bench.log 2>&1
echo "bench rc=$?"; tail -60 $OUT/bench.log
