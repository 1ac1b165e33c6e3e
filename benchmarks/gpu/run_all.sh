#!/usr/bin/env bash
# One device call for the GPU proofs: issue 2 (GPU tests + GPT-2 native vs vramledger) and
# issue 3 (workloads x allocators). WORKLOADS selects issue 3's workloads (default all three).
# Run `benchmarks/gpu/run_h200.sh prepare` here first and carry .devbuild/lib.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.devbuild/out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export VRAMLEDGER_PLUGIN="$ROOT/.devbuild/lib/libvramledger_plugin.so"
export PYTHONPATH="$ROOT/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-/opt/torch/.venv/bin/python3}"
[ -x "$PY" ] || PY="$(command -v python3)"
rc=0
if [ "${SKIP_ISSUE2:-0}" != 1 ]; then
  bash "$ROOT/benchmarks/gpu/run_h200.sh" gpu > "$OUT/issue2.log" 2>&1 || rc=1
  tail -30 "$OUT/issue2.log"
fi
if [ -n "${WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" ]; then
  echo "==== issue 3: workloads x allocators"
  "$PY" "$ROOT/benchmarks/gpu/workloads_compare.py" --out "$OUT" \
     --workloads "${WORKLOADS:-gpt2m,llama1b,llama1b-ckpt}" 2>"$OUT/workloads.err" || rc=1
  tail -c 3000 "$OUT/workloads.err"
fi
exit $rc
