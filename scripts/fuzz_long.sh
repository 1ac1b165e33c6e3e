#!/usr/bin/env bash
# The long run of allocator_ops_fuzz (tests/fuzz), on as many cores as it is given.
#
#   scripts/fuzz_long.sh build
#       here (needs clang 14): builds the target with -O2, the fuzzer's instrumentation and no
#       sanitizer (several times faster per execution than CI's ASan + UBSan build; the target's
#       own checks find invariant violations), Abseil, zlib, libstdc++ and libgcc linked
#       statically, into .devbuild/fuzz/allocator_ops_fuzz (ignored by git; it needs only glibc,
#       so it runs on the GPU machine, which has neither clang nor Abseil). FUZZ_SANITIZERS=undefined
#       builds the UBSan variant instead (.devbuild/fuzz/allocator_ops_fuzz_ubsan).
#   scripts/fuzz_long.sh run [--seconds S] [--jobs N] [--out DIR] [--binary PATH] [--corpus DIR]
#       runs the binary with libFuzzer's -fork=N for S seconds from the seed corpus
#       (tests/fuzz/corpus/allocator_ops_fuzz, plus --corpus DIR when given: a corpus grown by an
#       earlier run) and prints one summary line: executions, exec/s (all jobs, and per job),
#       crashes, timeouts, out-of-memory inputs, the corpus's size and how much it grew.
#       DIR (default build-fuzz-long/run) receives fuzz.log, summary.txt, corpus/ (the merged
#       corpus) and crashes/ (every crashing input, with its log in fuzz.log).
#       Defaults: 600 s, nproc jobs, .devbuild/fuzz/allocator_ops_fuzz.
#   scripts/fuzz_long.sh coverage [CORPUS_DIR ...]
#       here: builds the target with source-based coverage (build-fuzz-cov/, as scripts/fuzz.sh
#       --coverage), runs the seed corpus and each CORPUS_DIR (e.g. a run's DIR/corpus, unpacked
#       from the GPU machine's fuzz-long.tar.gz) through it and prints the line coverage of each
#       allocator/core/*.cc file and the total (build-fuzz-cov/core.txt: llvm-cov's whole report).
# Exit status of `run`: 0 when nothing crashed, 1 when an input crashed (or broke a check),
# 2 on a usage error or a missing binary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET=allocator_ops_fuzz
SEEDS="tests/fuzz/corpus/$TARGET"
MAX_LEN=256  # as scripts/fuzz.sh: longer inputs add time per run, no new paths

build() {
  command -v clang++ >/dev/null || { echo "fuzz_long: clang++ not found" >&2; exit 2; }
  local san="${FUZZ_SANITIZERS:-}" dir=build-fuzz-long name="$TARGET"
  if [ -n "$san" ]; then dir="build-fuzz-long-${san//,/-}"; name="${TARGET}_${san//,/-}"; fi
  [ "$san" = undefined ] && name="${TARGET}_ubsan"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DVRAMLEDGER_FUZZ=ON -DVRAMLEDGER_FUZZ_SANITIZERS="$san" -DVRAMLEDGER_FUZZ_STATIC=ON \
    -DVRAMLEDGER_BUILD_TESTS=OFF -DVRAMLEDGER_BUILD_BENCHMARKS=OFF -DVRAMLEDGER_BUILD_CUDA=OFF \
    -DVRAMLEDGER_BUILD_TORCH_PLUGIN=OFF -DVRAMLEDGER_BUILD_PYTHON=OFF >/dev/null
  cmake --build "$dir" -j"${JOBS:-2}" --target "$TARGET"
  mkdir -p .devbuild/fuzz
  # Debug info stays here (build folder): addresses in a crash's stack are read back with it.
  strip --strip-debug -o ".devbuild/fuzz/$name" "$dir/tests/fuzz/$TARGET"
  local deps
  deps="$(ldd ".devbuild/fuzz/$name" | awk '{print $1}' |
    grep -vE '^(linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|/lib64/ld-linux-x86-64\.so\.2)$' || true)"
  if [ -n "$deps" ]; then
    echo "fuzz_long: .devbuild/fuzz/$name needs more than glibc: $deps" >&2
    exit 1
  fi
  echo "fuzz_long: built .devbuild/fuzz/$name ($(du -h ".devbuild/fuzz/$name" | cut -f1);" \
    "needs $(ldd ".devbuild/fuzz/$name" | awk '{print $1}' | tr '\n' ' '))"
}

