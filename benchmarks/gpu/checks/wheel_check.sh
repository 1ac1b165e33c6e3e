#!/usr/bin/env bash
# Proves the vramledger wheel: `pip wheel .` builds the C++ libraries, the _core
# module and the torch plugin against the installed torch, and the wheel installed into a fresh
# environment runs with nothing but itself (and torch) providing its libraries.
#
#   here:      bash benchmarks/gpu/checks/wheel_check.sh prepare
#   GPU:       device run, carry [".devbuild/wheeldeps"], command: bash benchmarks/gpu/checks/wheel_check.sh gpu
#
# `prepare` collects into .devbuild/wheeldeps/ what the build needs that the GPU image lacks:
#   prefix/   an install prefix with Debian's Abseil (headers, shared libraries, CMake package),
#             nlohmann-json (headers, CMake package) and zlib (headers, libz.so); both CMake
#             packages locate themselves relative to their own file, so the copied tree works
#             from any folder (the build passes CMAKE_PREFIX_PATH=prefix);
#   wheels/   scikit-build-core, pybind11 and their pure-Python dependencies for Python 3.12.
# `gpu` (any machine with torch; named for where it is meant to run):
#   1. a build venv (torch visible through a .pth), the carried build wheels installed offline;
#   2. `pip wheel --no-build-isolation --no-deps .` into $OUT/dist (timed, clean build dir);
#   3. a second fresh venv with only the wheel installed; the deps folder renamed away,
#      LD_LIBRARY_PATH and PYTHONPATH unset, run from a folder outside the repo;
#   4. checks: vramledger --version, python -m vramledger --help, _core imports with every
#      Abseil library mapped from the package's own folder, ldd of _core / plugin / shim without
#      'not found', vramledger.install() + a CUDA tensor (SKIP without a GPU), replay --json.
# Prints a PASS/FAIL/SKIP table last; exit status 0 when nothing failed.
#
# Environment: PYTHON (the interpreter with torch; default /opt/torch/.venv/bin/python3, else
# .venv/bin/python), OUT (default .devbuild/out-wheel), WHEEL_BUILD_DIR (default build-wheel),
# WHEEL_WORK (venvs; default /tmp/wheel-check), JOBS (build parallelism; default nproc).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
DEPS="$ROOT/.devbuild/wheeldeps"
MULTIARCH=x86_64-linux-gnu

prepare() {
  set -e
  local src=/usr/lib/$MULTIARCH prefix="$DEPS/prefix" f name
  rm -rf "$DEPS"
  mkdir -p "$prefix/include" "$prefix/lib/$MULTIARCH/cmake" "$prefix/share/cmake" "$DEPS/wheels"
  # Abseil: headers, CMake package, and each shared library under the names the CMake package
  # (libabsl_x.so.20220623.0.0) and the loader (libabsl_x.so.20220623, the SONAME) look for.
  # Plain files, no symlinks, so that the tree travels as it is.
  cp -r /usr/include/absl "$prefix/include/"
  cp -r "$src/cmake/absl" "$prefix/lib/$MULTIARCH/cmake/"
  for f in "$src"/libabsl_*.so.*.*; do
    name="$(basename "$f")"
    cp -L "$f" "$prefix/lib/$MULTIARCH/$name"
    cp -L "$f" "$prefix/lib/$MULTIARCH/${name%.*.*}"
  done
  # nlohmann-json (header only) and zlib (replay reads .gz traces).
  cp -r /usr/include/nlohmann "$prefix/include/"
  cp -r /usr/share/cmake/nlohmann_json "$prefix/share/cmake/"
  cp /usr/include/zlib.h /usr/include/zconf.h "$prefix/include/"
  cp -L "$src/libz.so" "$prefix/lib/$MULTIARCH/libz.so"
  # Absolute paths left in the CMake files are only the Debian "/usr move" guard, which applies
  # when the file's real folder is /usr/...; anything else would tie the tree to this machine.
  if grep -rlE '"/usr/(include|lib/[^"]*/lib)' "$prefix/lib/$MULTIARCH/cmake" \
       "$prefix/share/cmake"; then
    echo "prepare: a copied CMake file names a /usr path outside the guard" >&2
    exit 1
  fi
  # Build wheels for the GPU image's Python 3.12, versions as in this project's .venv.
  local pip="$ROOT/.venv/bin/pip" skb pyb
  skb="$("$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("scikit-build-core"))')"
  pyb="$("$ROOT/.venv/bin/python" -c 'import importlib.metadata as m; print(m.version("pybind11"))')"
  "$pip" download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$DEPS/wheels" \
    "scikit-build-core==$skb" "pybind11==$pyb"
  echo "== $DEPS"
  ls "$DEPS/wheels"
  echo "abseil libraries: $(ls "$prefix/lib/$MULTIARCH"/libabsl_*.so.*.*.* | wc -l)"
  du -sh "$DEPS/prefix" "$DEPS/wheels"
  du -sh "$DEPS"
}

