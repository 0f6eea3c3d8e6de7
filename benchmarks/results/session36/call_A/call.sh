#!/usr/bin/env bash
# session 36 (the twenty-seventh), call A: README's GPU tests on 087bac4 (3ae9a9a, 419b0af and d525436 had not run on
# a GPU), then the layer-wise table on the same code, as the twenty-sixth session's call F (session 32's call E
# calibration pair, read from where it is tracked)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
mkdir -p $OUT/gpu_tests $OUT/table
(cd tests && PYTHONPATH=/tmp/site timeout 250 python3 -m pytest -m gpu -q -s -p no:cacheprovider --durations=15 gpu test_metrics.py test_indexer.py test_topk.py test_hisparse_harness.py test_sglang_topk.py > $OUT/gpu_tests/log.txt 2>&1)
echo "gpu tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -3 $OUT/gpu_tests/log.txt; grep -n "FAIL\|Error" $OUT/gpu_tests/log.txt | head -10
CAL=benchmarks/results/session32/call_E
CHUNKS="--prefetch-fractions 0.5,0.3,0.2 --prefetch-indexer chained --prefetch-split positions --last-chunk-prefetch off"
COMMON="--warm 3 --steps 8 --dba-split 0.75 --overlap-programs 16 --spare 0,0.2 --refill-interval 4 --topk sglang $CHUNKS"
left=$(( 585 - ($(date +%s) - T0) ))
PYTHONPATH=/tmp/site timeout $left python3 benchmarks/decode_layers.py $COMMON --modes sync,prefetch,prefetch2,prefetch3,da,dba,layerwise --calibration $CAL/m0/decode_layers.json --calibration-margin $CAL/m001/decode_layers.json --out $OUT/table > $OUT/table/decode_layers.log 2>&1
echo "table rc=$? t=$(( $(date +%s) - T0 )) (limit $left)"; ls $OUT/table; tail -4 $OUT/table/decode_layers.log
