#!/usr/bin/env bash
# Second device call: issue 3's Llama workloads, the record_stream probe, issue 5's snapshot
# check and issue 6's guard check. Carry .devbuild/lib (benchmarks/gpu/run_h200.sh prepare).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.devbuild/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$ROOT/.devbuild/lib/libvramledger_plugin.so"
export PYTHONPATH="$ROOT/torch_plugin/python"
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=python3
cd "$OUT"
echo "==== record_stream probe"; timeout 60 "$PY" "$ROOT/benchmarks/gpu/record_stream_probe.py" 2>&1 | tail -5
echo "==== issue 6 guard check"; timeout 200 "$PY" "$ROOT/benchmarks/gpu/guard_check.py" --out "$OUT" > guard.log 2>&1; echo "exit $?"; tail -25 guard.log
echo "==== issue 5 snapshot check"; timeout 150 "$PY" "$ROOT/benchmarks/gpu/snapshot_check.py" --out "$OUT" --steps 6 > snap.log 2>&1; echo "exit $?"; tail -20 snap.log
echo "==== issue 3 llama workloads"; timeout 230 "$PY" "$ROOT/benchmarks/gpu/workloads_compare.py" --out "$OUT" --workloads llama1b,llama1b-ckpt 2> wl.err; echo "exit $?"; tail -c 1500 wl.err
