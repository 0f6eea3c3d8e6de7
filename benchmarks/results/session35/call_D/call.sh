#!/usr/bin/env bash
# session 35 (the twenty-sixth), call D: the GPU core tests' durations on the merged tail (call C's GPU tests ran
# 216 s against call A's 122); sync with spare slots (victims needed: the grid-wide waits run), merged (N) against
# three launches (NU)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
mkdir -p $OUT/gpu_tests
(cd tests && PYTHONPATH=/tmp/site timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12 gpu/test_gpu_core.py > $OUT/gpu_tests/log.txt 2>&1)
echo "gpu core tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -16 $OUT/gpu_tests/log.txt
for cfg in "131072 64 0.994792946573272" "32768 64 0.9920540550931698"; do
  set -- $cfg
  PLAN=N,NU REPS=2 PYTHONPATH=/tmp/site timeout 120 python3 scratch/diag35.py $cfg > $OUT/d_$1_$2.txt 2>&1
  echo "$1/$2 rc=$? t=$(( $(date +%s) - T0 ))"; tail -6 $OUT/d_$1_$2.txt
done
