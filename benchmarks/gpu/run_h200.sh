#!/usr/bin/env bash
# The GPU proof of issue 2 in two halves: `prepare` builds the torch plugin here; the default mode
# runs, on the H200 machine, the GPU tests and the native-vs-vramledger training comparison.
#
# Route (the simplest that is robust): the GPU image has torch 2.11.0+cu130, cmake and g++ but no
# Abseil, so nothing is built there. The plugin does not depend on the Python version (it links
# libc10 and libcudart, which the torch in the process has already loaded), so it is built here
# against the project venv's torch 2.11.0+cu130, with every Abseil library it needs copied beside
# it (RPATH $ORIGIN), into .devbuild/lib (ignored by git; carried to the machine). The Python
# package travels as source (torch_plugin/python on PYTHONPATH); the GPU run needs no `_core`.
#
#   here:      benchmarks/gpu/run_h200.sh prepare
#   GPU:       device run, carry [".devbuild/lib"], command: bash benchmarks/gpu/run_h200.sh
#
# The GPU mode writes gpu_tests.log, train_compare.log, train_compare.json and
# train_compare_table.txt under $OUT (default .devbuild/out) and prints a short summary last.
# Exit status: 0 when every GPU test passed and the losses agree.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LIBDIR="$ROOT/.devbuild/lib"
PLUGIN="$LIBDIR/libvramledger_plugin.so"

# Prints the paths of the absl libraries a process maps after loading the plugin through the
# package; fails if one of them does not come from the plugin's own folder.
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
  local build="$ROOT/.devbuild/build"
  cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
    -DVRAMLEDGER_BUILD_TESTS=OFF -DVRAMLEDGER_BUILD_BENCHMARKS=ON -DVRAMLEDGER_BUILD_PYTHON=OFF
  ninja -C "$build" vramledger_plugin vramledger_native vramledger_preload \
    vramledger_driver_api_alloc vramledger_host_cost_bench vramledger_allocator_swap
  rm -rf "$LIBDIR"
  mkdir -p "$LIBDIR"
  cp "$build/torch_plugin/lib/libvramledger_plugin.so" "$build"/torch_plugin/lib/libabsl_*.so.* \
     "$LIBDIR/"
  # The torch-native mode (install(mode="native")), found beside the plugin.
  cp "$build/torch_plugin/lib/libvramledger_native.so" "$LIBDIR/"
  # Issue 7: the LD_PRELOAD shim (its Abseil set is the plugin's) and the driver-API program
  # that benchmarks/gpu/preload_check.sh runs under it.
  cp "$build/torch_plugin/preload/lib/libvramledger_preload.so" \
     "$build/torch_plugin/preload/lib/vramledger_driver_api_alloc" "$LIBDIR/"
  # Issues 3 and 7: host cost per allocation, torch native beside vramledger (run_checks.sh).
  cp "$build/torch_plugin/lib/vramledger_host_cost_bench" "$LIBDIR/"
  # Issues 3 and 7: torch's allocator swapped between steps (inprocess_ab.py).
  cp "$build/torch_plugin/lib/libvramledger_allocator_swap.so" "$LIBDIR/"
  cp -n "$build"/torch_plugin/preload/lib/libabsl_*.so.* "$LIBDIR/" 2>/dev/null || true
  echo "--- $PLUGIN"
  readelf -d "$PLUGIN" | grep -E 'NEEDED|RPATH|RUNPATH'
  # Every NEEDED library outside torch's and the system's must sit beside the plugin.
  local missing=0 lib
  local needed
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
  du -sh "$LIBDIR"
  echo "prepare: done. Run on the GPU machine with carry [\".devbuild/lib\"]:"
  echo "  bash benchmarks/gpu/run_h200.sh"
}

gpu() {
  local py="${PYTHON:-/opt/torch/.venv/bin/python3}"
  [ -x "$py" ] || py="$(command -v python3)"
  local out="${OUT:-$ROOT/.devbuild/out}"
  mkdir -p "$out"
  if [ ! -f "$PLUGIN" ]; then
    echo "run_h200: $PLUGIN is missing. Build it on the development machine with"
    echo "  benchmarks/gpu/run_h200.sh prepare"
    echo "and carry .devbuild/lib to this machine."
    exit 2
  fi
  export PYTHONUNBUFFERED=1
  export VRAMLEDGER_PLUGIN="$PLUGIN"
  export PYTHONPATH="$ROOT/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}"
  cd "$ROOT"

  echo "==== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$py" -c "import sys, torch, transformers
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda,
      '| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())"
  local torch_libs
  torch_libs="$("$py" -c "import os, torch
r = os.path.dirname(torch.__file__)
print(os.path.join(r, 'lib') + ':' + os.path.join(os.path.dirname(r), 'nvidia', 'cu13', 'lib'))")"
  echo "==== plugin dependencies (with torch's library folders on the path)"
  LD_LIBRARY_PATH="$torch_libs" ldd "$PLUGIN" | grep -vE 'libabsl_' || true
  if LD_LIBRARY_PATH="$torch_libs" ldd "$PLUGIN" | grep -q 'not found'; then
    echo "run_h200: unresolved dependencies"; exit 2
  fi
  check_bundle "$py" || { echo "run_h200: the plugin does not load from its bundle"; exit 2; }

  echo "==== GPU tests"
  "$py" -m pytest -v -p no:cacheprovider "$ROOT/tests/gpu/test_plugin_gpu.py" 2>&1 |
    tee "$out/gpu_tests.log"
  local tests_rc=${PIPESTATUS[0]}

  echo "==== GPT-2-medium: native vs vramledger"
  "$py" "$ROOT/benchmarks/gpu/train_compare.py" --out "$out" 2>&1 | tee "$out/train_compare.log"
  local compare_rc=${PIPESTATUS[0]}

  echo
  echo "==== summary"
  echo "GPU tests (exit $tests_rc):" \
       "$(grep -E '(passed|failed|error|skipped)' "$out/gpu_tests.log" | tail -1)"
  echo "training comparison (exit $compare_rc):"
  cat "$out/train_compare_table.txt" 2>/dev/null || echo "  no table: see train_compare.log"
  [ "$tests_rc" = 0 ] && [ "$compare_rc" = 0 ]
}

case "${1:-gpu}" in
  prepare) prepare ;;
  gpu) gpu ;;
  *) echo "usage: $0 [prepare|gpu]"; exit 2 ;;
esac