# ---------------------------------------------------------------------------------------------
declare -a ROWS=()
FAILED=0
row() {  # row STATUS NAME DETAIL
  ROWS+=("$(printf '%-4s  %-42s %s' "$1" "$2" "$3")")
  if [ "$1" = FAIL ]; then FAILED=1; fi
}

# make_venv DIR: a venv on the interpreter that holds torch, with torch's site-packages visible
# through a .pth (a venv made from a venv's python does not see that venv's packages, even with
# --system-site-packages, which is kept for an interpreter that is not a venv).
make_venv() {
  local dir="$1" site
  rm -rf "$dir"
  "$PY" -m venv --without-pip --system-site-packages "$dir" || return 1
  site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$TORCH_SITE')" > "$site/_vramledger_torch_site.pth"
}

# pip for the venv DIR: the interpreter's own pip, run against the venv (pip >= 22.3).
vpip() {
  local dir="$1"
  shift
  "$PY" -m pip --python "$dir/bin/python" --disable-pip-version-check "$@"
}

gpu() {
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    if [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3
    else PY="$ROOT/.venv/bin/python"; fi
  fi
  OUT="${OUT:-$ROOT/.devbuild/out-wheel}"
  local work="${WHEEL_WORK:-/tmp/wheel-check}" build_dir="${WHEEL_BUILD_DIR:-$ROOT/build-wheel}"
  local jobs="${JOBS:-$(nproc)}"
  mkdir -p "$OUT" "$work"
  OUT="$(cd "$OUT" && pwd)"
  if [ ! -d "$DEPS/prefix" ] || [ ! -d "$DEPS/wheels" ]; then
    echo "wheel_check: $DEPS is missing: run 'bash benchmarks/gpu/checks/wheel_check.sh prepare' and carry it" >&2
    exit 2
  fi
  TORCH_SITE="$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" || {
    echo "wheel_check: $PY cannot import torch" >&2; exit 2; }
  PATH="$PATH:$(dirname "$PY")"  # cmake / ninja installed as Python packages beside torch
  echo "== interpreter $PY: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
  echo "== Python.h: $("$PY" -c 'import os, sysconfig; h = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print(h if os.path.exists(h) else "MISSING (no _core)")')"
  # `pip --python` (22.3) runs this pip against the venvs; -C config settings need pip 23.1.
  if ! "$PY" -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (23, 1))'; then
    echo "wheel_check: $PY needs pip >= 23.1 (has $("$PY" -m pip --version))" >&2
    exit 2
  fi
  echo "== pip $("$PY" -m pip --version | cut -d' ' -f2), cmake $(cmake --version | head -1 | cut -d' ' -f3), ninja $(ninja --version 2>/dev/null), $(g++ --version | head -1), nvcc: $(command -v nvcc || echo none)"

  # 1. Build venv with the carried build dependencies, offline.
  local bv="$work/build-venv"
  make_venv "$bv" || { echo "wheel_check: cannot create a venv with $PY" >&2; exit 2; }
  vpip "$bv" install -q --no-index --find-links "$DEPS/wheels" --ignore-installed \
    scikit-build-core pybind11 || { echo "wheel_check: cannot install the build wheels" >&2; exit 2; }

  # 2. The wheel, from a clean build folder.
  rm -rf "$build_dir" "$OUT/dist"
  local t0 t1 build_s wheel
  t0=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL="$jobs" vpip "$bv" wheel -v --no-build-isolation --no-deps --no-index \
    -w "$OUT/dist" \
    -C "build-dir=$build_dir/{wheel_tag}" \
    -C "cmake.define.CMAKE_PREFIX_PATH=$DEPS/prefix" \
    "$ROOT" > "$OUT/wheel_build.log" 2>&1
  local rc=$?
  t1=$(date +%s)
  build_s=$((t1 - t0))
  grep -E 'vramledger: |Abseil libraries bundled' "$OUT/wheel_build.log" | sort -u
  wheel="$(ls "$OUT"/dist/vramledger-*.whl 2>/dev/null | head -1)"
  if [ $rc -ne 0 ] || [ -z "$wheel" ]; then
    tail -40 "$OUT/wheel_build.log"
    row FAIL "pip wheel" "exit $rc after ${build_s} s (log: $OUT/wheel_build.log)"
    finish
    return
  fi
  row PASS "pip wheel (${jobs} jobs)" "$(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB, ${build_s} s"
  # The pip build has no -Werror (pyproject.toml); what this compiler warns about is shown here.
  local warnings
  warnings="$(grep -E ': warning: ' "$OUT/wheel_build.log" | sort -u)"
  row INFO "compiler warnings" "$(grep -c . <<<"$warnings") (first ones above, all in wheel_build.log)"
  if [ -n "$warnings" ]; then head -5 <<<"$warnings"; fi
  local listing
  listing="$("$PY" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel")"
  local has
  for has in "_core.cpython-" libvramledger_plugin.so libvramledger_preload.so; do
    if grep -q "vramledger/$has" <<<"$listing"; then row PASS "wheel holds $has" ""
    else row FAIL "wheel holds $has" "missing"; fi
  done
  row INFO "wheel Abseil libraries" "$(grep -c 'vramledger/libabsl_' <<<"$listing")"

  # 3. A second fresh venv with only the wheel; the deps folder hidden.
  local rv="$work/run-venv"
  make_venv "$rv" || { row FAIL "run venv" "cannot create"; finish; return; }
  if ! vpip "$rv" install -q --no-index --no-deps --ignore-installed "$wheel"; then
    row FAIL "pip install wheel" ""
    finish
    return
  fi
  mv "$DEPS" "$DEPS.hidden"
  trap 'mv "$DEPS.hidden" "$DEPS" 2>/dev/null' EXIT
  local pkg
  pkg="$(cd "$work" && env -u PYTHONPATH "$rv/bin/python" -c \
    'import os, importlib.util as u; print(os.path.dirname(u.find_spec("vramledger").origin))')"
  row INFO "installed package" "$pkg"
  case "$pkg" in "$rv"/*) ;; *) row FAIL "package is the wheel's" "$pkg is outside $rv" ;; esac
  local run=(env -u LD_LIBRARY_PATH -u PYTHONPATH -u VRAMLEDGER_PLUGIN)

  # 4. Checks.
  local out
  if out="$(cd "$work" && "${run[@]}" "$rv/bin/vramledger" --version 2>&1)"; then
    row PASS "vramledger --version" "$out"
  else row FAIL "vramledger --version" "$out"; fi
  if out="$(cd "$work" && "${run[@]}" "$rv/bin/python" -m vramledger --help 2>&1)"; then
    row PASS "python -m vramledger --help" "$(grep -c . <<<"$out") lines"
  else row FAIL "python -m vramledger --help" "$(tail -1 <<<"$out")"; fi

  # _core: imported, and every Abseil library in the process mapped from the package folder.
  if out="$(cd "$work" && "${run[@]}" "$rv/bin/python" - "$pkg" 2>&1 <<'PY'
import sys
import vramledger._core as core
maps = open("/proc/self/maps").read().split("\n")
absl = sorted({l.split()[-1] for l in maps if "libabsl_" in l})
outside = [a for a in absl if not a.startswith(sys.argv[1] + "/")]
print(f"{len(absl)} Abseil libraries mapped, outside the package: {outside or 'none'}")
sys.exit(1 if outside or not absl else 0)
PY
)"; then row PASS "import vramledger._core" "$out"
  else row FAIL "import vramledger._core" "$(tail -2 <<<"$out" | tr '\n' ' ')"; fi

  # ldd: nothing 'not found', and Abseil resolved from the package folder.
  local so nf absl_out
  for so in "$pkg"/_core.cpython-*.so "$pkg/libvramledger_plugin.so" "$pkg/libvramledger_preload.so"; do
    [ -e "$so" ] || continue
    # libc10 / libcudart come from torch (torch/lib, nvidia/cu13/lib), which the process has
    # loaded before the plugin; ldd is shown those folders, as the process would have them.
    out="$("${run[@]}" LD_LIBRARY_PATH="$TORCH_SITE/torch/lib:$TORCH_SITE/nvidia/cu13/lib:$TORCH_SITE/nvidia/cuda_runtime/lib" ldd "$so" 2>&1)"
    nf="$(grep 'not found' <<<"$out" | awk '{print $1}' | tr '\n' ' ')"
    absl_out="$(grep 'libabsl_' <<<"$out" | grep -vc "=> $pkg/")"
    echo "--- ldd $(basename "$so")"
    echo "$out" | grep -E 'libabsl_(base|status|strings)\.|libz|libc10|cudart|not found'
    if [ -z "$nf" ] && [ "$absl_out" = 0 ]; then
      row PASS "ldd $(basename "$so")" "$(grep -c 'libabsl_' <<<"$out") Abseil from the package, none missing"
    else
      row FAIL "ldd $(basename "$so")" "not found: ${nf:-none}; Abseil from elsewhere: $absl_out"
    fi
  done

  # The plugin in a CUDA process.
  local cuda
  cuda="$(cd "$work" && "${run[@]}" "$rv/bin/python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null)"
  if [ "$cuda" = 1 ]; then
    if out="$(cd "$work" && "${run[@]}" "$rv/bin/python" -c "
import vramledger
vramledger.install()
import torch
x = torch.ones(1 << 20, device='cuda')
print(torch.cuda.get_allocator_backend(), vramledger.memory_stats()['allocated_bytes.all.current'])
" 2>&1)"; then
      if [ "$(tail -1 <<<"$out" | awk '{print $2}')" -ge 4194304 ] 2>/dev/null; then
        row PASS "install() + 4 MiB tensor" "$(tail -1 <<<"$out")"
      else row FAIL "install() + 4 MiB tensor" "$(tail -1 <<<"$out")"; fi
    else row FAIL "install() + 4 MiB tensor" "$(tail -2 <<<"$out" | tr '\n' ' ')"; fi
  else
    row SKIP "install() + 4 MiB tensor" "torch.cuda.is_available() is False"
  fi

  # Replay through the console script.
  if (cd "$work" && "${run[@]}" "$rv/bin/vramledger" replay "$ROOT/traces/trace-gpt2m-native.csv.gz" \
        --json > "$OUT/replay.json" 2> "$OUT/replay.err"); then
    head -c 400 "$OUT/replay.json"; echo
    out="$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(next((f"{k}={d[k]}" for k in ("peak_reserved_bytes", "peak_reserved") if k in d), f"{len(d)} keys"))' "$OUT/replay.json" 2>&1)"
    row PASS "vramledger replay --json" "$out"
  else row FAIL "vramledger replay --json" "$(tail -1 "$OUT/replay.err")"; fi

  mv "$DEPS.hidden" "$DEPS"
  trap - EXIT
  finish
}

finish() {
  echo
  echo "== wheel_check ($(uname -n), $(date -u +%FT%TZ))"
  printf '%s\n' "${ROWS[@]}" | tee "$OUT/wheel_check_table.txt"
  if [ $FAILED -eq 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
  exit $FAILED
}

case "${1:-}" in
  prepare) prepare ;;
  gpu) gpu ;;
  *) echo "usage: $0 prepare|gpu" >&2; exit 2 ;;
esac
