#!/usr/bin/env bash
# session 35 (the twenty-sixth), call B: what the resolve's no-op launches cost (diagnostics T: K2 + K3 not launched,
# T4: and K4) against P, at 128K and 32K / 64, three repeats
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
for cfg in "131072 64 0.994792946573272" "32768 64 0.9920540550931698"; do
  set -- $cfg
  PLAN=P,T,T4 REPS=3 PYTHONPATH=/tmp/site timeout 200 python3 scratch/diag35.py $cfg > $OUT/b_$1_$2.txt 2>&1
  echo "$1/$2 rc=$? t=$(( $(date +%s) - T0 ))"; tail -11 $OUT/b_$1_$2.txt
done
