#!/usr/bin/env bash
# The one runner of the GPU checks (checks/: each passes or fails) and benchmarks (bench/: each
# prints figures): `prepare` builds here what the H200 machine runs; the run mode prints one table.
#
#   here:  bash benchmarks/gpu/run.sh prepare        (WHEEL=1: also .devbuild/wheeldeps;
#          PREBUILT=build-ci: copy from a tree built with tests and benchmarks, no second build)
#   GPU:   device run, carry [".devbuild/lib"] (and ".devbuild/wheeldeps" for the wheel check),
#          command: bash benchmarks/gpu/run.sh [ITEM ...]    (kind nvidia-h200-x2 for `ddp`;
#          `multi` runs with as many GPUs as there are, world size 1 on one)
#
# Built here, not there: the GPU image has torch 2.11.0+cu130, cmake and g++ but no Abseil. The
# plugin does not depend on the Python version (it links libc10 and libcudart, which the torch in
# the process has already loaded), so it is built against the project venv's torch 2.11.0+cu130,
# with every Abseil library it needs copied beside it (RPATH $ORIGIN), into .devbuild/lib (ignored
# by git, carried to the machine). The Python package travels as source (torch_plugin/python on
# PYTHONPATH); no run needs `_core`. The wheel check builds the wheel there from carried deps.
#
# Items, run in this order, each bounded by what is left of BUDGET_S (570: a call is 10 minutes);
# an item without enough time left is listed as skipped, never as passed:
#   checks (the default: every one)
#     bundle        the plugin's libraries resolve from .devbuild/lib and torch's folders only
#     unit          the C++ CudaBackend tests on the device (peer access with two GPUs)
#     regions_core  the core's pausable regions on CudaBackend (tests/gpu/cuda_regions_test.cc):
#                   free bytes after a pause, a CPU backup restored, pause/resume times
#     pytest        tests/gpu: the plugin on a real device
#     train         checks/train_compare.py: GPT-2-medium, native vs vramledger, losses agree
#     integration   checks/torch_integration_check.py: memory API, graphs, compile, observers
#     native        the same with install(mode="native") (vramledger as torch's CUDAAllocator)
#     ipc           checks/ipc_check.py: a CUDA tensor sent both ways between a vramledger
#                   (native mode) process and a torch-allocator one, plain and expandable
#     streams       checks/streams_compile_check.py: record_stream canary, synchronized retry,
#                   record_stream soak
#     compile       checks/compile_graphs_check.py: reduce-overhead without cudagraph trees
#     matrix        checks/feature_matrix/run.py: every torch feature that reaches the allocator
#                   (MemPool, graph trees, IPC, NCCL register hook, FSDP2, ...) under torch native,
#                   torch expandable, vramledger default, vramledger pluggable and the shim
#     contiguous    checks/contiguous_check.py: contiguous_segments() and fragmentation()
#     snapshot      checks/snapshot_check.py: history, snapshots and OOM dumps
#     guard         checks/guard_check.py: the memory plan's guard (GUARD_MODEL=llama1b)
#     preload       checks/preload_check.sh: an unmodified program under the LD_PRELOAD shim
#     preload_plan  checks/preload_plan_check.sh: a plan 20% too small under the shim
#     preload_direct checks/preload_direct_check.sh: the shim as torch's allocator (torch's
#                   statistics, a plan refusal as torch.OutOfMemoryError) and its fallback
#     regions       checks/regions_check.py: pausable regions: GPT-2-medium training and Llama-1B
#                   generation taking turns on one GPU (free bytes after each pause, losses,
#                   peak), a graph in a region, pause/resume speed, 10 GiB without backup
#     wheel         checks/wheel_check.sh gpu: the wheel built and run there (needs wheeldeps)
#     multi         checks/multi_gpu/run.py with one rank per GPU present (world size 1 on one
#                   GPU): FSDP2 GPT-2-medium native vs vramledger's default, `vramledger report`,
#                   NCCL's register hook with page recycling, CUDA IPC GPU 0 <-> GPU (1 % N);
#                   with two GPUs or more also checks/two_gpu_check.py (peer access)
#     ddp           two GPUs: checks/ddp_check.py (DDP over NCCL, native vs vramledger with a
#                   plan per rank) and `vramledger report`
#   benchmarks ("bench": every one)
#     workloads     bench/workloads_compare.py: three workloads x three allocators (~200-500 s
#                   per round of the three on an H200)
#     kernels       bench/vmm_kernel_time.py: kernel time on mapped pages vs cudaMalloc memory
#     ab            bench/step_ab.py: step time, interleaved processes
#     inprocess     bench/inprocess_ab.py: step time, both allocators in one process
#     hostcost      vramledger_host_cost_bench: host ns per allocation, torch native vs vramledger
#     graphstep     bench/graph_step_ab.py: reduce-overhead GPT-2-medium step, torch vs vramledger
#     record_empty_cache record/record_empty_cache_trace.py: a 10-stream program with empty_cache()
#                   between phases recorded under torch's allocator, replayed by vramledger-replay
#                   with and without --ignore-releases: torch's peak reserved beside both (~30 s)
#     capacity      python -m benchmarks.capacity: the largest batch and sequence per workload, cap
#                   and allocator, beside plan --fit and its error under both allowance models;
#                   with CAPACITY_STEP_ROUNDS=N, N rounds of the three allocators in rotating order
#                   at the largest size all three fit, and vramledger's step-time ratio to each
#                   torch allocator with its 90% interval (~3 x 20-25 s a round on Llama-1B LoRA
#                   24 GiB) (CAPACITY_* pick the rows; resumes from
#                   .devbuild/capacity-results.json when carried; writes $OUT/capacity-results.json);
#                   with CAPACITY_TRACES=1, last, traced trials at each row's common size and
#                   vramledger's limit into $OUT/traces (CAPACITY_TRACE_ALLOCATORS, default
#                   vramledger; at most 8 files come back from $OUT: pick the rows to fit)
#     capprofile    python -m benchmarks.capacity.profiles: one profiled trial per allocator at
#                   PROFILE_ROW ("WORKLOAD,CAP_GIB,DIM,SIZE", default llama1b,24,batch,1), its
#                   steady steps under torch.profiler and vramledger's host_timing on, into
#                   $OUT/profiles; prints where each step's host and device time went and the ops
#                   whose host time differs most between vramledger and torch native (3 trials;
#                   run only when named)
#     confrounds    python -m benchmarks.capacity.conf_rounds: at CONF_ROW (as PROFILE_ROW),
#                   CONF_ROUNDS (6) rounds of torch native and each of CONF_VARIANTS
#                   (space-separated: torch-expandable, "default" (vramledger) or vramledger's
#                   VRAMLEDGER_CONF settings, either after BUILD@ to load another build from
#                   folder BUILD, a carried `prepare` bundle; any of them may end in
#                   +NAME=VALUE, an environment variable of its process; default
#                   "torch-expandable default"), one process each, in rotating order; prints
#                   each variant's steady steps and its ratio to torch native, what its process
#                   did in a steady step (CPU time, faults, switches, stolen time) and the
#                   machine (runs in $OUT/conf-rounds.json, resumed from CONF_RESUME where set;
#                   run only when named)
#     steprounds    python -m benchmarks.capacity.next_rounds run: the step rounds the records
#                   still want (docs/results' capacity files, or STEPROUNDS_RESULTS), the rows
#                   that fewest machines have run first, STEPROUNDS_ROUNDS (3) rounds of the three
#                   allocators a row, until the budget ends (STEPROUNDS_ROWS: at most that many
#                   rows); each row's runs in $OUT/steprounds/ (STEPROUNDS_RESUME: a folder of an
#                   earlier call's files, copied there first, so this boot's go on); prints the
#                   rows' verdicts before and after pooling the new runs, and the commands that
#                   join them (run only when named)
#     mapcost       python -m benchmarks.capacity.mapping_cost: the host cost of a CUDA call
#                   (pointer lookup, memset, memcpy, launch) while the process holds
#                   MAPCOST_COUNTS (0,256,1024,2048,3072) blocks of 6 MiB, under each of
#                   MAPCOST_VARIANTS (conf rounds' variants; default "torch torch-expandable
#                   default expandable_segments:False expandable_page_mb:20"), MAPCOST_ROUNDS
#                   (2) processes each (runs in $OUT/mapping-cost.json; run only when named)
# ITEM may be a name above, "checks", "bench" or "all"; ONLY="..." says the same.
# Env: BUDGET_S (570), STEPS (ddp's steps, 8), GUARD_MODEL (gpt2), WORKLOADS
# (gpt2m,llama1b,llama1b-ckpt), MATRIX_FEATURES / MATRIX_COLUMNS (the matrix's cells), ROUNDS (1), AB_MODES (native,plugin,shim,shim-noexp), AB_ROUNDS,
# AB_STEPS (10), INPROCESS_WORKLOADS (gpt2m,llama1b,llama1b-ckpt), INPROCESS_GROUPS (30),
# INPROCESS_LENGTHS (repeat, steady or fresh), INPROCESS_SHIM (1: also under the shim),
# INPROCESS_MODE (pluggable or native), HOSTCOST_TRACES (gpt2m llama1b llama1b-ckpt),
# HOSTCOST_SHIM (1: also under the shim), PYTEST_ARGS (pytest's files, tests/gpu),
# GPU_TEST (the C++ GPU test binary, cuda_backend_test),
# CAPACITY_WORKLOADS (gpt2m,llama1b,llama1b-ckpt,llama1b-lora), CAPACITY_CAPS (24,80),
# CAPACITY_ALLOCATORS (torch,torch-expandable,vramledger), CAPACITY_DIMS (batch,seq),
# CAPACITY_BUDGET_S (500), CAPACITY_STEP_ROUNDS (0: no step-time rounds), CAPACITY_TRACES (1:
# traced trials last), CAPACITY_TRACE_ALLOCATORS (vramledger),
# CAPACITY_RESUME (results files; default .devbuild/capacity-results.json), CAPACITY_LIBRARY (a label
# of the vramledger build kept in its trials' records; default the commit `prepare` built, from
# .devbuild/lib/COMMIT), PROFILE_ROW (capprofile's row, llama1b,24,batch,1).
# Background fuzzing on the CPU cores the items leave idle (nothing changes when unset):
# FUZZ_BACKGROUND_S=S starts scripts/fuzz_long.sh run (allocator_ops_fuzz, -fork=FUZZ_JOBS jobs,
# default nproc - 4, under nice) before the items, for S seconds (at most the budget less 30 s),
# and after the items waits for it: row `fuzz_long` of the table (PASS: nothing crashed) with its
# executions, exec/s, crashes and corpus; its crashing inputs, merged corpus and log in
# $OUT/fuzz-long.tar.gz. Needs .devbuild/fuzz/allocator_ops_fuzz carried (fuzz_long.sh build);
# FUZZ_BINARY names another build of it, FUZZ_CORPUS a grown corpus to start from.
# Outputs: $OUT/table.txt and $OUT/gpu-run.tar.gz (every log and output; the device machine sends
# back a few files only), $OUT default .devbuild/out. Exit status 0 when every item that ran
# passed (a benchmark passes when it ran to its end) and none was skipped.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LIBDIR="$ROOT/.devbuild/lib"
PLUGIN="$LIBDIR/libvramledger_plugin.so"
GPU_TEST="${GPU_TEST:-cuda_backend_test}"
CHECKS="bundle unit pytest train integration native ipc streams compile matrix contiguous
        snapshot guard preload preload_plan preload_direct regions wheel multi ddp regions_core"
