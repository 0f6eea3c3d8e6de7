#!/usr/bin/env bash
# session 36 (the twenty-seventh), call B: the spread across processes of the layer-wise rows at batch 64 / hit 0.95
# (32K and 128K) on 087bac4: three separate runs of call A's table flags, restricted to those rows and to the modes
# the ratio and the hidden share need (all-HBM, sync without spare slots, layer-wise with them)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
CAL=benchmarks/results/session32/call_E
CHUNKS="--prefetch-fractions 0.5,0.3,0.2 --prefetch-indexer chained --prefetch-split positions --last-chunk-prefetch off"
COMMON="--warm 3 --steps 8 --dba-split 0.75 --overlap-programs 16 --spare 0,0.2 --refill-interval 4 --topk sglang $CHUNKS"
for r in 1 2 3; do
  mkdir -p $OUT/run$r
  left=$(( 580 - ($(date +%s) - T0) )); [ $left -gt 175 ] && left=175
  PYTHONPATH=/tmp/site timeout $left python3 benchmarks/decode_layers.py $COMMON --contexts 32768,131072 --batches 64 --hits 0.95 --modes sync,layerwise --calibration $CAL/m0/decode_layers.json --calibration-margin $CAL/m001/decode_layers.json --out $OUT/run$r > $OUT/run$r/decode_layers.log 2>&1
  echo "run$r rc=$? t=$(( $(date +%s) - T0 ))"; rm -f $OUT/run$r/decode_layers.png
  grep -E "^ +(32K|128K) +64 " $OUT/run$r/decode_layers.log | grep -E "hbm|sync |layerwise"
done
