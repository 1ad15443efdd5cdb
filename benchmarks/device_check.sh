#!/usr/bin/env bash
# The GPU checks, as one run on the lent device machine (torch 2.11 + Triton there, no package
# index). Prepare here, once:
#     python -m pip download --no-deps --only-binary=:all: -d .whl diskcache==5.6.3
# (.whl/ is git-ignored), then call the device tool's run with carry [".whl"], timeout_s 540 and
#     bash benchmarks/device_check.sh
# Under 10 minutes in all, each check under its own time limit: tests/test_devices.py on cuda (every
# test of this project that selects cuda: the rest skip or refuse cuda without a GPU), the user's
# loop with default options (benchmarks/user_step.py: eager, adaptive, torch.compile default and
# reduce-overhead; kernels and host synchronizations per step counted by the profiler and by
# torch.cuda.set_sync_debug_mode), then the cuda suite with --write (its own section of
# benchmarks/RESULTS.md and results_cuda.png). Logs and tables go to $OUT; the last thing printed
# is one table: each check, its exit status, its seconds, its log and its closing line.
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
rows=()
check() {  # check NAME SECONDS LOG COMMAND...: run one check under a time limit, keep its log, add a row
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error|Error|min;|\| adaptive \|" "$OUT/$log" | tail -1 | cut -c1-90)
  rows+=("| $name | $rc$([ $rc = 124 ] && echo ' (time limit)') | $(( $(date +%s) - t0 )) | $log | ${last:-} |")
}
check "tests/test_devices.py (cuda)" 120 tests.log python3 -m pytest -q tests/test_devices.py -p no:cacheprovider
check "user_step.py: the user's loop, default options" 180 user_step.log \
  python3 benchmarks/user_step.py --device cuda --only blocks8,rnn --steps 100
check "suite.py --device cuda" 240 suite.log python3 benchmarks/suite.py --device cuda --repeats 3 --write
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
cp benchmarks/results_cuda.png "$OUT/" 2>/dev/null
grep "^|" "$OUT/user_step.log" > "$OUT/user_step_table.md" 2>/dev/null
echo
echo "device_check: $(( $(date +%s) - start )) s; logs and tables in $OUT"
echo "| check | rc | s | log | last line |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
