#!/usr/bin/env bash
# `scripts/sanitize.sh asan|tsan`: builds the CPU tests of one sanitizer variant and runs them.
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/): the core (its checked
#         build: the full invariant check after every operation), device layer, ledger, guard,
#         replay, the runtime through the plugin's C ABI (guard, history, regions, OOM
#         observers), every refusal of the native allocator (no_abort_test), and a short soak.
#         The torch-native mode's other suites (native_*_test) and the long randomized runs of
#         old_mapping_placement_stress_test (minutes in the plain build; the same paths run here
#         through the checked core's old-mapping tests) run in the plain build only.
#   tsan  ThreadSanitizer (build-tsan/, Abseil built from source so that absl::Mutex is seen):
#         every test that runs threads, the eight-thread stress test among them.
# Only the targets a variant runs are built. A sanitizer report fails the run (the runtimes halt
# on the first one); the only suppression is a false positive inside Abseil, named with its cause
# in tests/tsan-suppressions.txt. Prints the tests run and the seconds each step took.
# Run scripts/setup.sh first (the plugin's tests need .venv's torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

variant="${1:-}"
case "$variant" in
  asan)
    dir=build-asan
    sanitize=address,undefined
    # clang's UBSan: gcc 12's checks the parameter of `catch (const abi::__forced_unwind&)`,
    # which gcc binds to a null address when glibc unwinds a thread (pthread_exit), and reports
    # libstdc++'s documented idiom as a reference bound to null. clang 14 (installed by
    # scripts/setup.sh for the fuzz targets) does not, and checks everything else gcc's does.
    compiler=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)
    # core_checked_test holds the core's part tests and scenarios; the others are the tests of
    # the layers above and the core tests it does not hold.
    tests=(core_checked_test size_policy_test options_test hot_path_structures_test
           contiguous_scope_test old_mapping_hazard_test
           sim_backend_conformance_test sim_backend_test sim_cost_model_test
           history_test snapshot_test device_report_test region_report_test atomic_file_test
           plan_test budget_guard_test guard_concurrency_test
           trace_reader_test replay_test replay_follow_test
           runtime_defaults_test plugin_abi_test guard_api_test plugin_history_test
           plugin_oom_observer_test region_api_test no_abort_test)
    tools=(vramledger-soak)
    ;;
  tsan)
    dir=build-tsan
    sanitize=thread
    compiler=()
    # NAME:FILTER runs only the binary's threaded tests (the model test's long single-threaded
    # sequence runs in the other builds).
    tests=(allocator_stress_test "allocator_model_test:AllocatorModel.EightThreads*"
           contiguous_scope_test mem_pools_test graph_pools_test private_pools_test
           sim_backend_test history_test guard_concurrency_test)
    tools=()
    ;;
  *)
    echo "usage: scripts/sanitize.sh asan|tsan" >&2
    exit 2
    ;;
esac

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
# CPU seconds of the finished child processes (a build's wall time on an idle machine is about
# this over the number of cores).
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{print int(($16 + $17) / hz)}' /proc/$$/stat; }
start=$SECONDS
echo "== $variant: configure ($dir/)"
# -O1 -g1: the optimisation the sanitizers' documentation recommends, and line tables only (a
# report still names file and line), both cheaper to compile than RelWithDebInfo's -O2 -g.
# NDEBUG as in the plain build, so the same code is tested.
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  "${compiler[@]}" -DVRAMLEDGER_SANITIZE="$sanitize" -DVRAMLEDGER_BUILD_BENCHMARKS=OFF \
  -DVRAMLEDGER_BUILD_PYTHON=OFF -DPython_EXECUTABLE="$PY" \
  -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >/dev/null
configured=$SECONDS

# A target the configuration did not create (no torch plugin without torch) is left out, saying so.
available=()
filters=()
for entry in "${tests[@]}" "${tools[@]}"; do
  t="${entry%%:*}"
  filter="*"
  [ "$entry" != "$t" ] && filter="${entry#*:}"
  if ninja -C "$dir" -t query "$t" >/dev/null 2>&1; then
    filters+=("$filter")
    available+=("$t")
  else
    echo "$variant: $t is not built in this configuration; skipped"
  fi
