#!/usr/bin/env bash
# One device call for a chosen set of GPU checks, in this order, each bounded by what is left of
# a 10-minute call: unit (the CudaBackend GPU tests), pytest (tests/gpu), multi (issue 8, two GPUs
# only), streams (issue 4: record_stream canary, sync retry, soak), probe (compile/graphs),
# wheel (issue 4 packaging), workloads (issue 3: workloads_compare.py, three allocators), ab
# (issues 2 and 7: interleaved step-time A/B). Carry .devbuild/lib (and .devbuild/wheeldeps for
# the wheel); prepare with run_h200.sh prepare && run_multi.sh prepare-tests.
# Env: ONLY="unit pytest workloads ..." (a subset; default: all), BUDGET_S (570), AB_MODES
# (native,plugin,shim,shim-noexp), AB_ROUNDS, WORKLOADS (gpt2m,llama1b,llama1b-ckpt), ROUNDS (1).
# Outputs under $OUT; the summary lines come last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/.devbuild/out}"; mkdir -p "$OUT"
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$ROOT/.devbuild/lib/libvramledger_plugin.so"
export PYTHONPATH="$ROOT/torch_plugin/python"
START=$(date +%s); BUDGET=${BUDGET_S:-570}
ONLY=${ONLY:-unit pytest multi streams probe wheel workloads ab}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
want() { [[ " $ONLY " == *" $1 "* ]] && [ "$(left)" -gt "${2:-30}" ]; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $GPUS"

if want unit 30; then
  TORCH_LIB="$("$PY" -c "import os, torch
r = os.path.dirname(torch.__file__)
print(os.path.join(r, 'lib') + ':' + os.path.join(os.path.dirname(r), 'nvidia', 'cu13', 'lib'))")"
  LD_LIBRARY_PATH="$ROOT/.devbuild/lib:$TORCH_LIB" timeout 120 .devbuild/lib/cuda_backend_test \
    > "$OUT/unit.log" 2>&1
  echo "unit exit $?"
fi
if want pytest 90; then
  timeout $(( $(left) - 5 )) "$PY" -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?"
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
if want workloads 200; then
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/workloads_compare.py --out "$OUT/workloads" \
    --workloads "${WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" --rounds "${ROUNDS:-1}" \
    > "$OUT/workloads.log" 2>&1
  echo "workloads exit $?"
fi
if want ab 120; then
  rounds=${AB_ROUNDS:-$(( $(left) > 330 ? 3 : 2 ))}
  timeout $(( $(left) - 5 )) "$PY" benchmarks/gpu/step_ab.py --rounds "$rounds" --steps 10 \
    --modes "${AB_MODES:-native,plugin,shim,shim-noexp}" \
    --json "$OUT/step_ab.json" > "$OUT/step_ab.log" 2>&1
  echo "step_ab exit $?"
fi

echo "==== summary"
[ -f "$OUT/unit.log" ] && grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \] " "$OUT/unit.log"
[ -f "$OUT/pytest.log" ] && tail -1 "$OUT/pytest.log"
[ -f "$OUT/workloads.log" ] && cat "$OUT/workloads.log"
[ -f "$OUT/multi.log" ] && sed -n '/==== issue 8 table/,$p' "$OUT/multi.log"
[ -f "$OUT/streams.log" ] && grep -E "^(1a|1b|3) " "$OUT/streams.log"
[ -f "$OUT/probe.log" ] && tail -3 "$OUT/probe.log"
[ -f "$OUT/wheel.log" ] && grep -E "PASS|FAIL|SKIP|wheel" "$OUT/wheel.log" | tail -15
[ -f "$OUT/step_ab.log" ] && tail -6 "$OUT/step_ab.log"
echo "used $(( $(date +%s) - START )) s"
