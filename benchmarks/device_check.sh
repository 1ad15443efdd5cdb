#!/usr/bin/env bash
# The GPU checks, as one run on the lent device machine (torch 2.11 + Triton there, no package
# index). Prepare here, once:
#     python -m pip download --no-deps --only-binary=:all: -d .whl diskcache==5.6.3
# (.whl/ is git-ignored), then call the device tool's run with carry [".whl"], timeout_s 540 and
#     bash benchmarks/device_check.sh
# It runs tests/test_devices.py on cuda (about 1 min), then the cuda suite with --write (its own
# section of benchmarks/RESULTS.md and results_cuda.png; the issue asks for under 5 minutes), and
# leaves the logs and results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NEURON_EAGER_CACHE_DIR=/tmp/ae_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, diskcache, xxhash; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
start=$(date +%s)
timeout 150 python3 -m pytest -q tests/test_devices.py -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
tests=$?
timeout 330 python3 benchmarks/suite.py --device cuda --repeats 3 --write 2>&1 | tee "$OUT/suite.log"
suite=$?
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
cp benchmarks/results_cuda.png "$OUT/" 2>/dev/null
echo "device_check: tests rc=$tests, suite rc=$suite, $(( $(date +%s) - start )) s"
