#!/usr/bin/env bash
# The LD_PRELOAD shim under "a plan 20% too small": GPT-2-medium training (train_compare.py's unmodified
# native child) under the LD_PRELOAD shim with a plan whose limit is 80% of the peak measured
# without the shim must fail with torch's OutOfMemoryError, and the shim's refusal report (written
# to the dump directory) must name the plan line and the Python frame that asked.
# Usage: benchmarks/gpu/checks/preload_plan_check.sh [PRELOAD_SO] (default .devbuild/lib's copy).
# Env: PYTHON, OUT (default /tmp/preload_plan_check), STEPS (10), PEAK_BYTES (skip the native run).
# Prints PASS/FAIL lines with the evidence; exit status 0 when every check passed.
set -u
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-python}
SO=${1:-$PWD/.devbuild/lib/libvramledger_preload.so}
OUT=${OUT:-/tmp/preload_plan_check}; rm -rf "$OUT"; mkdir -p "$OUT/dumps"
STEPS=${STEPS:-10}
[ -f "$SO" ] || { echo "FAIL: no shim at $SO"; exit 2; }
PEAK=${PEAK_BYTES:-}
if [ -z "$PEAK" ]; then
  echo "== measuring the peak without the shim"
  $PY benchmarks/gpu/checks/train_compare.py --child native --steps "$STEPS" > "$OUT/native.txt" 2>&1 || { tail -30 "$OUT/native.txt"; exit 2; }
  PEAK=$($PY -c 'import json, sys
l = [x for x in open(sys.argv[1]) if x.startswith("RESULT_JSON ")][-1]
print(json.loads(l[len("RESULT_JSON "):])["peak_allocated"])' "$OUT/native.txt")
fi
LIMIT=$((PEAK * 8 / 10))
cat > "$OUT/plan.json" <<J
{
  "vramledger_plan": 1,
  "comment": "80% of the native peak allocated ($PEAK bytes): 20% too small",
  "limit": $LIMIT
}
J
LIMIT_LINE=$(grep -n '"limit"' "$OUT/plan.json" | cut -d: -f1)
echo "peak allocated without the shim: $PEAK bytes; plan limit: $LIMIT bytes (plan.json line $LIMIT_LINE)"
echo "== under the shim with the plan"
VRAMLEDGER_PRELOAD_QUIET=1 VRAMLEDGER_CONF="dump_dir:$OUT/dumps,expandable_segments:True,plan:$OUT/plan.json" \
  LD_PRELOAD="$SO" $PY benchmarks/gpu/checks/train_compare.py --child native --steps "$STEPS" > "$OUT/shim_plan.txt" 2>&1
RC=$?
fails=0
check() {  # check OK|FAIL MESSAGE
  if [ "$1" = OK ]; then echo "PASS: $2"; else echo "FAIL: $2"; fails=$((fails + 1)); fi
}
[ "$RC" != 0 ] && r=OK || r=FAIL; check $r "the training script failed (exit status $RC)"
oom=$(grep -E "OutOfMemoryError" "$OUT/shim_plan.txt" | tail -1)
[ -n "$oom" ] && r=OK || r=FAIL; check $r "torch raised its OutOfMemoryError: ${oom:0:200}"
REPORT=$(ls "$OUT"/dumps/vramledger-preload-pid*-refusal-1.txt 2>/dev/null | head -1)
[ -n "$REPORT" ] && r=OK || r=FAIL; check $r "refusal report in the dump directory: ${REPORT:-none}"
if [ -n "$REPORT" ]; then
  plan_line=$(grep -m1 "vramledger plan violation: $OUT/plan.json:$LIMIT_LINE: limit" "$REPORT")
  [ -n "$plan_line" ] && r=OK || r=FAIL; check $r "the report names the plan line: ${plan_line:-$(head -1 "$REPORT")}"
  frame=$(grep -m1 -E '^    [^[].*\.py:[0-9]+ in ' "$REPORT" | sed 's/^ *//')
  [ -n "$frame" ] && r=OK || r=FAIL; check $r "the report names the Python frame that asked: ${frame:-none}"
  if [ -z "$frame" ] && grep -q "autograd" "$REPORT"; then
    echo "  note: the refusal came from autograd's thread (no Python frames there; the shim never waits for the GIL on it)"
  fi
  snap=$(sed -n 's/^  forensic snapshot: \(\/.*\.json\).*/\1/p' "$REPORT" | head -1)
  [ -n "$snap" ] && [ -f "$snap" ] && grep -q "plan violation" "$snap" && r=OK || r=FAIL
  check $r "the forensic snapshot holds the report: ${snap:-none}"
  if [ -n "$frame" ] && [ -n "$snap" ] && [ -f "$snap" ]; then
    grep -qF "${frame%% in *}" "$snap" && r=OK || r=FAIL; check $r "the forensic snapshot names the same Python frame"
  fi
  echo "---- report (first 30 lines)"; head -30 "$REPORT"
fi
echo "---- the script's last lines"; tail -4 "$OUT/shim_plan.txt"
[ "$fails" = 0 ]