run() {
  local seconds=600 jobs out=build-fuzz-long/run bin=".devbuild/fuzz/$TARGET" extra=""
  jobs="$(nproc)"
  while (($#)); do
    case "$1" in
      --seconds) seconds="$2"; shift 2 ;;
      --jobs) jobs="$2"; shift 2 ;;
      --out) out="$2"; shift 2 ;;
      --binary) bin="$2"; shift 2 ;;
      --corpus) extra="$2"; shift 2 ;;
      *) echo "usage: scripts/fuzz_long.sh run [--seconds S] [--jobs N] [--out DIR]" \
           "[--binary PATH] [--corpus DIR]" >&2; exit 2 ;;
    esac
  done
  [ -x "$bin" ] || { echo "fuzz_long: no $bin (scripts/fuzz_long.sh build)" >&2; exit 2; }
  rm -rf "$out/corpus" "$out/crashes"
  mkdir -p "$out/corpus" "$out/crashes"
  cp "$SEEDS"/* "$out/corpus/"
  if [ -n "$extra" ] && [ -d "$extra" ]; then cp -n "$extra"/* "$out/corpus/" 2>/dev/null || true; fi
  local before after rc=0 t0
  before=$(find "$out/corpus" -type f | wc -l)
  t0=$(date +%s)
  # -fork: N worker processes, each fuzzing for a while from the merged corpus, their new inputs
  # merged back into $out/corpus. -ignore_crashes=1: a crash is saved and the run goes on, so
  # one run can find several. Timeouts and out-of-memory inputs are saved too.
  timeout $(( seconds + 120 )) "$bin" -fork="$jobs" -ignore_crashes=1 -max_total_time="$seconds" \
    -max_len="$MAX_LEN" -timeout=25 -rss_limit_mb=2048 -artifact_prefix="$out/crashes/" \
    "$out/corpus" >"$out/fuzz.log" 2>&1 || rc=$?
  local took=$(( $(date +%s) - t0 ))
  after=$(find "$out/corpus" -type f | wc -l)
  # Fork mode's status lines: "#EXECS: cov: C ft: F corp: N exec/s: R oom/timeout/crash: O/T/C ..."
  local last execs=0
  last="$(grep -E '^#[0-9]+: cov:' "$out/fuzz.log" | tail -1 || true)"
  [ -n "$last" ] && execs="$(echo "$last" | sed -E 's/^#([0-9]+):.*/\1/')"
  local crashes timeouts ooms
  crashes=$(find "$out/crashes" -name 'crash-*' | wc -l)
  timeouts=$(find "$out/crashes" -name 'timeout-*' | wc -l)
  ooms=$(find "$out/crashes" -name 'oom-*' | wc -l)
  local rate=$(( execs / (took > 0 ? took : 1) ))
  local line
  line="fuzz_long $TARGET: ${took} s x ${jobs} jobs, ${execs} executions, ${rate} exec/s"
  line+=" ($(( rate / (jobs > 0 ? jobs : 1) )) per job), ${crashes} crashes, ${timeouts} timeouts,"
  line+=" ${ooms} ooms, corpus ${after} (+$(( after - before )))"
  echo "$line" | tee "$out/summary.txt"
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
    echo "fuzz_long: libFuzzer exited $rc; the end of $out/fuzz.log:" | tee -a "$out/summary.txt"
    tail -n 20 "$out/fuzz.log" | tee -a "$out/summary.txt"
    return 1
  fi
  if [ "$crashes" -gt 0 ]; then
    echo "fuzz_long: crashing inputs in $out/crashes/ (replay: $bin FILE)" | tee -a "$out/summary.txt"
    return 1
  fi
}

coverage() {
  command -v llvm-cov >/dev/null || { echo "fuzz_long: llvm-cov not found" >&2; exit 2; }
  local dir=build-fuzz-cov d
  for d in "$@"; do [ -d "$d" ] || { echo "fuzz_long: no corpus folder $d" >&2; exit 2; }; done
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DVRAMLEDGER_FUZZ=ON -DVRAMLEDGER_FUZZ_COVERAGE=ON -DVRAMLEDGER_BUILD_TESTS=OFF \
    -DVRAMLEDGER_BUILD_BENCHMARKS=OFF -DVRAMLEDGER_BUILD_CUDA=OFF \
    -DVRAMLEDGER_BUILD_TORCH_PLUGIN=OFF -DVRAMLEDGER_BUILD_PYTHON=OFF >/dev/null
  cmake --build "$dir" -j"${JOBS:-2}" --target "$TARGET" >/dev/null
  rm -f "$dir"/*.profraw
  # -runs=0: every input of the folders once, no fuzzing.
  LLVM_PROFILE_FILE="$ROOT/$dir/ops-%p.profraw" "$dir/tests/fuzz/$TARGET" -runs=0 \
    -max_len=$MAX_LEN "$SEEDS" "$@" >"$dir/run.log" 2>&1
  llvm-profdata merge -sparse "$dir"/*.profraw -o "$dir/ops.profdata"
  llvm-cov report "$dir/tests/fuzz/$TARGET" -instr-profile="$dir/ops.profdata" \
    "$ROOT/allocator/core" >"$dir/core.txt"
  echo "line coverage of allocator/core by the $TARGET corpus ($(find "$SEEDS" "$@" -type f |
    wc -l) files; llvm-cov's whole report: $dir/core.txt):"
  # llvm-cov's columns: file, regions, missed, cover, functions, missed, executed, lines,
  # missed, cover, ...; the core's .cc files are summed here (its TOTAL counts the headers too).
  # The report names files below allocator/core, or by their name alone when every file shown
  # lies in that folder (llvm-cov drops the common prefix).
  awk '$1 ~ /^([^ ]*\/)?[^/]*\.cc$/ && $1 !~ /\/(tests|third_party)\// {
         printf "  %-44s %6s lines %6s missed %8s\n", $1, $8, $9, $10; l += $8; m += $9 }
       END { printf "  %-44s %6d lines %6d missed %7.2f%%\n", "TOTAL allocator/core", l, m,
             l ? 100 * (l - m) / l : 0 }' "$dir/core.txt"
}

case "${1:-}" in
  build) build ;;
  coverage) shift; coverage "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
