#!/usr/bin/env bash
# Third device call: issue 2's GPU tests again (record_stream test fixed) + training comparison,
# and issue 6's Llama-1B guard proof. Carry .devbuild/lib.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.devbuild/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$ROOT/.devbuild/lib/libvramledger_plugin.so"
export PYTHONPATH="$ROOT/torch_plugin/python"
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=python3
echo "==== issue 2"; timeout 260 bash "$ROOT/benchmarks/gpu/run_h200.sh" gpu > "$OUT/issue2.log" 2>&1; echo "exit $?"
grep -E "passed|failed" "$OUT/issue2.log" | tail -2; grep -A6 "ratio vl/native" "$OUT/issue2.log" | tail -7
echo "==== issue 6 llama1b"; (cd "$OUT" && timeout 280 "$PY" "$ROOT/benchmarks/gpu/guard_check.py" --model llama1b --out "$OUT" > guard_llama.log 2>&1; echo "exit $?")
grep -E "^(PASS|FAIL)" "$OUT/guard_llama.log"; grep -m1 -A12 "vramledger plan violation" "$OUT/guard_llama.log" | head -16