done
echo "== $variant: build ${#available[@]} targets"
cmake --build "$dir" -j"$(nproc)" --target "${available[@]}"
built=$SECONDS
built_cpu=$(cpu_seconds)

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tests/tsan-suppressions.txt"
# The C++ tests of the plugin load torch's libraries from .venv; none of them needs a GPU.
export CUDA_VISIBLE_DEVICES=""

# Tests that set process-wide state once (the plugin's device table) run one process per test,
# as CTest runs every test.
one_per_process=(region_api_test)
run_binary() {  # EXE FILTER LOG: runs the tests; the log ends with gtest's "PASSED" line
  local exe="$1" filter="$2" log="$3" name n=0 k m rc=0
  if [[ " ${one_per_process[*]} " != *" $(basename "$exe") "* ]]; then
    # One gtest shard per core, in parallel (the tests already run side by side under CTest -j).
    local shards pids=()
    shards="$(nproc)"
    for ((k = 0; k < shards; k++)); do
      GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$k" \
        "$exe" --gtest_brief=1 --gtest_filter="$filter" >"$log.$k" 2>&1 &
      pids+=($!)
    done
    for k in "${!pids[@]}"; do wait "${pids[$k]}" || rc=1; done
    : >"$log"
    for ((k = 0; k < shards; k++)); do
      m="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p' "$log.$k" | tail -n 1)"
      n=$((n + ${m:-0}))
      cat "$log.$k" >>"$log"
      rm -f "$log.$k"
    done
    ((rc == 0)) && echo "[  PASSED  ] $n tests." >>"$log"
    return "$rc"
  fi
  : >"$log"
  for name in $("$exe" --gtest_list_tests --gtest_filter="$filter" |
                awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}'); do
    "$exe" --gtest_brief=1 --gtest_filter="$name" >>"$log" 2>&1 || return 1
    n=$((n + 1))
  done
  echo "[  PASSED  ] $n tests." >>"$log"
}

logdir="$dir/sanitize-logs"
mkdir -p "$logdir"
failed=()
total=0
for i in "${!available[@]}"; do
  t="${available[$i]}"
  case " ${tools[*]} " in *" $t "*) continue ;; esac
  exe="$(find "$dir" -name "$t" -type f -perm -u+x | head -n 1)"
  log="$logdir/$t.log"
  t_cpu=$(cpu_seconds)
  if (cd "$ROOT" && run_binary "$exe" "${filters[$i]}" "$log"); then
    n="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p' "$log" | tail -n 1)"
    total=$((total + ${n:-0}))
    printf '%-32s %5s tests passed (CPU %s s)\n' "$t" "${n:-0}" "$(($(cpu_seconds) - t_cpu))"
  else
    failed+=("$t")
    printf '%-32s FAILED (log: %s)\n' "$t" "$log"
    grep -m 20 -E "ERROR: (Address|Thread|Undefined|Leak)Sanitizer|runtime error:|WARNING: ThreadSanitizer|\[  FAILED  \]" "$log" || true
  fi
done
for t in "${tools[@]}"; do
  case " ${available[*]} " in *" $t "*) ;; *) continue ;; esac
  if [ "$t" = vramledger-soak ]; then
    if "$dir/tools/vramledger-soak" --ops 100000 --seed 7 >"$logdir/soak.log" 2>&1; then
      echo "vramledger-soak --ops 100000: $(grep -E '^(checks|violations) ' "$logdir/soak.log" | tr '\n' ' ')"
    else
      failed+=("$t")
      echo "vramledger-soak FAILED (log: $logdir/soak.log)"
      tail -n 20 "$logdir/soak.log"
    fi
  fi
done
echo "== $variant: $total tests in ${#available[@]} targets; configure $((configured - start)) s, build $((built - configured)) s (CPU ${built_cpu} s), run $((SECONDS - built)) s (CPU $(($(cpu_seconds) - built_cpu)) s)"
if ((${#failed[@]})); then
  echo "$variant: FAILED: ${failed[*]}" >&2
  exit 1
fi
