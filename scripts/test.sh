#!/usr/bin/env bash
# README command two: installs everything (scripts/setup.sh), builds the C++ tree with its tests,
# runs every test (CTest: unit + gpu labels; the fuzz targets for a bounded time, scripts/fuzz.sh;
# pytest: tests/python + tests/gpu). Without a GPU the GPU tests are reported as skipped, never as
# passed. VRAMLEDGER_SANITIZERS=1 then runs the CPU tests again under AddressSanitizer +
# UndefinedBehaviorSanitizer and the threaded ones under ThreadSanitizer (scripts/sanitize.sh,
# each building only what it runs). They stay out of the default run while one gcc 12 UBSan
# report is open and their full length on an idle machine is unmeasured
# (docs/results/reliability.md, "Sanitizers").
# Each phase ends with a line `== phase NAME: N s (CPU M s)`; the last one gives the total.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# CPU seconds of the finished child processes: with other work on the machine a phase's wall
# time grows, its CPU time does not (wall on an idle machine is about CPU / cores for builds).
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{print int(($16 + $17) / hz)}' /proc/$$/stat; }
start=$SECONDS
phase_start=$SECONDS
phase_cpu=0
phase() {  # ends the current phase, printing its wall and CPU seconds
  local cpu
  cpu=$(cpu_seconds)
  echo "== phase $1: $((SECONDS - phase_start)) s (CPU $((cpu - phase_cpu)) s)"
  phase_start=$SECONDS
  phase_cpu=$cpu
}
./scripts/setup.sh
phase setup
./scripts/build.sh
phase build
echo "== C++ tests (CTest)"
(cd build-ci && ctest --output-on-failure -j"$(nproc)")
phase ctest
echo "== Fuzz targets (libFuzzer, 25 s each from their seed corpora)"
./scripts/fuzz.sh
phase fuzz
echo "== Python tests (pytest)"
.venv/bin/python -m pytest -q -rs tests/python tests/gpu
phase pytest
if [ "${VRAMLEDGER_SANITIZERS:-0}" = 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
  ./scripts/sanitize.sh asan
  phase asan
  echo "== ThreadSanitizer (build-tsan/)"
  ./scripts/sanitize.sh tsan
  phase tsan
fi
echo "== phase total: $((SECONDS - start)) s (CPU $(cpu_seconds) s)"
