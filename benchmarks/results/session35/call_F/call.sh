#!/usr/bin/env bash
# session 35 (the twenty-sixth), call F: the layer-wise table (call E ran past its 240 s limit) on c50dc71 (the resolve's K2-K4 one launch with spare
# slots; the write-back in the finish only for the plugin), from session 32's call E calibration (as call G of session 34)
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
mkdir -p $OUT/table
CHUNKS="--prefetch-fractions 0.5,0.3,0.2 --prefetch-indexer chained --prefetch-split positions --last-chunk-prefetch off"
COMMON="--warm 3 --steps 8 --dba-split 0.75 --overlap-programs 16 --spare 0,0.2 --refill-interval 4 --topk sglang $CHUNKS"
PYTHONPATH=/tmp/site timeout 330 python3 benchmarks/decode_layers.py $COMMON --modes sync,prefetch,prefetch2,prefetch3,da,dba,layerwise --calibration scratch/cal33/m0/decode_layers.json --calibration-margin scratch/cal33/m001/decode_layers.json --out $OUT/table > $OUT/table/decode_layers.log 2>&1
echo "table rc=$? t=$(( $(date +%s) - T0 ))"; ls $OUT/table; tail -5 $OUT/table/decode_layers.log
