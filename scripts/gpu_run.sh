#!/usr/bin/env bash
# On the GPU machine, from the repository root: install the carried wheels into /tmp/site and run a command with
# them on the path (from a directory where the source tree does not shadow the installed package).
#   scripts/gpu_run.sh python3 -m pytest -m gpu -q -s gpu        (run from tests/: see README)
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
dir=${ESS_RUN_DIR:-.}
cd "$dir"
exec "$@"
