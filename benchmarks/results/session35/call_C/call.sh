#!/usr/bin/env bash
# session 35 (the twenty-sixth), call C: README's GPU tests on the merged resolve tail (c50dc71: K2-K4 one launch
# with spare slots, grid-wide waits), first (a hang would show there); then P (merged) against U (three launches)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
mkdir -p $OUT/gpu_tests
(cd tests && PYTHONPATH=/tmp/site timeout 240 python3 -m pytest -m gpu -q -s -p no:cacheprovider gpu test_metrics.py test_indexer.py test_topk.py test_hisparse_harness.py test_sglang_topk.py > $OUT/gpu_tests/log.txt 2>&1)
echo "gpu tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -3 $OUT/gpu_tests/log.txt; grep -n "FAIL\|Error" $OUT/gpu_tests/log.txt | head -10
for cfg in "131072 64 0.994792946573272" "32768 64 0.9920540550931698"; do
  set -- $cfg
  PLAN=P,U REPS=4 PYTHONPATH=/tmp/site timeout 150 python3 scratch/diag35.py $cfg > $OUT/c_$1_$2.txt 2>&1
  echo "$1/$2 rc=$? t=$(( $(date +%s) - T0 ))"; tail -10 $OUT/c_$1_$2.txt
done
