#!/usr/bin/env bash
# One call on the GPU machine (from the repository root there, with ".whl" carried: ../shared/device-wheels/stage.sh
# fills it): install the wheels the machine lacks, run the GPU tests, then throughput parts. Writes logs and result
# files into $OUT (or ./device-out). Usage:
#   bash benchmarks/device_check.sh COMMIT "PYTEST_PATHS|skip" "THROUGHPUT_ARGS|skip"
# e.g. bash benchmarks/device_check.sh abc1234 tests "--parts 32k --systems megatrain --no-sync"
set -uo pipefail
commit=$1 tests=$2 bench=$3
out=${OUT:-device-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} TORCH_EXTENSIONS_DIR=$PWD/.ext PYTHONUNBUFFERED=1
if [ "$tests" != skip ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -m gpu -p no:cacheprovider $tests 2>&1 | tee "$out/gpu-tests-$commit.log" | tail -15
fi
if [ "$bench" != skip ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/throughput.py $bench --out "$out" --commit "$commit" 2>&1 | tee "$out/throughput-$commit.log" \
    | grep -vE "^\s*$" | tail -25
fi