BENCH="workloads kernels ab inprocess hostcost graphstep record_empty_cache capacity"
# Benchmarks run only when named (not by "bench" or "all").
NAMED="capprofile confrounds steprounds mapcost"
CHECKS="$(echo $CHECKS)"  # one line, single spaces: the item tests match " name "

# ---- here: build what the GPU machine runs ----

# Prints the Abseil libraries a process maps after loading the plugin through the package; fails
# if one of them does not come from the plugin's own folder.
check_bundle() {
  "$1" - "$LIBDIR" <<'PY'
import sys
import vramledger._plugin as p
p.load()
maps = open("/proc/self/maps").read().split("\n")
absl = sorted({l.split()[-1] for l in maps if "libabsl_" in l})
outside = [a for a in absl if not a.startswith(sys.argv[1] + "/")]
print(f"plugin loads: {len(absl)} Abseil libraries, all from {sys.argv[1]}: {not outside}")
print("option keys:", ",".join(p.option_names()))
sys.exit(1 if outside or not absl else 0)
PY
}

prepare() {
  set -e
  local py="${PYTHON:-$ROOT/.venv/bin/python}"
  local build="${PREBUILT:-$ROOT/.devbuild/build}"
  if [ -z "${PREBUILT:-}" ]; then
    # One build tree, with the tests on for the C++ GPU test; only the targets the run needs.
    cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
      -DVRAMLEDGER_BUILD_TESTS=ON -DVRAMLEDGER_BUILD_BENCHMARKS=ON -DVRAMLEDGER_BUILD_PYTHON=OFF \
      >/dev/null
    ninja -C "$build" vramledger_plugin vramledger_native vramledger_preload \
      vramledger_driver_api_alloc vramledger_host_cost_bench vramledger_allocator_swap \
      vramledger-replay vramledger_trace_counter "$GPU_TEST"
  fi  # else a tree already built with tests and benchmarks (scripts/test.sh's build-ci/)
  rm -rf "$LIBDIR"
  mkdir -p "$LIBDIR"
  # The pluggable plugin, the torch-native allocator (install(mode="native"), found beside the
  # plugin), the LD_PRELOAD shim and the driver-API program preload_check.sh runs under it, the
  # host-cost bench, the allocator swap of inprocess_ab.py, the trace counter of the multi-GPU
  # check and the replay tool (record_empty_cache replays there; the Python package travels
  # without `_core`), each with its Abseil libraries.
  local name file
  for name in libvramledger_plugin.so libvramledger_native.so libvramledger_preload.so \
              vramledger_driver_api_alloc vramledger_host_cost_bench \
              libvramledger_allocator_swap.so libvramledger_trace_counter.so vramledger-replay \
              "$GPU_TEST"; do
    file="$(find "$build" -name "$name" -type f -not -path '*/CMakeFiles/*' | sort | head -1)"
    [ -n "$file" ] || { echo "prepare: $name was not built"; exit 1; }
    cp "$file" "$LIBDIR/"
  done
  find "$build" -name 'libabsl_*.so.*' -not -path '*/CMakeFiles/*' -exec cp -n {} "$LIBDIR/" \;
  ldd "$LIBDIR/$GPU_TEST" "$LIBDIR/vramledger-replay" | awk '/libabsl_|libgtest|libgmock/ {print $3}' |
    xargs -r -I{} cp -n {} "$LIBDIR/"
  # Debug info stays here: the carried folder must stay under the device call's 64 MiB.
  find "$LIBDIR" -type f -exec strip --strip-debug {} \;
  # The checkout's commit (with "-dirty" where tracked files differ from it; with PREBUILT, the
  # tree must have been built from this checkout): the capacity trials' records name their
  # vramledger build by it (CAPACITY_LIBRARY). "unknown" outside a git checkout.
  local commit
  if commit="$(git -C "$ROOT" rev-parse --short=7 HEAD 2>/dev/null)"; then
    git -C "$ROOT" diff --quiet HEAD || commit="$commit-dirty"
  else
    commit=unknown
  fi
  echo "$commit" > "$LIBDIR/COMMIT"
  echo "--- $PLUGIN"
  readelf -d "$PLUGIN" | grep -E 'NEEDED|RPATH|RUNPATH'
  # Every NEEDED library outside torch's and the system's must sit beside the plugin.
  local missing=0 lib needed
  needed="$(readelf -d "$PLUGIN" "$LIBDIR"/libabsl_*.so.* | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p')"
  for lib in $(echo "$needed" | sort -u); do
    case "$lib" in
      libc10.so|libcudart.so.13) ;;  # from the torch already loaded in the process
      libstdc++.so.6|libgcc_s.so.1|libc.so.6|libm.so.6|ld-linux-x86-64.so.2) ;;
      libdl.so.2|libpthread.so.0|librt.so.1) ;;
      *) [ -f "$LIBDIR/$lib" ] || { echo "not bundled: $lib"; missing=1; } ;;
    esac
  done
  [ "$missing" = 0 ] || { echo "prepare: the bundle is incomplete"; exit 1; }
  VRAMLEDGER_PLUGIN="$PLUGIN" PYTHONPATH="$ROOT/torch_plugin/python" check_bundle "$py"
  [ "${WHEEL:-0}" = 1 ] && bash "$ROOT/benchmarks/gpu/checks/wheel_check.sh" prepare
  du -sh "$LIBDIR"
  echo "prepare: done. On the GPU machine, carry [\".devbuild/lib\"]: bash benchmarks/gpu/run.sh"
}

