#!/usr/bin/env bash
# One call on the GPU machine (from the repository root there, with ".whl" carried: ../shared/device-wheels/stage.sh
# fills it): install the wheels the machine lacks, run the GPU tests, then throughput parts. Writes logs and result
# files into $OUT (or ./device-out); TESTS_S and BENCH_S bound each part (seconds). Usage:
#   bash benchmarks/device_check.sh COMMIT "PYTEST_PATHS|skip" "THROUGHPUT_ARGS|skip"
# e.g. bash benchmarks/device_check.sh abc1234 tests "--parts 32k --systems megatrain --no-sync"
set -uo pipefail
commit=$1 tests=$2 bench=$3
out=${OUT:-device-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} TORCH_EXTENSIONS_DIR=$PWD/.ext PYTHONUNBUFFERED=1
# Output goes to files, never through a pipe: torch.compile's workers outlive a killed pytest and keep a pipe (tee)
# open, so the call would hang until the device's limit. Each part has its own time limit (TESTS_S, BENCH_S).
if [ "$tests" != skip ]; then
  # shellcheck disable=SC2086
  TORCHINDUCTOR_COMPILE_THREADS=1 timeout -k 10 "${TESTS_S:-300}" python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
    $tests > "$out/gpu-tests-$commit.log" 2>&1 < /dev/null
  tail -15 "$out/gpu-tests-$commit.log"
fi
if [ "$bench" != skip ]; then
  # shellcheck disable=SC2086
  timeout -k 10 "${BENCH_S:-540}" python3 benchmarks/throughput.py $bench --out "$out" --commit "$commit" \
    > "$out/throughput-$commit.log" 2>&1 < /dev/null
  grep -vE "^\s*$" "$out/throughput-$commit.log" | tail -25
fi
