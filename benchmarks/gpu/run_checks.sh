#!/usr/bin/env bash
# One device call for a chosen set of GPU checks, in this order, each bounded by what is left of
# a 10-minute call:
#   unit         the CudaBackend GPU tests (.devbuild/lib/cuda_backend_test)
#   pytest       tests/gpu (the plugin on a real device)
#   train        run_h200.sh gpu: GPT-2-medium native vs vramledger (issue 2)
#   multi        issue 8 (run_multi.sh; two GPUs only)
#   integration  issue 4: torch_integration_check.py
#   native       issue 3: torch_integration_check.py --mode native (the torch-native mode)
#   streams      issue 4: record_stream canary, synchronized retry, soak
#   probe        issue 4: compile / CUDA graphs probe
#   wheel        issue 4: the wheel (needs .devbuild/wheeldeps)
#   snapshot     issue 5: snapshot_check.py
#   guard        issue 6: guard_check.py (GPT-2; GUARD_MODEL=llama1b for Llama-1B)
#   preload      issue 7: preload_check.sh and preload_plan_check.sh
#   workloads    issue 3: workloads_compare.py, three allocators (~200-500 s per round of the
#                three workloads on an H200: ROUNDS=2 of all three does not fit one call)
#   kernels      issue 3: kernel time on expandable-segment vs cudaMalloc memory, one process
#                (vmm_kernel_probe.py)
#   ab           issues 2 and 7: interleaved step-time A/B (step_ab.py)
#   inprocess    issues 3 and 7: step time, native and vramledger swapped between steps in one
#                process (inprocess_ab.py; ~40-60 s per workload and process at 30 groups)
#   hostcost     issues 3 and 7: host ns per allocation, torch native vs vramledger in one
#                process, over the three bundled training traces (host_cost_bench)
# Carry .devbuild/lib (and .devbuild/wheeldeps for the wheel); prepare with
# run_h200.sh prepare && run_multi.sh prepare-tests.
# Env: ONLY="unit pytest workloads ..." (a subset; default: unit pytest multi streams workloads
# ab), BUDGET_S (570), AB_MODES (native,plugin,shim,shim-noexp,torch-exp,torch-async,
# native-again), AB_ROUNDS, AB_STEPS (10), INPROCESS_GROUPS (30), INPROCESS_WORKLOADS
# (gpt2m,llama1b,llama1b-ckpt), INPROCESS_LENGTHS (repeat, steady or fresh; repeat and steady are tighter),
# INPROCESS_SHIM (1: each workload also under the shim, issue 7), INPROCESS_MODE (pluggable or
# native: vramledger's route into torch),
# HOSTCOST_TRACES (gpt2m llama1b llama1b-ckpt),
# HOSTCOST_SHIM (1: each trace also under the LD_PRELOAD shim), WORKLOADS
# (gpt2m,llama1b,llama1b-ckpt), ROUNDS (1). Outputs under $OUT; the summary lines come last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/.devbuild/out}"; mkdir -p "$OUT"
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$ROOT/.devbuild/lib/libvramledger_plugin.so"
export PYTHONPATH="$ROOT/torch_plugin/python"
START=$(date +%s); BUDGET=${BUDGET_S:-570}
ONLY=${ONLY:-unit pytest multi streams workloads ab}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
want() { [[ " $ONLY " == *" $1 "* ]] && [ "$(left)" -gt "${2:-30}" ]; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $GPUS"

TORCH_LIB="$("$PY" -c "import os, torch
r = os.path.dirname(torch.__file__)
print(os.path.join(r, 'lib') + ':' + os.path.join(os.path.dirname(r), 'nvidia', 'cu13', 'lib'))")"
if want unit 30; then
  LD_LIBRARY_PATH="$ROOT/.devbuild/lib:$TORCH_LIB" timeout 120 .devbuild/lib/cuda_backend_test \
    > "$OUT/unit.log" 2>&1
  echo "unit exit $?"
fi
if want pytest 90; then
  timeout $(( $(left) - 5 )) "$PY" -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"
fi
if want train 200; then
  timeout $(( $(left) - 5 )) bash benchmarks/gpu/run_h200.sh gpu > "$OUT/train.log" 2>&1
  echo "train exit $?"
fi
if want multi 200 && [ "$GPUS" -ge 2 ]; then
  STEPS=8 timeout $(( $(left) - 10 )) bash benchmarks/gpu/run_multi.sh > "$OUT/multi.log" 2>&1
  echo "multi exit $?"
fi
if want streams 60; then
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/streams_compile_check.py --checks record_stream,soak \
    --out "$OUT/streams" --budget-s 100 > "$OUT/streams.log" 2>&1
  echo "streams exit $?"
fi
if want probe 150; then
  timeout 140 "$PY" benchmarks/gpu/compile_graphs_probe.py > "$OUT/probe.log" 2>&1
  echo "probe exit $?"
fi
if want wheel 150 && [ -d .devbuild/wheeldeps ]; then
  timeout $(( $(left) - 5 )) bash benchmarks/gpu/wheel_check.sh gpu > "$OUT/wheel.log" 2>&1
  echo "wheel exit $?"
fi
if want integration 120; then
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/torch_integration_check.py \
    > "$OUT/integration.log" 2>&1
  echo "integration exit $?"
fi
if want native 120; then
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/torch_integration_check.py --mode native \
    > "$OUT/native.log" 2>&1
  echo "native exit $?"
fi
if want snapshot 120; then
  (cd "$OUT" && timeout $(( $(left) - 5 )) "$PY" "$ROOT/benchmarks/gpu/snapshot_check.py" \
    --out "$OUT" --steps 6 > "$OUT/snapshot.log" 2>&1)
  echo "snapshot exit $?"
fi
if want guard 150; then
  (cd "$OUT" && timeout $(( $(left) - 5 )) "$PY" "$ROOT/benchmarks/gpu/guard_check.py" \
    --model "${GUARD_MODEL:-gpt2}" --out "$OUT/guard" > "$OUT/guard.log" 2>&1)
  echo "guard exit $?"
fi
if want preload 200; then
  PYTHON="$PY" OUT="$OUT/preload" STEPS=6 timeout $(( $(left) - 5 )) bash \
    benchmarks/gpu/preload_check.sh "$ROOT/.devbuild/lib/libvramledger_preload.so" \
    > "$OUT/preload.log" 2>&1
  echo "preload exit $?"
  PYTHON="$PY" OUT="$OUT/preload_plan" timeout $(( $(left) - 5 )) bash \
    benchmarks/gpu/preload_plan_check.sh "$ROOT/.devbuild/lib/libvramledger_preload.so" \
    > "$OUT/preload_plan.log" 2>&1
  echo "preload_plan exit $?"
fi
if want workloads 200; then
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/workloads_compare.py --out "$OUT/workloads" \
    --workloads "${WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" --rounds "${ROUNDS:-1}" \
    > "$OUT/workloads.log" 2>&1
  echo "workloads exit $?"
fi
if want kernels 90; then
  timeout 150 "$PY" benchmarks/gpu/vmm_kernel_probe.py --json "$OUT/kernels.json" \
    > "$OUT/kernels.log" 2>&1
  echo "kernels exit $?"
fi
if want ab 120; then
  rounds=${AB_ROUNDS:-$(( $(left) > 330 ? 3 : 2 ))}
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/step_ab.py --rounds "$rounds" \
    --steps "${AB_STEPS:-10}" \
    --modes "${AB_MODES:-native,plugin,shim,shim-noexp}" \
    --json "$OUT/step_ab.json" > "$OUT/step_ab.log" 2>&1
  echo "step_ab exit $?"
fi

if want inprocess 120; then
  shim_arg=()
  [ "${INPROCESS_SHIM:-0}" = 1 ] && shim_arg=(--shim "$ROOT/.devbuild/lib/libvramledger_preload.so")
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/inprocess_ab.py \
    --workloads "${INPROCESS_WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" \
    --groups "${INPROCESS_GROUPS:-30}" --lengths "${INPROCESS_LENGTHS:-repeat}" \
    --mode "${INPROCESS_MODE:-pluggable}" \
    --json "$OUT/inprocess_ab.json" \
    "${shim_arg[@]}" \
    > "$OUT/inprocess.log" 2>&1
  echo "inprocess exit $?"
fi

if want hostcost 60; then
  : > "$OUT/hostcost.log"
  for t in ${HOSTCOST_TRACES:-gpt2m llama1b llama1b-ckpt}; do
    LD_LIBRARY_PATH="$ROOT/.devbuild/lib:$TORCH_LIB" timeout 120 \
      .devbuild/lib/vramledger_host_cost_bench "traces/trace-$t-native.csv.gz" --passes 7 \
      >> "$OUT/hostcost.log" 2>&1
    echo "hostcost $t exit $?"
    # Issue 7: torch's row is then the shim's path. The backend is named here because the
    # bench links libc10_cuda, which may read the variable before the shim's constructor sets it
    # (in Python, torch loads after the shim); the bench prints the backend it got.
    if [ "${HOSTCOST_SHIM:-0}" = 1 ]; then
      LD_LIBRARY_PATH="$ROOT/.devbuild/lib:$TORCH_LIB" VRAMLEDGER_PRELOAD_QUIET=1 \
        PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync \
        VRAMLEDGER_CONF=expandable_segments:True,host_timing:True VRAMLEDGER_PRELOAD_NO_EXIT_DUMP=1 \
        LD_PRELOAD="$ROOT/.devbuild/lib/libvramledger_preload.so" timeout 120 \
        .devbuild/lib/vramledger_host_cost_bench "traces/trace-$t-native.csv.gz" --passes 7 \
        >> "$OUT/hostcost.log" 2>&1
      echo "hostcost $t under the shim exit $?"
    fi
  done
fi

echo "==== summary"
[ -f "$OUT/unit.log" ] && grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \] " "$OUT/unit.log"
[ -f "$OUT/pytest.log" ] && tail -1 "$OUT/pytest.log"
[ -f "$OUT/train.log" ] && tail -12 "$OUT/train.log"
[ -f "$OUT/integration.log" ] && grep -E "PASS|FAIL" "$OUT/integration.log"
[ -f "$OUT/native.log" ] && grep -E "PASS|FAIL" "$OUT/native.log"
[ -f "$OUT/snapshot.log" ] && grep -E "^(PASS|FAIL)" "$OUT/snapshot.log"
[ -f "$OUT/guard.log" ] && grep -E "^(PASS|FAIL)" "$OUT/guard.log"
[ -f "$OUT/preload.log" ] && tail -12 "$OUT/preload.log"
[ -f "$OUT/preload_plan.log" ] && tail -8 "$OUT/preload_plan.log"
[ -f "$OUT/workloads.log" ] && cat "$OUT/workloads.log"
[ -f "$OUT/multi.log" ] && sed -n '/==== issue 8 table/,$p' "$OUT/multi.log"
[ -f "$OUT/streams.log" ] && grep -E "^(1a|1b|3) " "$OUT/streams.log"
[ -f "$OUT/probe.log" ] && tail -3 "$OUT/probe.log"
[ -f "$OUT/wheel.log" ] && grep -E "PASS|FAIL|SKIP|wheel" "$OUT/wheel.log" | tail -15
[ -f "$OUT/kernels.log" ] && tail -4 "$OUT/kernels.log"
[ -f "$OUT/step_ab.log" ] && tail -6 "$OUT/step_ab.log"
[ -f "$OUT/inprocess.log" ] && sed -n '/^| workload | ratio/,$p' "$OUT/inprocess.log"
[ -f "$OUT/hostcost.log" ] && grep -E "^(trace|\| |vramledger)" "$OUT/hostcost.log"
echo "used $(( $(date +%s) - START )) s"
