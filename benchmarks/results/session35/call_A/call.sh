#!/usr/bin/env bash
# session 35 (the twenty-sixth), call A: the plugin seam with the write-back in the resolve's finish (Q2) against the
# twenty-fifth session's seam (Q1, the write-back's own launch on the main stream) and the harness (P); then README's
# GPU tests (the seam test now the plugin's way)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
for cfg in "131072 64 0.994792946573272" "32768 64 0.9920540550931698"; do
  set -- $cfg
  PLAN=P,Q1,Q2 REPS=3 PYTHONPATH=/tmp/site timeout 170 python3 scratch/diag35.py $cfg > $OUT/a_$1_$2.txt 2>&1
  echo "$1/$2 rc=$? t=$(( $(date +%s) - T0 ))"; tail -11 $OUT/a_$1_$2.txt
done
mkdir -p $OUT/gpu_tests
(cd tests && PYTHONPATH=/tmp/site timeout 280 python3 -m pytest -m gpu -q -s -p no:cacheprovider gpu test_metrics.py test_indexer.py test_topk.py test_hisparse_harness.py test_sglang_topk.py > $OUT/gpu_tests/log.txt 2>&1)
echo "gpu tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -3 $OUT/gpu_tests/log.txt; grep -n "FAIL\|Error" $OUT/gpu_tests/log.txt | head -10
