#!/usr/bin/env bash
# README command two: installs everything (scripts/setup.sh), builds the C++ tree with its tests,
# runs every test (CTest: unit + gpu labels; the fuzz targets for a bounded time, scripts/fuzz.sh;
# pytest: tests/python + tests/gpu). Without a GPU the GPU tests are reported as skipped, never as
# passed. Then the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer (clang) and
# the threaded ones under ThreadSanitizer (scripts/sanitize.sh, each building only what it runs);
# the core's checked suite (core_checked_test) runs there only, not in the plain tree
# (docs/results/reliability.md, "Sanitizers", says why nothing the -O2 build checks is lost).
# VRAMLEDGER_SANITIZERS=0 leaves the sanitizer phases out (a quicker local run), and the plain
# tree then builds and runs core_checked_test itself.
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
sanitizers="${VRAMLEDGER_SANITIZERS:-1}"
case "$sanitizers" in
  0) export VRAMLEDGER_CHECKED_TESTS=ON ;;
  1) export VRAMLEDGER_CHECKED_TESTS=OFF ;;
  *) echo "VRAMLEDGER_SANITIZERS must be 0 or 1, got '$sanitizers'" >&2; exit 2 ;;
esac
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
if [ "$sanitizers" = 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
  ./scripts/sanitize.sh asan
  phase asan
  echo "== ThreadSanitizer (build-tsan/)"
  ./scripts/sanitize.sh tsan
  phase tsan
fi
echo "== phase total: $((SECONDS - start)) s (CPU $(cpu_seconds) s)"
