#!/usr/bin/env bash
# Fourth device call: issue 4's torch integration check and streams/compile check, issue 7's
# LD_PRELOAD check, issue 6's GPT-2 guard recheck (Python frame). Carry .devbuild/lib (plugin +
# preload shim + Abseil). The streams/compile check alone takes ~5-6 min (budget 560 s).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.devbuild/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$ROOT/.devbuild/lib/libvramledger_plugin.so"
export PYTHONPATH="$ROOT/torch_plugin/python"
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=python3
echo "==== issue 4"; timeout 150 "$PY" "$ROOT/benchmarks/gpu/torch_integration_check.py" > "$OUT/torch_integration.log" 2>&1; echo "exit $?"; tail -25 "$OUT/torch_integration.log"
echo "==== issue 4 streams + compile (own processes, native vs vramledger; ~5-6 min)"; timeout 600 "$PY" "$ROOT/benchmarks/gpu/streams_compile_check.py" --out "$OUT/streams" > "$OUT/streams_compile.log" 2>&1; echo "exit $?"; { grep -q '^check ' "$OUT/streams_compile.log" && sed -n '/^check /,$p' "$OUT/streams_compile.log" | head -60; } || tail -20 "$OUT/streams_compile.log"
echo "==== issue 7"; PYTHON="$PY" OUT="$OUT/preload" STEPS=6 timeout 200 bash "$ROOT/benchmarks/gpu/preload_check.sh" "$ROOT/.devbuild/lib/libvramledger_preload.so" > "$OUT/preload.log" 2>&1; echo "exit $?"; tail -30 "$OUT/preload.log"
echo "==== issue 6 gpt2 recheck"; (cd "$OUT" && timeout 150 "$PY" "$ROOT/benchmarks/gpu/guard_check.py" --out "$OUT/g2" > guard_gpt2.log 2>&1; echo "exit $?"); grep -E "^(PASS|FAIL)" "$OUT/guard_gpt2.log"
