#!/usr/bin/env bash
# Issue 8 on a two-GPU machine (nvidia-h200-x2): the CudaBackend GPU tests (peer access among
# them), one process driving two GPUs (two_gpu_check.py), and GPT-2-medium DDP over NCCL with two
# ranks under torchrun, native vs vramledger with a plan per rank (ddp_check.py), then
# `vramledger report` of the ranks' step logs. Prints a table last.
#
#   here:  benchmarks/gpu/run_h200.sh prepare && benchmarks/gpu/run_multi.sh prepare-tests
#   GPU:   device run (kind nvidia-h200-x2), carry [".devbuild/lib"]:
#          bash benchmarks/gpu/run_multi.sh
# Outputs under $OUT (default .devbuild/out/multi). Exit status 0 when every check passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LIBDIR="$ROOT/.devbuild/lib"

prepare_tests() {
  # The C++ GPU test binary, with the Abseil libraries it needs beside the plugin's.
  set -e
  local build="$ROOT/.devbuild/tests"
  cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$ROOT/.venv/bin/python" -DVRAMLEDGER_BUILD_PYTHON=OFF >/dev/null
  ninja -C "$build" cuda_backend_test
  cp "$build/tests/cuda_backend_test" "$LIBDIR/"
  ldd "$LIBDIR/cuda_backend_test" | awk '/libabsl_|libgtest|libgmock/ {print $3}' |
    xargs -r -I{} cp -n {} "$LIBDIR/"
  echo "prepare-tests: $LIBDIR/cuda_backend_test"
}

gpu() {
  local out="${OUT:-$ROOT/.devbuild/out}/multi"
  mkdir -p "$out"
  local py="${PYTHON:-/opt/torch/.venv/bin/python3}"
  [ -x "$py" ] || py="$(command -v python3)"
  export PYTHONUNBUFFERED=1 VRAMLEDGER_PLUGIN="$LIBDIR/libvramledger_plugin.so"
  export PYTHONPATH="$ROOT/torch_plugin/python"
  cd "$ROOT"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4

  echo "==== CudaBackend GPU tests"
  local torch_lib
  torch_lib="$("$py" -c "import os, torch
r = os.path.dirname(torch.__file__)
print(os.path.join(r, 'lib') + ':' + os.path.join(os.path.dirname(r), 'nvidia', 'cu13', 'lib'))")"
  LD_LIBRARY_PATH="$LIBDIR:$torch_lib" timeout 120 "$LIBDIR/cuda_backend_test" \
    > "$out/cuda_backend_test.log" 2>&1
  local unit_rc=$?
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK \] .*Peer|FAILED" "$out/cuda_backend_test.log" | head -20

  echo "==== one process, two GPUs"
  timeout 180 "$py" benchmarks/gpu/two_gpu_check.py --json "$out/two_gpu.json" \
    > "$out/two_gpu.log" 2>&1
  local two_rc=$?
  tail -12 "$out/two_gpu.log"

  echo "==== DDP, two ranks: native, then vramledger"
  rm -rf "$out/ddp-native" "$out/ddp-vl"
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
  local steps="${STEPS:-10}"
  timeout 240 "$py" -m torch.distributed.run --nproc_per_node=2 benchmarks/gpu/ddp_check.py \
    --worker --allocator native --steps "$steps" --out "$out/ddp-native" > "$out/ddp-native.log" 2>&1
  echo "native exit $?"
  timeout 240 "$py" -m torch.distributed.run --nproc_per_node=2 benchmarks/gpu/ddp_check.py \
    --worker --allocator vramledger --steps "$steps" --out "$out/ddp-vl" > "$out/ddp-vl.log" 2>&1
  echo "vramledger exit $?"
  "$py" benchmarks/gpu/ddp_check.py --compare "$out/ddp-native" "$out/ddp-vl" \
    > "$out/ddp_compare.txt" 2>&1
  local ddp_rc=$?
  [ "$ddp_rc" = 0 ] || { tail -30 "$out/ddp-native.log"; tail -30 "$out/ddp-vl.log"; }
  echo "==== vramledger report"
  "$py" -m vramledger report "$out/ddp-vl/steps" > "$out/report.txt" 2>&1
  local report_rc=$?
  cat "$out/report.txt"

  echo
  echo "==== issue 8 table"
  echo "CudaBackend GPU tests (exit $unit_rc): $(grep -E '^\[  PASSED|^\[  FAILED' "$out/cuda_backend_test.log" | tr '\n' ' ')"
  grep -E "^(PASS|FAIL|SKIP)" "$out/two_gpu.log"
  cat "$out/ddp_compare.txt"
  echo "vramledger report exit $report_rc"
  [ "$unit_rc" = 0 ] && [ "$two_rc" = 0 ] && [ "$ddp_rc" = 0 ] && [ "$report_rc" = 0 ]
}

case "${1:-gpu}" in
  prepare-tests) prepare_tests ;;
  gpu) gpu ;;
  *) echo "usage: $0 [prepare-tests|gpu]"; exit 2 ;;
esac
