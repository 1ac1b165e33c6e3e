#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz; clang, ASan + UBSan) in build-fuzz/ and runs each for a
# bounded time from its seed corpus (tests/fuzz/corpus/<target>/, crash reproducers included), then
# prints per target: executions, crashes, corpus size; and, for a long run (--seconds 120 or more,
# or --coverage), the allocator_ops_fuzz corpus's line coverage of allocator/core (per file, by
# scripts/fuzz_long.sh coverage). The many-core long run of allocator_ops_fuzz without
# sanitizers is scripts/fuzz_long.sh.
#   scripts/fuzz.sh                 # CI: 25 s per target
#   scripts/fuzz.sh --seconds 600   # long run (docs/results/reliability.md)
#   scripts/fuzz.sh --seconds 60 --targets "options_fuzz plan_fuzz"
# Exits 1 when a target crashed (the reproducer is in build-fuzz/crashes/). New corpus entries
# stay in build-fuzz/corpus/<target>/ (not the repository's seeds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SECONDS_PER_TARGET=25
TARGETS="allocator_ops_fuzz trace_reader_fuzz options_fuzz plan_fuzz"
COVERAGE=""
while (($#)); do
  case "$1" in
    --seconds) SECONDS_PER_TARGET="$2"; shift 2 ;;
    --targets) TARGETS="$2"; shift 2 ;;
    --coverage) COVERAGE=1; shift ;;
    *) echo "usage: scripts/fuzz.sh [--seconds N] [--targets \"T ...\"] [--coverage]" >&2; exit 2 ;;
  esac
done
if [ -z "$COVERAGE" ] && [ "$SECONDS_PER_TARGET" -ge 120 ]; then COVERAGE=1; fi

# Inputs larger than these add time per run and no new paths.
max_len() {
  case "$1" in
    allocator_ops_fuzz) echo 256 ;;
    options_fuzz) echo 256 ;;
    plan_fuzz) echo 1024 ;;
    *) echo 4096 ;;
  esac
}
dict_of() {
  case "$1" in
    options_fuzz) echo tests/fuzz/options.dict ;;
    plan_fuzz) echo tests/fuzz/plan.dict ;;
    trace_reader_fuzz) echo tests/fuzz/trace_reader.dict ;;
  esac
}

configure() {  # $1: build folder, then extra CMake arguments
  local dir="$1"; shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DVRAMLEDGER_FUZZ=ON -DVRAMLEDGER_BUILD_TESTS=OFF -DVRAMLEDGER_BUILD_BENCHMARKS=OFF \
    -DVRAMLEDGER_BUILD_CUDA=OFF -DVRAMLEDGER_BUILD_TORCH_PLUGIN=OFF -DVRAMLEDGER_BUILD_PYTHON=OFF \
    "$@" >/dev/null
}

command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (scripts/setup.sh installs it)" >&2; exit 1; }
echo "== fuzz: building $TARGETS (clang, ASan + UBSan, build-fuzz/)"
start=$(date +%s)
configure build-fuzz
# shellcheck disable=SC2086
cmake --build build-fuzz -j"$(nproc)" --target $TARGETS
echo "fuzz: built in $(( $(date +%s) - start )) s"

mkdir -p build-fuzz/crashes
failed=0
declare -A EXECS CRASHES UNITS
for t in $TARGETS; do
  work="build-fuzz/corpus/$t"
  mkdir -p "$work"
  log="build-fuzz/$t.log"
  args=(-max_total_time="$SECONDS_PER_TARGET" -max_len="$(max_len "$t")" -timeout=25
        -rss_limit_mb=3072 -print_final_stats=1 -artifact_prefix="build-fuzz/crashes/$t-")
  dict="$(dict_of "$t")"
  [ -n "$dict" ] && args+=(-dict="$dict")
  echo "== fuzz: $t for ${SECONDS_PER_TARGET} s"
  rc=0
  "build-fuzz/tests/fuzz/$t" "${args[@]}" "$work" "tests/fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  EXECS[$t]=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  UNITS[$t]=$(find "$work" "tests/fuzz/corpus/$t" -type f | wc -l)
  if [ "$rc" -ne 0 ]; then
    CRASHES[$t]=1
    failed=1
    echo "fuzz: $t crashed (exit $rc); the end of $log:" >&2
    tail -n 40 "$log" >&2
  else
    CRASHES[$t]=0
  fi
done

COV="-"
if [ -n "$COVERAGE" ] && [[ " $TARGETS " == *" allocator_ops_fuzz "* ]]; then
  echo "== fuzz: line coverage of allocator/core by the allocator_ops_fuzz corpus"
  scripts/fuzz_long.sh coverage build-fuzz/corpus/allocator_ops_fuzz | tee build-fuzz/coverage.txt
  COV=$(awk '$1 == "TOTAL" {print $7}' build-fuzz/coverage.txt)
fi

echo "== fuzz summary (${SECONDS_PER_TARGET} s per target; $(date -u +%Y-%m-%dT%H:%MZ))"
printf '%-20s %14s %8s %8s %s\n' target executions crashes corpus "core line coverage"
for t in $TARGETS; do
  cov="-"
  [ "$t" = allocator_ops_fuzz ] && cov="$COV"
  printf '%-20s %14s %8s %8s %s\n' "$t" "${EXECS[$t]:-?}" "${CRASHES[$t]}" "${UNITS[$t]}" "$cov"
done
exit "$failed"