# ---- there: run the items, then one table ----

declare -A RESULT SECONDS_TAKEN
ORDER=()

# item NAME KIND MIN_LEFT_S COMMAND...: runs COMMAND with its output in $RUN/NAME.log, unless
# fewer than MIN_LEFT_S seconds of the budget are left; records the result for the table.
item() {
  local name="$1" kind="$2" need="$3"
  shift 3
  ORDER+=("$name")
  if [ "$(left)" -le "$need" ]; then
    RESULT[$name]="skipped: $(left) s left of the budget, $need needed"
    return
  fi
  local t0=$(date +%s) rc
  echo "==== $name ($kind): $*" | cut -c1-200
  "$@" > "$RUN/$name.log" 2>&1
  rc=$?
  SECONDS_TAKEN[$name]=$(( $(date +%s) - t0 ))
  case "$rc" in
    0) RESULT[$name]=$([ "$kind" = check ] && echo PASS || echo "ran (figures below)") ;;
    124|137) RESULT[$name]="FAIL: timed out" ;;
    *) RESULT[$name]="FAIL: exit $rc" ;;
  esac
}
in_dir() { (cd "$1" && shift && "$@"); }  # in_dir DIR COMMAND...: outputs land in DIR
not_run() { ORDER+=("$1"); RESULT[$1]="skipped: $2"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
bound() { echo $(( $(left) - ${1:-5} )); }  # a timeout that ends inside the budget

# `gpus` is run_items's: one rank per GPU present.
multi() {
  local rc=0 budget=$(( $(bound 15) < 230 ? $(bound 15) : 230 ))
  if [ "$gpus" -ge 2 ]; then
    timeout 120 "$PY" benchmarks/gpu/checks/two_gpu_check.py --json "$RUN/two_gpu.json" || rc=1
  fi
  timeout "$(bound)" "$PY" benchmarks/gpu/checks/multi_gpu/run.py --out "$RUN/multi" \
    --nproc "$gpus" --budget-s "$budget" || rc=1
  return $rc
}

ddp() {
  local out="$RUN/ddp"
  mkdir -p "$out/ddp-native" "$out/ddp-vl"
  # One plan, a line per rank's GPU (rank r runs on GPU r).
  cat > "$out/ddp-vl/plan.json" <<'JSON'
{
  "vramledger_plan": 1,
  "comment": "GPT-2-medium DDP, 2 ranks, batch 8 per rank",
  "limit": "40GiB",
  "devices": {"0": {"limit": "40GiB"}, "1": {"limit": "38GiB"}}
}
JSON
  local steps="${STEPS:-8}" a
  for a in native vl; do
    timeout 240 "$PY" -m torch.distributed.run --nproc_per_node=2 benchmarks/gpu/checks/ddp_check.py \
      --worker --allocator "$([ $a = vl ] && echo vramledger || echo native)" --steps "$steps" \
      --out "$out/ddp-$a" > "$out/ddp-$a.log" 2>&1
    echo "DDP $a exit $?"
  done
  "$PY" benchmarks/gpu/checks/ddp_check.py --compare "$out/ddp-native" "$out/ddp-vl" \
    > "$out/ddp_compare.txt" 2>&1
  local ddp_rc=$?
  "$PY" -m vramledger report "$out/ddp-vl/steps" > "$out/report.txt" 2>&1
  local report_rc=$?
  cat "$out/ddp_compare.txt" "$out/report.txt"
  echo "ddp_check exit $ddp_rc, vramledger report exit $report_rc"
  [ "$ddp_rc" = 0 ] && [ "$report_rc" = 0 ]
}

hostcost() {
  local t rc=0
  for t in ${HOSTCOST_TRACES:-gpt2m llama1b llama1b-ckpt}; do
    LD_LIBRARY_PATH="$LIBDIR:$TORCH_LIB" timeout 120 "$LIBDIR/vramledger_host_cost_bench" \
      "traces/trace-$t-native.csv.gz" --passes 7 || rc=1
    # Under the shim torch's row is the shim's path. The backend is named here because the
    # bench links libc10_cuda, which may read the variable before the shim's constructor sets it
    # (in Python, torch loads after the shim); the bench prints the backend it got.
    if [ "${HOSTCOST_SHIM:-0}" = 1 ]; then
      LD_LIBRARY_PATH="$LIBDIR:$TORCH_LIB" VRAMLEDGER_PRELOAD_QUIET=1 \
        PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync \
        VRAMLEDGER_CONF=expandable_segments:True,host_timing:True VRAMLEDGER_PRELOAD_NO_EXIT_DUMP=1 \
        LD_PRELOAD="$LIBDIR/libvramledger_preload.so" timeout 120 \
        "$LIBDIR/vramledger_host_cost_bench" "traces/trace-$t-native.csv.gz" --passes 7 || rc=1
    fi
  done
  return $rc
}

# Records the empty_cache() program under torch's allocator, replays its trace with torch's
# policy following the program's releases and ignoring them, and compares both with torch's.
record_empty_cache() {
  local out="$RUN/record_empty_cache" trace
  mkdir -p "$out"
  env -u PYTORCH_CUDA_ALLOC_CONF timeout 60 "$PY" benchmarks/gpu/record/record_empty_cache_trace.py \
    --out "$out" || return 1
  trace="$out/trace-empty-cache.csv.gz"
  LD_LIBRARY_PATH="$LIBDIR" timeout 60 "$LIBDIR/vramledger-replay" "$trace" --json \
    > "$out/followed.json" || return 1
  LD_LIBRARY_PATH="$LIBDIR" timeout 60 "$LIBDIR/vramledger-replay" "$trace" --json \
    --ignore-releases > "$out/ignored.json" || return 1
  "$PY" benchmarks/gpu/record/record_empty_cache_trace.py --compare "$out"
  return 0  # a benchmark: the figures are the result (the comparison prints its verdict)
}

# The capacity benchmark within what is left of the budget; its records go to $OUT (outside the
# tarred run folder), where the next call can resume from them once copied back and carried.
capacity() {
  local resume="${CAPACITY_RESUME-}" budget="${CAPACITY_BUDGET_S:-500}" traced=()
  [ "${CAPACITY_TRACES:-0}" = 1 ] && traced=(--traces "$OUT/traces")
  [ -z "$resume" ] && [ -f .devbuild/capacity-results.json ] && resume=.devbuild/capacity-results.json
  [ "$(bound 15)" -lt "$budget" ] && budget="$(bound 15)"
  CAPACITY_RESUME="$resume" timeout "$(bound)" "$PY" -m benchmarks.capacity --budget-s "$budget" \
    --step-rounds "${CAPACITY_STEP_ROUNDS:-0}" --out "$OUT/capacity-results.json" \
    "${traced[@]}"
}

capprofile() {
  local w c d s rc
  IFS=, read -r w c d s <<< "${PROFILE_ROW:-llama1b,24,batch,1}"
  rm -rf "$OUT/profiles"  # one row's profiles per run: compare reads the folder whole
  timeout "$(bound)" "$PY" -m benchmarks.capacity.profiles run "$w" "$c" "$d" "$s" \
    --out "$OUT/profiles"
  rc=$?
  # Whatever failed, the allocators that ran are compared (compare names a missing one).
  "$PY" -m benchmarks.capacity.profiles compare "$OUT/profiles" || rc=1
  return "$rc"
}

# The records' rounds go into the H200 file or the H100 one by the card; either pools the other.
steprounds() {
  local results="${STEPROUNDS_RESULTS:-}" mib
  if [ -z "$results" ]; then
    mib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null |
      head -1)"
    results="docs/results/capacity-h100-step-rounds.json docs/results/capacity-h200-results.json"
    [[ "$mib" =~ ^[0-9]+$ ]] && [ "$mib" -gt 100000 ] &&
      results="docs/results/capacity-h200-results.json docs/results/capacity-h100-step-rounds.json"
  fi
  mkdir -p "$OUT/steprounds"
  if [ -n "${STEPROUNDS_RESUME:-}" ]; then
    cp "$STEPROUNDS_RESUME"/*.json "$OUT/steprounds/" || return 1
  fi
  # shellcheck disable=SC2086  # one word per results file
  timeout "$(bound)" "$PY" -m benchmarks.capacity.next_rounds run $results \
    --out-dir "$OUT/steprounds" --rounds "${STEPROUNDS_ROUNDS:-3}" \
    ${STEPROUNDS_ROWS:+--rows "$STEPROUNDS_ROWS"} --budget-s "$(( $(bound) - 20 ))"
}

MAPCOST_DEFAULT="torch torch-expandable default expandable_segments:False expandable_page_mb:20"
mapcost() {
  rm -f "$OUT/mapping-cost.json"  # a new file each call (the command refuses one that exists)
  # shellcheck disable=SC2086  # one word per variant
  timeout "$(bound)" "$PY" -m benchmarks.capacity.mapping_cost run \
    --variants ${MAPCOST_VARIANTS:-$MAPCOST_DEFAULT} \
    --rounds "${MAPCOST_ROUNDS:-2}" --counts "${MAPCOST_COUNTS:-0,256,1024,2048,3072}" \
    --budget-s "$(( $(bound) - 20 ))" --out "$OUT/mapping-cost.json"
}

confrounds() {
  local w c d s
  IFS=, read -r w c d s <<< "${CONF_ROW:-llama1b,24,batch,1}"
  # The runs of an earlier call (carried) go on from where it ended.
  if [ -n "${CONF_RESUME:-}" ]; then cp "$CONF_RESUME" "$OUT/conf-rounds.json" || return 1; fi
  # shellcheck disable=SC2086  # one word per variant
  timeout "$(bound)" "$PY" -m benchmarks.capacity.conf_rounds run "$w" "$c" "$d" "$s" \
    --variants ${CONF_VARIANTS:-torch-expandable default} --rounds "${CONF_ROUNDS:-6}" \
    --budget-s "$(( $(bound) - 20 ))" --out "$OUT/conf-rounds.json"
}

bundle() {
  LD_LIBRARY_PATH="$TORCH_LIB" ldd "$PLUGIN" | grep -vE 'libabsl_'
  if LD_LIBRARY_PATH="$TORCH_LIB" ldd "$PLUGIN" | grep -q 'not found'; then
    echo "unresolved dependencies"; return 1
  fi
  check_bundle "$PY"
}

# The figures that back each item's verdict, from its log.
details() {
  local f="$RUN/$1.log"
  [ -f "$f" ] || return 0
  case "$1" in
    bundle) grep -E "plugin loads|unresolved" "$f" ;;
    unit) grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \] |^\[       OK \] .*Peer" "$f" ;;
    regions_core) grep -E "^regions: |^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \] " "$f" ;;
    pytest) tail -1 "$f" ;;
    train) cat "$RUN/train/train_compare_table.txt" 2>/dev/null || tail -12 "$f" ;;
    integration|native|snapshot|guard|contiguous) grep -E "PASS|FAIL" "$f" ;;
    ipc) sed -n '/^| sender/,$p' "$f" ;;
    streams) grep -E "^(1a|1b|3) " "$f" ;;
    compile) tail -3 "$f" ;;
    matrix) sed -n '/^---- feature matrix/,$p' "$f" ;;
    graphstep) tail -6 "$f" ;;
    preload) tail -12 "$f" ;;
    preload_plan) tail -8 "$f" ;;
    preload_direct) grep -E "^(PASS|FAIL|SKIP)|MemPool" "$f" ;;
    regions) sed -n '/^regions check:/,$p' "$f" ;;
    wheel) grep -E "PASS|FAIL|SKIP|wheel" "$f" | tail -15 ;;
    multi) grep -E "^(PASS|FAIL|SKIP) " "$f"; sed -n '/^==== multi-GPU check/,$p' "$f" ;;
    ddp) cat "$f" ;;
    workloads) tail -40 "$f" ;;
    kernels) tail -4 "$f" ;;
    ab) tail -6 "$f" ;;
    inprocess) sed -n '/^| workload | ratio/,$p' "$f" ;;
    hostcost) grep -E "^(trace|\| |vramledger)" "$f" ;;
    record_empty_cache) sed -n '/^program:/,$p' "$f" ;;
    capacity) sed -n '/^capacity (/,$p' "$f" ;;
    capprofile) sed -n '/^profiled steps/,$p' "$f" ;;
    confrounds) sed -n '/^conf rounds of /,$p' "$f" ;;
    steprounds) grep "left out of the pool\|not run: " "$f"
                sed -n '/^\(The verdicts on the rows of\|no runs to pool\)/,$p' "$f" ;;
    mapcost) sed -n '/^mapping cost, /,$p' "$f" ;;
    fuzz_long) grep -E "^fuzz_long" "$f" ;;
  esac
}

# FUZZ_BACKGROUND_S: fuzz_start and fuzz_collect (see the top).
source "$ROOT/benchmarks/gpu/fuzz_background.sh"

run_items() {
  local want=" $* "
  want="${want// checks / $CHECKS }"
  want="${want// bench / $BENCH }"
  want="${want// all / $CHECKS $BENCH }"
  local name
  for name in $want; do
    [[ " $CHECKS $BENCH $NAMED " == *" $name "* ]] || { echo "run.sh: no item '$name'"; exit 2; }
  done
  OUT="${OUT:-$ROOT/.devbuild/out}"
  RUN="$OUT/run"
  rm -rf "$RUN"
  mkdir -p "$RUN"
  PY="${PYTHON:-/opt/torch/.venv/bin/python3}"
  [ -x "$PY" ] || PY="$(command -v python3)"
  if [ ! -f "$PLUGIN" ]; then
    echo "run.sh: $PLUGIN is missing: run 'bash benchmarks/gpu/run.sh prepare' on the development"
    echo "machine and carry .devbuild/lib to this one."
    exit 2
  fi
  export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$PLUGIN"
  if [ -z "${CAPACITY_LIBRARY:-}" ] && [ -f "$LIBDIR/COMMIT" ]; then
    CAPACITY_LIBRARY="$(cat "$LIBDIR/COMMIT")"
    export CAPACITY_LIBRARY
  fi
  export PYTHONPATH="$ROOT/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}"
  cd "$ROOT"
  START=$(date +%s)
  BUDGET=${BUDGET_S:-570}
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import sys, torch
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| GPUs', torch.cuda.device_count())"
  TORCH_LIB="$("$PY" -c "import os, torch
r = os.path.dirname(torch.__file__)
print(os.path.join(r, 'lib') + ':' + os.path.join(os.path.dirname(r), 'nvidia', 'cu13', 'lib'))")"
  local shim="$LIBDIR/libvramledger_preload.so"
  [ -n "${FUZZ_BACKGROUND_S:-}" ] && fuzz_start

  for name in $CHECKS $BENCH $NAMED; do
    [[ "$want" == *" $name "* ]] || continue
    case "$name" in
      bundle) item bundle check 20 bundle ;;
      unit) item unit check 30 env LD_LIBRARY_PATH="$LIBDIR:$TORCH_LIB" timeout 120 \
              "$LIBDIR/$GPU_TEST" ;;
      regions_core) item regions_core check 60 env LD_LIBRARY_PATH="$LIBDIR:$TORCH_LIB" \
                      timeout 60 "$LIBDIR/$GPU_TEST" --gtest_filter='CudaRegionsTest.*' ;;
      pytest) item pytest check 90 timeout "$(bound)" "$PY" -m pytest -q -p no:cacheprovider \
                ${PYTEST_ARGS:-tests/gpu} ;;
      train) item train check 200 timeout "$(bound)" "$PY" benchmarks/gpu/checks/train_compare.py \
               --out "$RUN/train" ;;
      integration) item integration check 120 timeout "$(bound)" "$PY" \
                     benchmarks/gpu/checks/torch_integration_check.py ;;
      native) item native check 120 timeout "$(bound)" "$PY" \
                benchmarks/gpu/checks/torch_integration_check.py --mode native ;;
      ipc) item ipc check 90 timeout "$(bound)" "$PY" benchmarks/gpu/checks/ipc_check.py ;;
      streams) item streams check 60 timeout "$(bound)" "$PY" \
                 benchmarks/gpu/checks/streams_compile_check.py --checks record_stream,soak \
                 --out "$RUN/streams" --budget-s 100 ;;
      compile) item compile check 150 timeout 140 "$PY" \
                 benchmarks/gpu/checks/compile_graphs_check.py ;;
      matrix) item matrix check 200 timeout "$(bound)" "$PY" \
                benchmarks/gpu/checks/feature_matrix/run.py --shim "$shim" \
                --out "$RUN/feature_matrix" --cell-timeout 240 --budget-s "$(bound 30)" \
                ${MATRIX_FEATURES:+--features "$MATRIX_FEATURES"} \
                ${MATRIX_COLUMNS:+--columns "$MATRIX_COLUMNS"} ;;
      graphstep) item graphstep bench 280 timeout "$(bound)" "$PY" \
                   benchmarks/gpu/bench/graph_step_ab.py --rounds "${GRAPHSTEP_ROUNDS:-2}" --budget-s "$(bound 20)" ;;
      contiguous) item contiguous check 60 timeout "$(bound)" "$PY" \
                    benchmarks/gpu/checks/contiguous_check.py ;;
      snapshot) mkdir -p "$RUN/snapshot"
                item snapshot check 120 in_dir "$RUN/snapshot" timeout "$(bound)" "$PY" \
                  "$ROOT/benchmarks/gpu/checks/snapshot_check.py" --out "$RUN/snapshot" --steps 6 ;;
      guard) mkdir -p "$RUN/guard"
             item guard check 150 in_dir "$RUN/guard" timeout "$(bound)" "$PY" \
               "$ROOT/benchmarks/gpu/checks/guard_check.py" --model "${GUARD_MODEL:-gpt2}" \
               --out "$RUN/guard" ;;
      preload) item preload check 200 env PYTHON="$PY" OUT="$RUN/preload" STEPS=6 \
                 timeout "$(bound)" bash benchmarks/gpu/checks/preload_check.sh "$shim" ;;
      preload_plan) item preload_plan check 150 env PYTHON="$PY" OUT="$RUN/preload_plan" \
                      timeout "$(bound)" bash benchmarks/gpu/checks/preload_plan_check.sh "$shim" ;;
      preload_direct) item preload_direct check 60 env PYTHON="$PY" OUT="$RUN/preload_direct" \
                        timeout "$(bound)" bash benchmarks/gpu/checks/preload_direct_check.sh \
                        "$shim" ;;
      regions) item regions check 245 timeout 240 "$PY" benchmarks/gpu/checks/regions_check.py \
                 --json "$RUN/regions.json" ;;
      wheel) if [ -d .devbuild/wheeldeps ]; then
               item wheel check 150 env OUT="$RUN/wheel" timeout "$(bound)" \
                 bash benchmarks/gpu/checks/wheel_check.sh gpu
             else
               not_run wheel "no .devbuild/wheeldeps (WHEEL=1 run.sh prepare, and carry it)"
             fi ;;
      multi) item multi check 240 multi ;;
      ddp) if [ "$gpus" -ge 2 ]; then
             item ddp check 200 ddp
           else
             not_run ddp "$gpus GPU(s); it needs two (kind nvidia-h200-x2)"
           fi ;;
      workloads) item workloads bench 200 timeout "$(bound)" "$PY" \
                   benchmarks/gpu/bench/workloads_compare.py --out "$RUN/workloads" \
                   --workloads "${WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" --rounds "${ROUNDS:-1}" ;;
      kernels) item kernels bench 90 timeout 150 "$PY" benchmarks/gpu/bench/vmm_kernel_time.py \
                 --json "$RUN/kernels.json" ;;
      ab) item ab bench 120 timeout "$(bound)" "$PY" benchmarks/gpu/bench/step_ab.py \
            --rounds "${AB_ROUNDS:-$(( $(left) > 330 ? 3 : 2 ))}" --steps "${AB_STEPS:-10}" \
            --modes "${AB_MODES:-native,plugin,shim,shim-noexp}" --json "$RUN/step_ab.json" ;;
      inprocess)
        local shim_arg=()
        [ "${INPROCESS_SHIM:-0}" = 1 ] && shim_arg=(--shim "$shim")
        item inprocess bench 120 timeout "$(bound)" "$PY" benchmarks/gpu/bench/inprocess_ab.py \
          --workloads "${INPROCESS_WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" \
          --groups "${INPROCESS_GROUPS:-30}" --lengths "${INPROCESS_LENGTHS:-repeat}" \
          --mode "${INPROCESS_MODE:-pluggable}" --json "$RUN/inprocess_ab.json" "${shim_arg[@]}" ;;
      hostcost) item hostcost bench 60 hostcost ;;
      record_empty_cache) item record_empty_cache bench 90 record_empty_cache ;;
      capacity) item capacity bench 60 capacity ;;
      capprofile) item capprofile bench 150 capprofile ;;
      confrounds) item confrounds bench 120 confrounds ;;
      steprounds) item steprounds bench 120 steprounds ;;
      mapcost) item mapcost bench 90 mapcost ;;
    esac
  done

  [ -n "${FUZZ_BACKGROUND_S:-}" ] && fuzz_collect

  echo
  echo "==== details"
  for name in "${ORDER[@]}"; do
    [ -f "$RUN/$name.log" ] || continue
    echo "-- $name"
    details "$name"
  done
  {
    echo
    echo "==== GPU checks and benchmarks ($(nvidia-smi --query-gpu=name --format=csv,noheader |
      head -1), $gpus GPU(s), $(( $(date +%s) - START )) s)"
    printf '| %-13s | %-5s | %-8s | %s\n' item kind seconds result
    local kind bad=0
    for name in "${ORDER[@]}"; do
      kind=check
      [[ " $BENCH $NAMED " == *" $name "* ]] && kind=bench
      printf '| %-13s | %-5s | %-8s | %s\n' "$name" "$kind" "${SECONDS_TAKEN[$name]:--}" \
        "${RESULT[$name]}"
      [[ "${RESULT[$name]}" == PASS || "${RESULT[$name]}" == ran* ]] || bad=1
    done
    echo "logs: $OUT/gpu-run.tar.gz"
    exit $bad  # of this block's subshell (a pipeline element): its status is the run's
  } | tee "$OUT/table.txt"
  local rc=${PIPESTATUS[0]}
  tar czf "$OUT/gpu-run.tar.gz" -C "$OUT" run && rm -rf "$RUN"
  return "$rc"
}

case "${1:-}" in
  prepare) prepare ;;
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' ;;
  *) run_items "${@:-${ONLY:-checks}}" ;;
esac
