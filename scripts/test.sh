#!/usr/bin/env bash
# README command two: installs everything (scripts/setup.sh), builds the C++ tree with its tests,
# runs every test (CTest: unit + gpu labels; the fuzz targets for a bounded time, scripts/fuzz.sh;
# pytest: tests/python + tests/gpu). Without a GPU the GPU tests are reported as skipped, never as
# passed. VRAMLEDGER_SANITIZERS=1 then runs the CPU tests again under AddressSanitizer +
# UndefinedBehaviorSanitizer and the threaded ones under ThreadSanitizer (scripts/sanitize.sh):
# two more builds, about 20 minutes on two cores, which would take CI past its 45 minutes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup.sh
./scripts/build.sh
echo "== C++ tests (CTest)"
(cd build-ci && ctest --output-on-failure -j"$(nproc)")
echo "== Fuzz targets (libFuzzer, 25 s each from their seed corpora)"
./scripts/fuzz.sh
echo "== Python tests (pytest)"
.venv/bin/python -m pytest -q -rs tests/python tests/gpu
if [ "${VRAMLEDGER_SANITIZERS:-0}" = 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
  ./scripts/sanitize.sh asan
  echo "== ThreadSanitizer (build-tsan/)"
  ./scripts/sanitize.sh tsan
fi
